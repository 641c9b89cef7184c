"""Reports that settle every change (issue 28, item 2), with the real `margo device once`
(render driver) against a real `margo serve`, on the REST source (rc.3) and the Git source
(Oct-2024):

- new bytes the device has nothing to do for (a changed capacity requirement) are still
  reported, so the server sees the device current on them (a rollout's canary used to go
  stale and roll the revision back);
- the device re-asserts its true state every `schedule.resync`, so a forged or lost report
  does not stand.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.chartkit import publish_example_charts
from kits.devicekit import (
    HELLO,
    Device,
    head,
    intent,
    new_device,
    once,
    steps,
    wait_for_new_commit,
)
from kits.fleetserver import FleetServer, fleet_server, write_fleet

SOURCES = ["margo-rest", "git"]


@pytest.fixture(scope="module")
def server(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    workdir = tmp_path_factory.mktemp("device-reports")
    publish_example_charts(registry)
    fleet = write_fleet(workdir / "fleet", registry=registry, intents={})
    with fleet_server(workdir, fleet=fleet) as running:
        yield running


def freshness(server: FleetServer, device: Device) -> str:
    return str(server.device(device.device_id)["freshness"]["state"])


def deployment_of(server: FleetServer, device: Device) -> dict[str, object]:
    [deployment] = server.device(device.device_id)["deployments"]
    return deployment


def history(server: FleetServer, deployment_id: object) -> list[str]:
    with sqlite3.connect(server.data_dir / "wfm.sqlite") as conn:
        rows = conn.execute("SELECT state FROM status_reports WHERE deployment_id = ? "
                            "ORDER BY id", (deployment_id,)).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("source", SOURCES)
def test_new_bytes_with_nothing_to_apply_are_reported(server: FleetServer,
                                                      source: str) -> None:
    device = new_device(server, f"capacity-{source}", source=source)
    if source == "git":
        # The Git device speaks Oct-2024 once it reports, and Oct-2024 documents hold no
        # capacity requirement (a change of it moves none of their bytes): its intent asks
        # for rc.3 documents, which our client reads whatever API it speaks. The kit
        # reported its capabilities through Oct-2024's route, so its branch held Oct-2024
        # documents: wait for the rc.3 ones, or the device installs the old bytes and the
        # server then rightly sees it pending on the new.
        before = head(server, device)
        server.edit_intent(device.device_id, intent(device.device_id).replace(
            "spec:\n", "spec:\n  outputShape: rc.3\n", 1))
        wait_for_new_commit(server, device, before)
    assert steps(once(device)) == [("install", "ok")]
    assert freshness(server, device) == "current"

    # Only the profile's capacity requirement changes: the document's bytes move, nothing
    # the device runs does.
    description = server.source_dir / "apps" / HELLO / "margo.yaml"  # type: ignore[operator]
    original = description.read_text()
    commit = head(server, device)
    try:
        description.write_text(original.replace("cores: 0.5", "cores: 0.25", 1))
        wait_for_new_commit(server, device, commit)
        assert freshness(server, device) == "pending"
        cycle = once(device)
        assert cycle["steps"] == [] and cycle["converged"]
        assert freshness(server, device) == "current"
        assert deployment_of(server, device)["applied"]["current"]  # type: ignore[index]
    finally:
        description.write_text(original)
    wait_for_new_commit(server, device, head(server, device))
    assert once(device)["steps"] == []
    assert freshness(server, device) == "current"


@pytest.mark.parametrize("source", SOURCES)
def test_a_forged_status_does_not_outlive_the_next_resync(server: FleetServer,
                                                          source: str) -> None:
    device = new_device(server, f"forged-{source}", source=source, resync="1s")
    assert steps(once(device)) == [("install", "ok")]
    deployment = deployment_of(server, device)
    deployment_id = deployment["deploymentId"]
    before = history(server, deployment_id)

    # Somebody with the client's credentials says the deployment failed.
    forged = {"deploymentId": deployment_id, "adoptedManifestVersion": 1_000_000,
              "status": {"state": "failed", "error": {"code": "X", "message": "forged"}},
              "components": [{"name": "hello-world", "state": "failed"}]}
    with server.client() as http:
        response = http.post(f"/api/v1/deployments/{deployment_id}/status",
                             content=json.dumps(forged))
    assert response.status_code == 200, response.text
    assert deployment_of(server, device)["state"] == "failed"

    # The device re-asserts its true state once `resync` (1 s) has passed since the last
    # re-assertion; `once` is a process per cycle, so the time is kept in its state.
    _age_the_last_resync(device)
    assert once(device)["steps"] == []
    assert deployment_of(server, device)["state"] == "installed"
    assert freshness(server, device) == "current"
    assert history(server, deployment_id) == [*before, "failed", "installed"]

    # With nothing forged, a re-assertion says nothing new: no history is added.
    _age_the_last_resync(device)
    once(device)
    assert history(server, deployment_id) == [*before, "failed", "installed"]


def _age_the_last_resync(device: Device) -> None:
    """Move the device's last re-assertion into the past (as a second passing would)."""
    with sqlite3.connect(device.state_file) as conn:
        conn.execute("INSERT INTO kv (key, value) VALUES ('reports.reasserted-at', '0') "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value")


def test_a_device_state_of_an_older_client_is_migrated(tmp_path: Path) -> None:
    """A version-1 state file (before the `reported` table) opens, gains the table and
    keeps what it held."""
    from reconciler.state import SCHEMA_VERSION, DeviceState
    path = tmp_path / "device-state.sqlite"
    with DeviceState(path) as state:
        state.set("k", "v")
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE reported")
        conn.execute("PRAGMA user_version = 1")
    with DeviceState(path) as state:
        assert state.get("k") == "v"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        assert conn.execute("SELECT count(*) FROM reported").fetchone()[0] == 0
