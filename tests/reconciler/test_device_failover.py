"""A device with several server URLs keeps converging when the one it uses dies (issue 29,
item 5): two real `margo serve` replicas on one PostgreSQL database, each reached directly,
a real OCI registry and the real `margo device run` (render driver). The device's first URL
leads to replica A, which is killed (SIGKILL) or whose link is cut (a proxy); a new intent
must still reach the device through replica B and its status reach the server, for the REST
source and the Git source. A device with one URL behaves as before: it waits for that URL.
A replica alive but without its database answers 503 with Retry-After: the device asks the
other one.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from kits.chartkit import publish_example_charts
from kits.devicekit import Device, intent, new_device, once, steps
from kits.failoverkit import (
    ReplicaPair,
    current,
    new_digest,
    replica_pair,
    running_device,
    set_fallbacks,
)
from kits.fleetserver import FleetServer
from kits.netkit import cuttable_proxy

from tools.polling import poll_until

SOURCES = ["margo-rest", "git"]


@pytest.fixture(scope="module")
def pair(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaPair]:
    publish_example_charts(registry)
    with replica_pair(tmp_path_factory.mktemp("device-failover"), registry=registry) as running:
        yield running


@pytest.fixture(autouse=True)
def _first_replica_up(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with replica A running (an earlier test may have killed it)."""
    yield
    if "pair" in request.fixturenames:
        first = request.getfixturevalue("pair").replicas[0]
        if first.process is None or first.process.poll() is not None:
            first.start()


def rendered(device: Device) -> str:
    [config] = device.output.glob("*/*/*/templates/configmap.yaml")
    return config.read_text()


def change_greeting(server: FleetServer, device: Device, old: str) -> str:
    """A new greeting in the device's intent; the digest of the new state once served."""
    server.edit_intent(device.device_id, intent(device.device_id, greeting="Bonjour"))
    return poll_until("the new state", lambda: new_digest(server, device.device_id, old),
                      timeout=60)


@pytest.mark.parametrize("fault", ["killed", "cut"])
@pytest.mark.parametrize("source", SOURCES)
def test_the_device_keeps_converging_through_its_second_url(pair: ReplicaPair, source: str,
                                                            fault: str) -> None:
    first, second = pair.replicas
    server = pair.servers[1]
    name = f"{source}-{fault}"
    with cuttable_proxy(first.port) as proxy:
        way_in = proxy.url if fault == "cut" else first.base
        device = new_device(server, name, source=source, url=way_in)
        set_fallbacks(device, [second.base])
        with running_device(device) as log:
            old = poll_until("the first install", lambda: current(server, name), timeout=60)
            if fault == "killed":
                first.kill()
            else:
                proxy.cut()
            new = change_greeting(server, device, old)
            poll_until("the new state installed and reported through replica B",
                       lambda: current(server, name, new), timeout=90,
                       describe=lambda: f"the server's view: {server.device(name)}\n"
                                        f"the device's log ends:\n{log.read_text()[-3000:]}")
    assert 'GREETING: "Bonjour"' in rendered(device)
    text = log.read_text()
    assert "failed (" in text and f"using {second.base} from now on" in text, text


@pytest.mark.parametrize("source", SOURCES)
def test_a_device_with_one_url_waits_for_it_as_before(pair: ReplicaPair, source: str) -> None:
    first = pair.replicas[0]
    server = pair.servers[1]
    name = f"single-{source}"
    device = new_device(server, name, source=source, url=first.base)
    assert steps(once(device)) == [("install", "ok")]
    old = poll_until("the first report", lambda: current(server, name), timeout=30)
    first.kill()
    new = change_greeting(server, device, old)
    waiting = once(device, expect=1)
    assert (waiting["fetched"], waiting["steps"]) == ("error", [])
    [failure] = [f for f in waiting["failures"] if f.startswith("fetching desired state")]
    assert first.base.removeprefix("http://") in failure or "Connect" in failure, failure
    assert current(server, name) is None or current(server, name) == old
    first.start()
    assert steps(once(device)) == [("reconfigure", "ok")]
    assert current(server, name, new) == new


def test_a_replica_without_its_database_sends_the_device_to_the_other(
        pair: ReplicaPair) -> None:
    """Replica A is alive but loses PostgreSQL (its link cut): it answers 503 with
    Retry-After, as a WFM that cannot serve now does; the device asks replica B, which has
    the database, converges through it and stays there."""
    first, second = pair.replicas
    server = pair.servers[1]
    device = new_device(server, "rest-no-database", url=first.base)
    set_fallbacks(device, [second.base])
    assert steps(once(device)) == [("install", "ok")]
    old = poll_until("the first report", lambda: current(server, device.device_id), timeout=30)
    pair.database_link.cut()
    try:
        refused = httpx.get(f"{first.base}/api/v1/deployments", timeout=30,
                            headers={"Authorization": f"Bearer {pair.token}"})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        new = change_greeting(server, device, old)
        report = once(device)
        assert steps(report) == [("reconfigure", "ok")], report
        assert f"using {second.base} from now on" in report["stderr"], report["stderr"]
        assert current(server, device.device_id, new) == new
    finally:
        pair.database_link.restore()
