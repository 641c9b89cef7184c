"""Capability providers (this machine's real facts, operator files) and the sender, which
reports to a real `margo serve` only when something changed."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.serverkit import add_client, assert_matches_openapi, free_port, running_server

from margo.errors import DocumentError
from margo.kinds import Kind, Shape
from margo.quantity import parse_quantity
from margo.sealing import device_recipient
from margo.validation import validate_value
from reconciler.capabilities import (
    CapabilityReporter,
    HostProvider,
    KeyReporting,
    StaticProvider,
    format_bytes,
    report_all,
    shape_capabilities,
)
from reconciler.encryption_key import DeviceKey, rotate_key
from reconciler.state import DeviceState


def host(device_id: str = "edge-1", **overrides: Any) -> HostProvider:
    arguments: dict[str, Any] = {
        "vendor": "Acme", "model_number": "E-100", "serial_number": "SN-1",
        "deployment_types": ["compose"], "otel_collector": True,
        "labels": {"example.com/site": "plant-b"}, "storage_path": Path("/"), **overrides}
    return HostProvider(device_id, **arguments)


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


# --- providers -------------------------------------------------------------------------------


def test_host_facts_are_this_machines(tmp_path: Path) -> None:
    doc = host(storage_path=tmp_path).gather()
    props = doc["properties"]
    assert props["cpus"][0]["cores"] == os.cpu_count()
    assert props["cpus"][0].get("architecture", "arm") in ("amd64", "arm64", "arm")
    memory = int(parse_quantity(props["memory"]))
    assert 0.9 * mem_total() <= memory <= mem_total()
    stats = os.statvfs(tmp_path)
    storage = int(parse_quantity(props["storage"]))
    assert 0.9 * stats.f_frsize * stats.f_blocks <= storage <= stats.f_frsize * stats.f_blocks
    links = [p for p in Path("/sys/class/net").iterdir() if p.name != "lo"]
    assert len(props["interfaces"]) <= len(links)
    assert {i["type"] for i in props["interfaces"]} <= {"ethernet", "wifi"}
    assert (props["otelCollector"], props["supportedRuntimes"]) == (True, ["oci"])
    assert doc["labels"] == {"example.com/site": "plant-b"}
    assert "apiVersion" not in doc  # the official rc.3 schema does not allow it
    assert validate_value(doc, expect=Kind.DEVICE_CAPABILITIES).shape == Shape.RC3
    assert_matches_openapi("rc.3", "DeviceCapabilitiesManifest", doc)


def fake_sysfs(root: Path) -> Path:
    """A /sys/class/net-like tree of real files: what the kernel shows for each link kind."""
    net = root / "net"
    for name, link_type, physical, wireless in [
            ("lo", "772", False, False), ("eth0", "1", True, False), ("wlan0", "1", True, True),
            ("docker0", "1", False, False), ("tun0", "65534", False, False)]:
        link = net / name
        link.mkdir(parents=True)
        (link / "type").write_text(link_type + "\n")
        if physical:
            (link / "device").mkdir()
        if wireless:
            (link / "wireless").mkdir()
    return net


def test_interfaces_memory_and_architecture_from_given_files(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2048000 kB\nMemFree:  10 kB\n")
    net = fake_sysfs(tmp_path)
    doc = host(storage_path=tmp_path, proc_meminfo=meminfo, sys_class_net=net,
               machine=lambda: "armv7l").gather()
    props = doc["properties"]
    assert props["interfaces"] == [{"type": "ethernet"}, {"type": "wifi"}]  # docker0 skipped
    assert props["memory"] == "2000 Mi"
    assert props["cpus"][0]["architecture"] == "arm"
    # in a container the only links are virtual; they still count
    container = tmp_path / "container"
    (container / "eth0").mkdir(parents=True)
    (container / "eth0" / "type").write_text("1\n")
    assert host(storage_path=tmp_path, sys_class_net=container).gather()[
        "properties"]["interfaces"] == [{"type": "ethernet"}]
    assert host(storage_path=tmp_path, machine=lambda: "aarch64").gather()[
        "properties"]["cpus"][0]["architecture"] == "arm64"
    unknown = host(storage_path=tmp_path, machine=lambda: "riscv64").gather()
    assert "architecture" not in unknown["properties"]["cpus"][0]


def test_host_provider_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="supportedDeploymentTypes"):
        host(storage_path=tmp_path, deployment_types=["docker-swarm"]).gather()
    empty = tmp_path / "meminfo"
    empty.write_text("MemFree: 1 kB\n")
    with pytest.raises(ValueError, match="no MemTotal"):
        host(storage_path=tmp_path, proc_meminfo=empty).gather()
    # Not made yet (a fresh device's data directory): the file system it will be made on.
    assert host(storage_path=tmp_path / "missing" / "data").gather()["properties"][
        "storage"] == host(storage_path=tmp_path).gather()["properties"]["storage"]
    assert not (tmp_path / "missing").exists()


def test_format_bytes() -> None:
    assert format_bytes(59 * 1024**3 + 5) == "59 Gi"
    assert format_bytes(int(9.5 * 1024**3)) == "9728 Mi"
    assert format_bytes(1024**2 - 1) == "0 Mi"


def test_static_provider_json_and_yaml(tmp_path: Path) -> None:
    doc = host(storage_path=tmp_path).gather()
    as_json = tmp_path / "caps.json"
    as_json.write_text(json.dumps(doc))
    assert StaticProvider(as_json).gather() == doc
    as_yaml = tmp_path / "caps.yaml"
    as_yaml.write_text("properties:\n  id: edge-1\n  vendor: Acme\n  modelNumber: E-1\n"
                       "  serialNumber: '007'\n  memory: 59 Gi\n")
    assert StaticProvider(as_yaml).gather()["properties"]["serialNumber"] == "007"


def test_static_provider_reports_located_problems(tmp_path: Path) -> None:
    bad = tmp_path / "caps.yaml"
    bad.write_text("properties:\n  id: edge-1\n  vendor: Acme\n  modelNumber: E-1\n"
                   "  serialNumber: S\n  memory: lots\n  supportedRuntimes: [wasm]\n")
    with pytest.raises(DocumentError) as caught:
        StaticProvider(bad).gather()
    located = {(p.json_path, p.line) for p in caught.value.problems}
    assert ("$.properties.supportedRuntimes[0]", 7) in located
    with pytest.raises(OSError):
        StaticProvider(tmp_path / "missing.json").gather()


@pytest.mark.parametrize("generation", ["rc.3", "rc.2", "oct-2024"])
def test_documents_are_shaped_for_each_generation(tmp_path: Path, generation: str) -> None:
    doc = host(storage_path=tmp_path, deployment_types=["helm", "compose"]).gather()
    shaped = shape_capabilities(doc, generation)
    model = validate_value(shaped, expect=Kind.DEVICE_CAPABILITIES)
    assert sorted(model.properties["supportedDeploymentTypes"]) == ["compose", "helm"]
    if generation == "oct-2024":
        assert model.shape == Shape.OCT_2024
        assert shaped["properties"]["roles"] == ["Standalone Cluster", "Standalone Device"]
        assert shaped["properties"]["resources"]["cpu"]["cores"] == os.cpu_count()
        assert "labels" not in shaped
    elif generation == "rc.2":
        assert shaped["kind"] == "DeviceCapabilitiesManifest"
        assert_matches_openapi("rc.2", "DeviceCapabilitiesManifest",
                               {k: v for k, v in shaped.items() if k != "labels"})
    else:
        assert "kind" not in shaped
        assert_matches_openapi("rc.3", "DeviceCapabilitiesManifest", shaped)


@pytest.mark.parametrize("generation", ["rc.3", "rc.2", "oct-2024"])
def test_every_generation_carries_the_encryption_key(tmp_path: Path, generation: str) -> None:
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    caps = tmp_path / "caps.yaml"  # a provider that fills the extension itself
    caps.write_text(yaml.safe_dump({
        "properties": {"id": "edge-1", "vendor": "Acme", "modelNumber": "E-1",
                       "serialNumber": "1", "supportedDeploymentTypes": ["helm"]},
        "x-margo-gitops-extensions": {"cluster": {"name": "line-3"}}}))
    for provider in (KeyReporting(StaticProvider(caps), key.recipient),
                     KeyReporting(host(storage_path=tmp_path), key.recipient)):
        shaped = shape_capabilities(provider.gather(), generation)
        validate_value(shaped, expect=Kind.DEVICE_CAPABILITIES)
        extension = shaped["x-margo-gitops-extensions"]
        assert device_recipient(shaped) == key.recipient()
        assert extension["encryptionKey"] == {"type": "age-x25519",
                                              "recipient": key.recipient()}
        if isinstance(provider.provider, StaticProvider):  # merged, not replaced
            assert extension["cluster"] == {"name": "line-3"}


def test_oct_2024_needs_a_role(tmp_path: Path) -> None:
    doc = host(storage_path=tmp_path, deployment_types=["custom"], runtimes=["custom"]).gather()
    with pytest.raises(ValueError, match="role"):
        shape_capabilities(doc, "oct-2024")


# --- the sender against the real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("wfm") / "data"
    token = add_client(data, "site-a")
    with running_server(data) as base:
        yield {"base": base, "token": token, "data": data}


class Counting:
    """An httpx client to the server that counts the requests it sends."""

    def __init__(self, server: dict[str, Any], token: str | None = None,
                 base: str | None = None) -> None:
        self.requests: list[str] = []
        self.http = httpx.Client(
            base_url=base or server["base"], timeout=10,
            headers={"Authorization": f"Bearer {token or server['token']}"},
            event_hooks={"request": [lambda r: self.requests.append(f"{r.method} {r.url.path}")]})

    def __enter__(self) -> Counting:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.http.close()


def history(server: dict[str, Any], device_id: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{server['data'] / 'wfm.sqlite'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT document FROM capability_reports WHERE device_id = ? "
                            "ORDER BY id", (device_id,)).fetchall()
    finally:
        conn.close()
    return [json.loads(r[0]) for r in rows]


def test_sent_once_not_resent_unchanged_resent_when_changed(server: dict[str, Any],
                                                            tmp_path: Path) -> None:
    provider = host("edge-caps", storage_path=tmp_path)
    state_path = tmp_path / "device.sqlite"
    with Counting(server) as counting, DeviceState(state_path) as state:
        reporter = CapabilityReporter(counting.http, state, generation="rc.3",
                                      device_id="edge-caps")
        first = reporter.report(provider.gather())
        assert (first.kind, first.status, first.sent) == ("delivered", 201, True)
        assert counting.requests == ["PUT /api/v1/capabilities/edge-caps"]
        again = reporter.report(provider.gather())
        assert (again.kind, again.sent) == ("unchanged", False)
        assert len(counting.requests) == 1  # nothing sent
    with Counting(server) as counting, DeviceState(state_path) as state:  # a restart
        reporter = CapabilityReporter(counting.http, state, generation="rc.3",
                                      device_id="edge-caps")
        assert reporter.report(provider.gather()).kind == "unchanged"
        assert counting.requests == []
        changed = host("edge-caps", storage_path=tmp_path,
                       labels={"example.com/site": "plant-c"}).gather()
        updated = reporter.report(changed)
        assert (updated.kind, updated.status) == ("delivered", 200)
        forced = reporter.report(changed, force=True)
        assert forced.sent and forced.status == 200
        assert len(counting.requests) == 2
    reports = history(server, "edge-caps")
    assert [r["labels"]["example.com/site"] for r in reports] == ["plant-b", "plant-c"]


@pytest.mark.parametrize(("generation", "device_id"),
                         [("rc.2", "edge-rc2"), ("oct-2024", "edge-oct")])
def test_older_generations_use_their_own_routes(server: dict[str, Any], tmp_path: Path,
                                                generation: str, device_id: str) -> None:
    provider = host(device_id, storage_path=tmp_path)
    with Counting(server) as counting, DeviceState(tmp_path / "d.sqlite") as state:
        reporter = CapabilityReporter(counting.http, state, generation=generation,
                                      device_id=device_id, client_id="site-a")
        outcome = reporter.report(provider.gather())
        assert (outcome.kind, outcome.status) == ("delivered", 201)
        assert reporter.report(provider.gather()).kind == "unchanged"
        expected = {"rc.2": f"PUT /api/v1/clients/site-a/capabilities/{device_id}",
                    "oct-2024": f"PUT /device/{device_id}/capabilities"}[generation]
        assert counting.requests == [expected]
    [stored] = history(server, device_id)
    assert stored == shape_capabilities(provider.gather(), generation)


@pytest.mark.parametrize(("generation", "device_id"), [
    ("rc.3", "edge-key-rc3"), ("rc.2", "edge-key-rc2"), ("oct-2024", "edge-key-oct")])
def test_the_server_gets_the_key_and_a_rotated_one_at_once(
        server: dict[str, Any], tmp_path: Path, generation: str, device_id: str) -> None:
    path = tmp_path / "keys" / "encryption.age"
    key = DeviceKey.open(path)
    provider = KeyReporting(host(device_id, storage_path=tmp_path), key.recipient)
    with Counting(server) as counting, DeviceState(tmp_path / "d.sqlite") as state:
        reporter = CapabilityReporter(counting.http, state, generation=generation,
                                      device_id=device_id, client_id="site-a")
        assert reporter.report(provider.gather()).kind == "delivered"
        assert reporter.report(provider.gather()).kind == "unchanged"
        first = key.recipient()
        rotate_key(path)
        rotated = reporter.report(provider.gather())  # nothing else changed
        assert rotated.kind == "delivered" and rotated.sent
    reports = history(server, device_id)
    assert [device_recipient(r) for r in reports] == [first, key.recipient()]


def test_failures_are_outcomes_and_nothing_is_acknowledged(server: dict[str, Any],
                                                          tmp_path: Path) -> None:
    doc = host("edge-fail", storage_path=tmp_path).gather()
    with DeviceState(tmp_path / "d.sqlite") as state:
        with Counting(server, token="wrong") as counting:
            reporter = CapabilityReporter(counting.http, state, generation="rc.3",
                                          device_id="edge-fail")
            refused = reporter.report(doc)
            assert (refused.kind, refused.status) == ("unauthorized", 401)
            assert reporter.acknowledged() is None
        with Counting(server, base=f"http://127.0.0.1:{free_port()}") as counting:
            reporter = CapabilityReporter(counting.http, state, generation="rc.3",
                                          device_id="edge-fail")
            down = reporter.report(doc)
            assert down.kind == "retry" and down.status is None
            assert reporter.acknowledged() is None
        with Counting(server) as counting:
            reporter = CapabilityReporter(counting.http, state, generation="rc.3",
                                          device_id="edge-fail")
            assert reporter.report(doc).kind == "delivered"
            assert reporter.acknowledged() is not None
            with pytest.raises(ValueError, match=r"properties\.id"):
                reporter.report(host("someone-else", storage_path=tmp_path).gather())


def test_a_gateway_reports_before_its_children(server: dict[str, Any], tmp_path: Path) -> None:
    with Counting(server) as counting, DeviceState(tmp_path / "d.sqlite") as state:
        def pair(device_id: str) -> tuple[CapabilityReporter, HostProvider]:
            return (CapabilityReporter(counting.http, state, generation="rc.3",
                                       device_id=device_id), host(device_id, storage_path=tmp_path))

        orphan = report_all([pair("gw-9/child")])
        assert [(o.kind, o.status) for o in orphan] == [("rejected", 404)]
        assert "gw-9" in orphan[0].detail
        outcomes = report_all([pair("gw-1"), pair("gw-1/child")])
        assert [(o.kind, o.status) for o in outcomes] == [("delivered", 201), ("delivered", 201)]
        assert [o.kind for o in report_all([pair("gw-1"), pair("gw-1/child")])] == [
            "unchanged", "unchanged"]  # one acknowledged digest per device


# --- an Oct-2024 device, end to end ----------------------------------------------------------


def oct_2024_device(server: dict[str, Any], home: Path, caps: dict[str, Any]) -> Path:
    """A Git-source device of the Oct-2024 API (which has no State Manifest) with `caps` as
    its capabilities file; its configuration."""
    home.mkdir()
    (home / "token").write_text(server["token"])
    (home / "caps.json").write_text(json.dumps(caps))
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": caps["properties"]["id"]},
        "server": {"url": server["base"], "clientId": "site-a", "tokenFile": "token",
                   "api": "oct-2024"},
        "source": {"type": "git"}, "driver": {"type": "render", "outputDir": "out"},
        "dataDir": "data", "capabilities": {"file": "caps.json"}}))
    return home / "device.yaml"


def test_an_oct_2024_file_reaches_an_oct_2024_server_as_written(
        server: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33: a file already in the Oct-2024 shape (roles, resources) was refused ("needs a
    role"), and the Git fetch that followed blamed the credentials."""
    from margo_cli.main import main
    written = json.loads((Path(__file__).parents[2] / "examples" / "capabilities" /
                          "legacy-box-oct2024.json").read_text())
    written["properties"]["id"] = "legacy-oct"
    rc3 = host("rc3-on-oct", storage_path=tmp_path).gather()
    for caps in (written, rc3):
        config = oct_2024_device(server, tmp_path / caps["properties"]["id"], caps)
        assert main(["device", "once", "--config", str(config), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["failures"] == []
    [stored] = history(server, "legacy-oct")
    assert {k: v for k, v in stored.items() if k != "x-margo-gitops-extensions"} == written
    [converted] = history(server, "rc3-on-oct")
    assert converted["properties"]["roles"] == ["Standalone Device"]  # from compose
    assert converted == shape_capabilities({**rc3, "x-margo-gitops-extensions": converted[
        "x-margo-gitops-extensions"]}, "oct-2024")

    # A document no Oct-2024 role fits is still refused, and the fetch's 401 that follows
    # (the server does not know the device) no longer says only "credentials".
    custom = host("custom-on-oct", storage_path=tmp_path, deployment_types=["custom"],
                  runtimes=["custom"]).gather()
    config = oct_2024_device(server, tmp_path / "custom-on-oct", custom)
    assert main(["device", "once", "--config", str(config), "--json"]) == 1
    reporting, fetching = json.loads(capsys.readouterr().out)["failures"]
    assert "needs a role" in reporting and "roles and resources" in reporting
    assert "does not know the device as this client's" in fetching
    assert "capability report" in fetching and history(server, "custom-on-oct") == []


# --- `margo device capabilities`: what the device will report ---------------------------------


def host_device(server: dict[str, Any], home: Path, device_id: str, driver: str) -> Path:
    """A REST device of `driver` with the `host` provider whose data directory does not
    exist yet (a fresh device); its configuration."""
    home.mkdir()
    (home / "token").write_text(server["token"])
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": device_id},
        "server": {"url": server["base"], "clientId": "site-a", "tokenFile": "token"},
        "source": {"type": "margo-rest"}, "driver": {"type": driver, "outputDir": "out"},
        "dataDir": "var/data",
        "capabilities": {"host": {"vendor": "Acme", "modelNumber": "X1",
                                  "serialNumber": "1"}}}))
    return home / "device.yaml"


