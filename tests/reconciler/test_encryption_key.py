"""The device's encryption key (real age identities through pyrage, real files) and the
opening of sealed values a driver does before applying (`reconciler.sealed_values`):
created once with owner-only modes, read again on later starts and after a rotation beside
a running client, refused (naming the file, never quoting it) when damaged or readable by
others; rotated by `margo device rotate-key`, the previous key still opening what was sealed
to it; and every way an envelope can fail is SECRET_UNREADABLE without a plaintext."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pyrage
import pytest
import yaml

from margo.digests import data_digest
from margo.sealing import seal
from margo_cli.main import main
from reconciler.desired import parse_deployment
from reconciler.encryption_key import DeviceKey, EncryptionKeyError, previous_path, rotate_key
from reconciler.errors import ApplyError, ErrorCode
from reconciler.sealed_values import REDACTED, open_values

SECRET = "hunter2-but-longer"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_key_is_created_once_owner_only_and_read_again(tmp_path: Path) -> None:
    path = tmp_path / "data" / "keys" / "encryption.age"
    key = DeviceKey.open(path)
    recipient = key.recipient()
    assert recipient.startswith("age1") and key.previous_recipient() is None
    assert (mode(path), mode(path.parent)) == (0o600, 0o700)
    text = path.read_text()
    # An age identity file as age-keygen writes it: `age -d -i` and `age-keygen -y` read it.
    assert text.splitlines()[0] == f"# public key: {recipient}"
    [secret] = [line for line in text.splitlines() if not line.startswith("#")]
    assert str(pyrage.x25519.Identity.from_str(secret).to_public()) == recipient
    # A later start reads the same key; nothing is rewritten.
    before = path.stat().st_mtime_ns
    assert DeviceKey.open(path).recipient() == recipient
    assert path.stat().st_mtime_ns == before
    assert DeviceKey.existing(tmp_path / "elsewhere.age") is None
    assert not (tmp_path / "elsewhere.age").exists()
    assert key.open_sealed(seal(SECRET, recipient, mac="0" * 32)) == SECRET


@pytest.mark.parametrize("content", [
    b"", b"# public key: age1...\n", b"AGE-SECRET-KEY-1XYZ\n", b"\xff\xfe not text",
    b"AGE-SECRET-KEY-1A\nAGE-SECRET-KEY-1B\n"])
def test_a_damaged_key_file_is_an_error_naming_it(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "encryption.age"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(EncryptionKeyError) as raised:
        DeviceKey.open(path)
    assert str(path) in str(raised.value)
    assert "AGE-SECRET-KEY-1XYZ" not in str(raised.value)
    assert path.read_bytes() == content  # never replaced by a new key


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "encryption.age"
    DeviceKey.open(path)
    path.chmod(0o644)
    with pytest.raises(EncryptionKeyError, match="accessible to other users"):
        DeviceKey.open(path)


def test_rotation_keeps_the_previous_key_for_what_is_still_sealed_to_it(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "encryption.age"
    running = DeviceKey.open(path)  # a client holding the key while the operator rotates
    first = running.recipient()
    old_value = seal(SECRET, first, mac="1" * 32)
    assert rotate_key(path) == (first, running.recipient())
    second = running.recipient()  # re-read: the files changed
    assert second != first and running.previous_recipient() == first
    assert mode(previous_path(path)) == 0o600
    assert running.open_sealed(old_value) == SECRET  # by the previous key, found by fingerprint
    assert running.open_sealed(seal("new", second, mac="2" * 32)) == "new"
    # A second rotation drops the first key: what is still sealed to it no longer opens.
    rotate_key(path)
    with pytest.raises(ApplyError) as raised:
        open_values({"DB_PASSWORD": old_value}, running, component="db")
    assert raised.value.code == ErrorCode.SECRET_UNREADABLE
    assert "sealed to another device key" in raised.value.message


def device_home(tmp_path: Path, **identity: str) -> Path:
    """A device directory with a configuration (render driver, a capabilities file)."""
    (tmp_path / "token").write_text("t\n")
    (tmp_path / "caps.yaml").write_text(yaml.safe_dump({"properties": {
        "id": "box-1", "vendor": "Acme", "modelNumber": "B", "serialNumber": "1",
        "supportedDeploymentTypes": ["helm"]}}))
    config = tmp_path / "device.yaml"
    config.write_text(yaml.safe_dump({
        "device": {"id": "box-1"},
        "server": {"url": "http://127.0.0.1:9", "clientId": "box-1", "tokenFile": "token"},
        "source": {"type": "margo-rest"}, "driver": {"type": "render"}, "dataDir": "data",
        "capabilities": {"file": "caps.yaml"}, **({"identity": identity} if identity else {})}))
    return config


def test_margo_device_rotate_key_and_capabilities(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = device_home(tmp_path, encryptionKey="secrets/device.age")
    path = tmp_path / "secrets" / "device.age"
    # `capabilities` never creates the key (the client does, at its first start).
    assert main(["device", "capabilities", "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "x-margo-gitops-extensions" not in shown and not path.exists()

    assert main(["device", "rotate-key", "--config", str(config)]) == 0
    first = DeviceKey.open(path, create=False).recipient()
    assert capsys.readouterr().out == f"new encryption key: {first} ({path})\n"
    assert not previous_path(path).exists()
    assert main(["device", "rotate-key", "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    second = DeviceKey.open(path, create=False)
    assert second.previous_recipient() == first and f"previous key, kept until the server " \
        f"re-seals: {first} ({previous_path(path)})" in printed
    assert main(["device", "capabilities", "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["x-margo-gitops-extensions"] == {
        "encryptionKey": {"type": "age-x25519", "recipient": second.recipient()}}

    path.write_text("AGE-SECRET-KEY-1 not a key\n")
    path.chmod(0o600)
    assert main(["device", "rotate-key", "--config", str(config)]) == 1
    error = capsys.readouterr().err
    assert str(path) in error and "damaged" in error and "not a key" not in error


def envelope_cases(recipient: str) -> dict[str, tuple[str, str]]:
    """name -> (an envelope that does not open with `recipient`'s key, what the error says)."""
    good = seal(SECRET, recipient, mac="5" * 32)
    head, _, body = good.rpartition(":")
    stranger = str(pyrage.x25519.Identity.generate().to_public())
    return {
        "malformed": ("margo-sealed:v1:not-an-envelope", "malformed sealed value"),
        "not base64": (f"{head}:{body[:-4]}!!!!", "not base64"),
        "tampered": (f"{head}:{body[:40]}{'A' if body[40] != 'A' else 'B'}{body[41:]}",
                     "damaged or tampered with"),
        "another key": (seal(SECRET, stranger, mac="5" * 32), "sealed to another device key"),
    }


@pytest.mark.parametrize("case", ["malformed", "not base64", "tampered", "another key",
                                  "no key"])
def test_an_envelope_that_does_not_open_is_secret_unreadable(tmp_path: Path, case: str) -> None:
    key = DeviceKey.open(tmp_path / "encryption.age")
    value, says = envelope_cases(key.recipient()).get(case) or (
        seal(SECRET, key.recipient(), mac="5" * 32), "has no key to open it")
    values = {"config": {"users": [{"name": "admin", "password": value}]}, "replicas": 2}
    with pytest.raises(ApplyError) as raised:
        open_values(values, None if case == "no key" else key, component="db")
    error = raised.value
    assert (error.code, error.retryable) == (ErrorCode.SECRET_UNREADABLE, False)
    assert says in error.message and "component 'db'" in error.message
    assert "config.users[0].password" in error.message
    assert SECRET not in error.message and error.__cause__ is None


def test_opened_values_and_messages_without_them(tmp_path: Path) -> None:
    key = DeviceKey.open(tmp_path / "encryption.age")
    values = {"config": {"password": seal(SECRET, key.recipient(), mac="6" * 32)},
              "plain": ["a", 1]}
    opened = open_values(values, key, component="db")
    assert opened.values == {"config": {"password": SECRET}, "plain": ["a", 1]}
    assert opened.paths == frozenset({"config.password"}) and opened.digest_key
    with pytest.raises(ApplyError) as raised, opened.redacting():
        raise ApplyError(ErrorCode.INSTALL_FAILED, f'bad "{SECRET}" in data: '
                         f'{{"password": "aHVudGVyMi1idXQtbG9uZ2Vy"}}', retryable=False)
    assert raised.value.message == f'bad "{REDACTED}" in data: {{"password": "{REDACTED}"}}'
    assert not raised.value.retryable and raised.value.__cause__ is None
    plain = open_values({"A": "1"}, None, component="web")
    assert (plain.values, plain.secrets, plain.digest_key) == ({"A": "1"}, (), None)


def test_digests_follow_the_plaintexts_mac_not_the_ciphertext(tmp_path: Path) -> None:
    recipient = DeviceKey.open(tmp_path / "encryption.age").recipient()

    def component(value: object) -> tuple[str, str]:
        parsed = parse_deployment(yaml.safe_dump({
            "id": "1f2e3d4c-5b6a-4978-8a9b-0c1d2e3f4a5b",
            "metadata": {"name": "db", "namespace": "edge", "deviceId": "box-1"},
            "spec": {"applicationId": "db", "deploymentProfile": {"type": "compose",
                     "components": [{"name": "db", "properties": {
                         "repository": "oci://r.example/db", "revision": "1.0.0"}}]},
                     "parameters": {"password": {"value": value, "targets": [
                         {"pointer": "DB_PASSWORD", "components": ["db"]}]}}}}).encode())
        [only] = parsed.components
        assert only.values["DB_PASSWORD"] == value  # kept sealed in the desired state
        return only.values_digest, only.sealed_digest

    first = component(seal(SECRET, recipient, mac="7" * 32))
    resealed = component(seal(SECRET, recipient, mac="7" * 32))
    changed = component(seal("another", recipient, mac="8" * 32))
    assert first[0] == resealed[0] and first[1] != resealed[1]
    assert changed[0] != first[0]
    # Nothing sealed: the digests every installed release already carries.
    assert component("plain") == (data_digest({"DB_PASSWORD": "plain"}), "")
