"""Waiting polls end to end (issue 34): the real `margo device run` (render driver, a real OCI
registry) against the real `margo serve`, a REST-source and a Git-source device side by side.

Each device polls every `INTERVAL` seconds and asks the server to hold its conditional poll
(`schedule.wait`). After its first install, its next scheduled cycle is an interval away;
a push must reach it long before: it is installed within `PROMPTLY` seconds, a bound far
above what waiting takes (a compile and a second or two) and far below the interval. On one
server (SQLite) and on two replicas on PostgreSQL behind the round-robin balancer of the
replica tests (the held poll, the documents and the reports each reach either replica).

A held poll cut by the network (tools/netproxy.py) or by a server restart is followed by
polls with jitter until the server holds them again, and the device converges. Timing is
asserted only with generous bounds; the figures are bench/fleet.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kits.chartkit import publish_example_charts
from kits.devicekit import Device, intent, new_device
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.metricskit import held_polls, renewals
from kits.netkit import cuttable_proxy
from kits.serverkit import add_client, use_store

from tools.devices import current, new_digest, running_device
from tools.fleetserver import FleetServer as Server
from tools.polling import poll_until
from tools.replicas import Replica

#: The devices' polling interval: what a push would wait for without waiting polls.
INTERVAL = "40s"
#: A bound on push -> installed with waiting polls (seconds), far below the interval.
PROMPTLY = 20.0
SOURCES = ("margo-rest", "git")


@contextlib.contextmanager
def _server(registry: str, workdir: Path, store: str) -> Iterator[FleetServer]:
    publish_example_charts(registry)
    fleet = write_fleet(workdir / "fleet", registry=registry, intents={})
    with use_store(store), fleet_server(workdir, fleet=fleet) as server:
        yield server


@pytest.fixture(scope="module")
def sqlite(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    with _server(registry, tmp_path_factory.mktemp("waiting-sqlite"), "sqlite") as server:
        yield server


@pytest.fixture(scope="module")
def replicas(registry: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    with _server(registry, tmp_path_factory.mktemp("waiting-replicas"), "replicas") as server:
        yield server


def waiting_devices(server: FleetServer, name: str, *, url: str | None = None
                    ) -> list[Device]:
    """A REST-source and a Git-source device of `name`, waiting for changes."""
    return [new_device(server, f"{name}-{source}", source=source, url=url,
                       interval=INTERVAL, wait=INTERVAL) for source in SOURCES]


@contextlib.contextmanager
def running(devices: list[Device]) -> Iterator[list[Path]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_device(device)) for device in devices]


def installed(server: Server, devices: list[Device], timeout: float = 60.0) -> list[str]:
    """The digests each device has installed, once it has."""
    return [poll_until(f"{d.device_id} installed", lambda d=d: current(server, d.device_id),
                       timeout=timeout) for d in devices]


def push_and_wait(server: Server, devices: list[Device], before: list[str],
                  greeting: str, timeout: float = PROMPTLY) -> None:
    """Change every device's intent, then wait (at most `timeout`) until each has installed
    the new state."""
    for device in devices:
        server.edit_intent(device.device_id, intent(device.device_id, greeting=greeting))
    for device, old in zip(devices, before, strict=True):
        digest = poll_until("the new state", lambda d=device, o=old: new_digest(
            server, d.device_id, o), timeout=timeout)
        poll_until(f"{device.device_id} installing the push", lambda d=device, g=digest:
                   current(server, d.device_id, g), timeout=timeout)


@pytest.mark.parametrize("store", ["sqlite", "replicas"])
def test_a_waiting_device_installs_a_push_long_before_its_interval(
        store: str, request: pytest.FixtureRequest) -> None:
    server: FleetServer = request.getfixturevalue(store)
    devices = waiting_devices(server, f"prompt-{store}")
    with running(devices) as logs:
        before = installed(server, devices)
        push_and_wait(server, devices, before, "Bonjour")
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and "stopped holding" not in text, text


def test_a_wait_cut_by_the_network_falls_back_to_polling_and_converges(
        sqlite: FleetServer) -> None:
    """The proxy closes the held polls and refuses connections for a while: the devices
    poll with jitter until the server holds their polls again; a push then arrives."""
    port = int(sqlite.base.rsplit(":", 1)[1])
    with cuttable_proxy(port) as proxy:
        devices = waiting_devices(sqlite, "cut", url=proxy.url)
        with running(devices) as logs:
            before = installed(sqlite, devices)
            poll_until("both polls held", lambda: held_polls(sqlite.base) >= 2)
            proxy.cut()
            poll_until("the devices noticing", lambda: all(
                "the server stopped holding polls" in log.read_text() for log in logs))
            proxy.restore()
            push_and_wait(sqlite, devices, before, "Hallo", timeout=PROMPTLY + 30)


def test_a_wait_cut_by_a_server_restart_falls_back_to_polling_and_converges(
        registry: str, tmp_path: Path) -> None:
    """SIGTERM answers the held polls at once (304, never a 5xx); the devices poll with
    jitter (refused while the server is down) and wait again once it is back."""
    publish_example_charts(registry)
    fleet = write_fleet(tmp_path / "fleet", registry=registry, intents={})
    with use_store("sqlite"):
        token = add_client(tmp_path / "data", "edge")
    replica = Replica(tmp_path / "data", ("--source", str(fleet), "--watch-source"))
    replica.start()
    try:
        with _http(replica.base, token) as http:
            server = Server(base=replica.base, client_id="edge", token=token,
                            source_dir=fleet, data_dir=tmp_path / "data", _http=http)
            devices = waiting_devices(server, "restart")
            with running(devices) as logs:
                before = installed(server, devices)
                poll_until("both polls held", lambda: held_polls(replica.base) == 2)
                replica.stop()
                poll_until("the devices noticing", lambda: all(
                    "the server stopped holding polls" in log.read_text() for log in logs))
                replica.start()
                push_and_wait(server, devices, before, "Hej", timeout=PROMPTLY + 30)
            for log in logs:
                assert "HTTP 5" not in log.read_text()
    finally:
        replica.stop()


@contextlib.contextmanager
def _http(base: str, token: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        yield http


@pytest.mark.parametrize("source", SOURCES)
def test_a_waiting_devices_renewals_skip_the_request_stack(sqlite: FleetServer,
                                                            source: str) -> None:
    """The real client's poll after a 304 (its manifest, or its ref advertisement) is the
    same request again, byte for byte, on the same connection: the server holds it again
    as a renewal (`wfm.admission.parking`), which is what a waiting fleet costs while
    nothing changes; its requests arrive whole, so their bytes are matched, unparsed
    (`wfm.server.wire`)."""
    device = new_device(sqlite, f"renewing-{source}", source=source, interval=INTERVAL,
                        wait="1s")
    before = renewals(sqlite.base, "bytes")
    with running([device]) as logs:
        installed(sqlite, [device])
        poll_until("three renewals", lambda: renewals(
            sqlite.base, "bytes") >= before + 3, timeout=30)
    text = logs[0].read_text()
    assert "Traceback" not in text and "stopped holding" not in text, text
