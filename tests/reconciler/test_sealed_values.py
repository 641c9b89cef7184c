"""Sealed parameter values on a whole device client: `open_reconciler` as `margo device run`
assembles it (its encryption key created in the data directory on the first start), the
Git source reading a local repository that plays the fleet server's part, the render driver
with charts from the real OCI registry, rendered by the real Helm engine.

Each value is sealed here as the server's compiler seals it (`margo.sealing.seal`, to the
recipient the device generated). What is asserted: the plaintext reaches the driver's
product (the rendered files) and nothing else the device keeps or says (the data
directory, byte for byte: adopted documents, journal, status reports, caches, keys; the
logs; the cycle results); the same plaintext sealed again is no change; a value sealed to
another key or tampered with fails its component with SECRET_UNREADABLE, the previous
render kept, and is tried again once the server sends a new envelope; a rotated key keeps
opening what was sealed to the previous one.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyrage
import pytest
import yaml
from kits.chartkit import publish_chart, write_chart
from kits.gitbox import Box, found_anywhere, git_box, tampered

from margo.sealing import seal
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.encryption_key import DeviceKey, rotate_key
from reconciler.errors import ErrorCode
from reconciler.releases import release_name
from reconciler.runner import CycleResult
from reconciler.state import DeviceState

DEVICE = "vault-box"
DEPLOYMENT_ID = "7d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
RELEASE = release_name(DEPLOYMENT_ID, "greeter")


def plaintext() -> str:
    """A secret no file could hold by chance (the greeter's schema allows 32 characters)."""
    return f"pw-{secrets.token_hex(10)}"


def document(repository: str, greeting: str) -> bytes:
    return yaml.safe_dump({
        "id": DEPLOYMENT_ID,
        "metadata": {"name": "vault", "namespace": "edge", "deviceId": DEVICE},
        "spec": {"applicationId": "com-example-vault", "deploymentProfile": {
            "type": "helm", "components": [{"name": "greeter", "properties": {
                "repository": repository, "revision": "1.0.0", "wait": False}}]},
            "parameters": {"greeting": {"value": greeting, "targets": [
                {"pointer": "config.greeting", "components": ["greeter"]}]}}}},
        sort_keys=False).encode()


@dataclass
class VaultBox(Box):
    """A box whose desired state is the one deployment, on `chart`, greeting as given."""

    chart: str

    @property
    def configmap(self) -> Path:
        return self.rendered(DEPLOYMENT_ID)

    def publish(self, greeting: str) -> None:
        self.commit({"vault.yaml": document(self.chart, greeting)})


#: A template that quotes the value in Helm's error (plain and base64) when it is told to fail.
REFUSE = """\
{{- if hasPrefix "fail-" .Values.config.greeting }}
{{- fail (printf "refusing %s (%s)" .Values.config.greeting (b64enc .Values.config.greeting)) }}
{{- end }}
"""


@pytest.fixture(scope="module")
def chart(registry: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    source = write_chart(tmp_path_factory.mktemp("charts"))
    (source / "templates" / "refuse.yaml").write_text(REFUSE)
    return publish_chart(registry, source, repo_path="sealed")


@pytest.fixture
def box(tmp_path: Path, chart: str) -> Iterator[VaultBox]:
    made = git_box(tmp_path, VaultBox, device=DEVICE, model="V-1", chart=chart)
    yield made
    made.repo.free()


def outcomes(result: CycleResult) -> list[tuple[str, str]]:
    return [(action, outcome) for action, _, _, outcome in result.steps]


def test_sealed_values_reach_the_rendered_files_and_nothing_else(
        box: VaultBox, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = load_config(box.config)
    first, second, third, fourth = plaintext(), plaintext(), plaintext(), plaintext()
    refused = ""
    results: list[CycleResult] = []
    with open_reconciler(config) as device:
        key_file = box.home / "data" / "keys" / "encryption.age"
        assert config.encryption_key == key_file and key_file.stat().st_mode & 0o777 == 0o600
        recipient = DeviceKey.open(key_file, create=False).recipient()

        # Install: the opened value is in the rendered ConfigMap.
        box.publish(seal(first, recipient, mac="1" * 32))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("install", "ok")]
        assert f'greeting: "{first}"' in box.configmap.read_text()

        # The server seals the same plaintext again (a new ciphertext, the same mac): no change.
        box.publish(seal(first, recipient, mac="1" * 32))
        results.append(device.cycle())
        assert results[-1].fetched == "adopted" and outcomes(results[-1]) == []

        # Sealed to a key this device does not hold: failed, the previous render kept.
        stranger = str(pyrage.x25519.Identity.generate().to_public())
        box.publish(seal(second, stranger, mac="2" * 32))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("reconfigure", "failed: SECRET_UNREADABLE")]
        assert f'greeting: "{first}"' in box.configmap.read_text()
        [failure] = results[-1].failures[-1:]
        assert "sealed to another device key" in failure and "config.greeting" in failure
        # Not retryable with the same envelope ...
        results.append(device.cycle())
        assert outcomes(results[-1]) == [] and "waiting to retry" in results[-1].failures[-1]
        # ... tried again as soon as the server has sealed it to this device's key.
        box.publish(seal(second, recipient, mac="2" * 32))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("reconfigure", "ok")]
        assert f'greeting: "{second}"' in box.configmap.read_text()

        # Tampered with: failed, the previous render kept.
        box.publish(tampered(seal(third, recipient, mac="3" * 32)))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("reconfigure", "failed: SECRET_UNREADABLE")]
        assert "damaged or tampered with" in results[-1].failures[-1]
        assert f'greeting: "{second}"' in box.configmap.read_text()

        # Helm's own error quotes the value: the message keeps the words, not the value.
        refused = f"fail-{secrets.token_hex(8)}"
        box.publish(seal(refused, recipient, mac="5" * 32))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("reconfigure", "failed: RENDER_FAILED")]
        assert "refusing <sealed value> (<sealed value>)" in results[-1].failures[-1]
        assert f'greeting: "{second}"' in box.configmap.read_text()

        # A rotation beside the running client: a value still sealed to the previous key
        # (the server has not re-sealed yet) opens.
        old, new = rotate_key(key_file)
        assert old == recipient and new != recipient
        box.publish(seal(fourth, recipient, mac="4" * 32))
        results.append(device.cycle())
        # (an upgrade: the failed render left the ledger saying `failed`)
        assert outcomes(results[-1]) == [("upgrade", "ok")]
        assert f'greeting: "{fourth}"' in box.configmap.read_text()

    with DeviceState(box.home / "data" / "device-state.sqlite") as state:
        record = state.component_states(DEPLOYMENT_ID)["greeter"]
        assert record.state == "installed"
        journal = b"\n".join(entry.body for entry in state.pending(1000))
    assert ErrorCode.SECRET_UNREADABLE.encode() in journal  # the failures were reported ...
    everything = [first, second, third, fourth, refused]
    # ... and nothing the device keeps or says holds a plaintext (the search does see what
    # the files hold: the adopted documents' envelopes).
    assert found_anywhere(box.home / "data", ["margo-sealed:v1:"])
    assert found_anywhere(box.home / "data", everything) == []
    assert [t for t in everything if t in caplog.text] == []
    assert [t for t in everything if any(t in str(r) for r in results)] == []
    # The rendered files are the product: the last value is there, owner-only.
    assert found_anywhere(box.home / "out", everything) == [f"{box.configmap}: {fourth}"]
    assert box.configmap.stat().st_mode & 0o777 == 0o600
    assert (box.home / "out" / "edge" / RELEASE).stat().st_mode & 0o777 == 0o700


def test_the_render_driver_never_writes_opened_values_into_the_data_directory(
        box: VaultBox) -> None:
    """Its outputDir defaults to `<dataDir>/rendered`: a sealed value there is refused
    (`SECRET_EXPOSED`, not retried), nothing rendered; clear values still render."""
    settings = yaml.safe_load(box.config.read_text())
    del settings["driver"]["outputDir"]  # the default, inside the data directory
    box.config.write_text(yaml.safe_dump(settings))
    config = load_config(box.config)
    secret = plaintext()
    with open_reconciler(config) as device:
        recipient = DeviceKey.open(config.encryption_key, create=False).recipient()
        box.publish(seal(secret, recipient, mac="1" * 32))
        result = device.cycle()
        assert outcomes(result) == [("install", "failed: SECRET_EXPOSED")]
        assert "set driver.outputDir outside dataDir" in result.failures[-1]
        assert found_anywhere(box.home, [secret]) == []
        box.publish("Hello in clear")
        assert outcomes(device.cycle()) == [("install", "ok")]