def test_the_preview_works_on_a_fresh_device_and_is_what_the_device_reports(
        server: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33: the preview failed with ENOENT before the data directory existed, and said
    ["helm"] for a render device that reports ["helm", "compose"]."""
    from margo_cli.main import main
    config = host_device(server, tmp_path / "home", "fresh-box", "render")
    before = sorted(config.parent.rglob("*"))
    assert main(["device", "capabilities", "--config", str(config)]) == 0
    preview = json.loads(capsys.readouterr().out)
    assert sorted(config.parent.rglob("*")) == before  # created nothing
    assert preview["properties"]["supportedDeploymentTypes"] == ["helm", "compose"]
    assert preview["properties"]["storage"] == format_bytes(
        os.statvfs(config.parent).f_frsize * os.statvfs(config.parent).f_blocks)

    assert main(["device", "once", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == []
    [reported] = history(server, "fresh-box")
    assert reported["properties"] == preview["properties"]
    assert main(["device", "capabilities", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == reported  # now with the key the client made


@pytest.mark.parametrize(("driver", "types"), [
    ("render", ("helm", "compose")), ("compose", ("compose",)), ("helm", ("helm",))])
def test_each_driver_runs_the_profile_types_its_host_reports(
        server: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        driver: str, types: tuple[str, ...]) -> None:
    """One decision (`profile_types`) for the driver built and for the preview."""
    from contextlib import ExitStack

    from margo_cli.device_config import device_config
    from margo_cli.main import main
    from reconciler.assembly import open_driver, profile_types
    config = host_device(server, tmp_path / driver, f"types-{driver}", driver)
    loaded = device_config(str(config))
    with ExitStack() as stack:
        assert open_driver(loaded, stack).profile_types == profile_types(loaded) == types
    assert main(["device", "capabilities", "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)["properties"]["supportedDeploymentTypes"]
    assert tuple(shown) == types
