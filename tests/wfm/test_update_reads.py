"""What one device update costs the database in reads, end to end (issue 34): a device
whose poll is held learns of a change, fetches its document and reports `installing` then
`installed` (naming itself, as `margo device run` does), against the real `margo serve`, on
one SQLite server and on a replica of two on PostgreSQL. The reads are the server's own
count of the reads it made while answering requests (`margo_db_request_reads_total`);
background work (compiles, the replicas' syncs, lead times) reads outside it, and so do the
checks a process makes at most once a second on a request's way, whatever the number of
requests (`margo_db_periodic_reads_total`: the credentials epoch, whether a rollout moves).
The update starts more than a second after the device's previous requests, so those checks
fall inside it, as they do on a slow machine: they must not count against the bound.

The bounds are what the server reads today, each read named below; a change that adds a
read to every device update (each is a round trip to PostgreSQL at 10,000 devices) fails
here instead of only in `bench/fleet.py`'s figures."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from kits.metricskit import figure
from kits.serverkit import two_replicas, use_store

from tools.devices import intent
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
DEVICE = "reads-1"
_COMPONENT = re.compile(rb"^\s*- name: (\S+)", re.MULTILINE)


def reads(base: str, name: str = "margo_db_request_reads_total") -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _manifest(http: httpx.Client, etag: str | None = None,
              wait: int | None = None) -> httpx.Response:
    headers = {"Accept": MANIFEST}
    if etag is not None:
        headers["If-None-Match"] = etag
    if wait is not None:
        headers["Prefer"] = f"wait={wait}"
    return http.get("/api/v1/deployments", headers=headers)


def _install(http: httpx.Client, manifest: dict[str, Any],
             held: dict[str, str]) -> int:
    """What the device does with a new manifest: for each deployment it does not hold
    (`held`: id -> digest, updated), the document, then `installing` and `installed`.
    How many it installed."""
    new = [d for d in manifest["deployments"] if held.get(d["deploymentId"]) != d["digest"]]
    for deployment in new:
        document = http.get(deployment["url"])
        assert document.status_code == 200
        names = [n.decode() for n in _COMPONENT.findall(document.content)] or ["app"]
        for state in ("installing", "installed"):
            body = {"deploymentId": deployment["deploymentId"], "deviceId": DEVICE,
                    "adoptedManifestVersion": manifest["manifestVersion"],
                    "status": {"state": state},
                    "components": [{"name": n, "state": state} for n in names]}
            answer = http.post(f"/api/v1/deployments/{deployment['deploymentId']}/status",
                               content=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            assert answer.status_code in (200, 201), answer.text
        held[deployment["deploymentId"]] = deployment["digest"]
    return len(new)


def _one_update(base: str, http: httpx.Client, edit: Callable[[], None]) -> tuple[float, int]:
    """The device installed; its poll held; `edit` changes its state: the reads the server
    made from the poll's wake to the last status report, and how many deployments the
    device installed meanwhile."""
    first = poll_until("a first manifest", lambda: (
        answer := _manifest(http)).status_code == 200 and answer.json()["deployments"]
        and answer)
    held: dict[str, str] = {}
    _install(http, first.json(), held)
    time.sleep(1.2)  # the once-a-second checks are due again: they fall in the update
    before, periodic = reads(base), reads(base, "margo_db_periodic_reads_total")
    answered: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answered.append(
        _manifest(http, first.headers["etag"], wait=50)), daemon=True)
    waiting.start()
    poll_until("the poll held", lambda: _held(base) == 1)
    edit()
    waiting.join(timeout=60)
    assert answered and answered[0].status_code == 200, answered
    installed = _install(http, answered[0].json(), held)
    assert reads(base, "margo_db_periodic_reads_total") > periodic  # (made, and apart)
    return reads(base) - before, installed


def _held(base: str) -> float:
    return figure(base, "margo_waiting_polls_held", default=0.0)


def test_a_device_update_on_one_sqlite_server_reads_nothing(
        tmp_path: Path) -> None:
    """Every read a device update asks for is answered from what the server holds: the
    client's device list and manifest version, its state (one process compiles and serves
    it), the versions its reports name (`Attribution`)."""
    with use_store("sqlite"), fleet_server(
            tmp_path, fleet=write_fleet(tmp_path / "fleet", intents={})) as server:
        server.put_capabilities(capabilities("k8s-single-amd64", DEVICE))
        server.edit_intent(DEVICE, intent(DEVICE))
        with server.client(timeout=60) as http:
            count, installed = _one_update(server.base, http, lambda: server.edit_intent(
                DEVICE, intent(DEVICE, greeting="Read less")))
    assert installed == 1
    assert count == 0, f"{count:g} reads for one device update"


def test_a_device_update_on_a_replica_reads_a_bounded_number_of_times(
        tmp_path: Path) -> None:
    """On a replica, another replica may have registered or forgotten the client's devices
    since: the client's device list is read once for the new generation, a round trip; the
    status reports that name the device are checked against that list (they read it
    again only for a device it lacks: `StatusIntake._is_clients_device`; each of them was
    a read until then). With thousands of devices updating at once, the reads are made
    together (`wfm.store.coalesced`)."""
    with two_replicas(tmp_path, ["edge"], ["--watch-source"]) as replicas:
        base = replicas["bases"][0]
        deployments = replicas["source"] / "deployments"
        FleetServer._write(deployments / f"{DEVICE}.yaml", intent(DEVICE))
        with httpx.Client(base_url=base, timeout=60, headers={
                "Authorization": f"Bearer {replicas['tokens']['edge']}"}) as http:
            doc = capabilities("k8s-single-amd64", DEVICE)
            assert http.put(f"/api/v1/capabilities/{DEVICE}", json=doc).status_code == 201
            count, installed = _one_update(base, http, lambda: FleetServer._write(
                deployments / f"{DEVICE}.yaml", intent(DEVICE, greeting="Read less")))
    assert installed == 1
    assert count <= 1, f"{count:g} reads for one device update"
