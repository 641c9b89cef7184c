"""Status history keeps the device's own time of each report next to the server's receive
time (`wfm.store.records.device_time`, migration 7): read from the report's
`x-margo-gitops-extensions.observedAt`, stored as NULL when missing or unreadable (never an
error), on SQLite and on a real PostgreSQL server, and shown by the read API
(`GET /api/fleet/devices/{id}`, each deployment's `statusHistory`)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.fleetkit import Fleet, app, device, intent
from kits.schemakit import database_at
from kits.serverkit import add_client, running_server

from tools.polling import poll_until
from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import Database
from wfm.store.opening import open_database
from wfm.store.schema import MIGRATIONS, schema_version

WHEN = "2025-03-01T12:00:00+01:00"
WHEN_EPOCH = dt.datetime(2025, 3, 1, 11, 0, tzinfo=dt.UTC).timestamp()


def stamped(observed: Any) -> dict[str, Any]:
    return {"x-margo-gitops-extensions": {"observedAt": observed}}


@pytest.mark.parametrize("document, expected", [
    (stamped(WHEN), WHEN_EPOCH),
    (stamped("2025-03-01T11:00:00Z"), WHEN_EPOCH),
    (stamped("2025-03-01T11:00:00.250Z"), WHEN_EPOCH + 0.25),
    ({}, None),  # the device sent no time
    (stamped("yesterday, around noon"), None),
    (stamped("2025-03-01T11:00:00"), None),  # no offset: whose noon?
    (stamped("2025-02-30T11:00:00Z"), None),  # no such day
    (stamped(1740826800), None),  # a number is not RFC 3339
    (stamped(None), None),
    (stamped("2" * 10_000), None),
    ({"x-margo-gitops-extensions": "observedAt"}, None),
    ({"x-margo-gitops-extensions": {"other": WHEN}}, None),
])
def test_the_device_time_of_a_report_is_read_or_none(document: dict[str, Any],
                                                     expected: float | None) -> None:
    assert records.device_time(document) == expected


def report(state: str, **extra: Any) -> dict[str, Any]:
    return {"deploymentId": "d-1", "adoptedManifestVersion": 1, "status": {"state": state},
            "components": [{"name": "web", "state": state}], **extra}


def test_the_history_stores_both_times_and_a_garbage_device_time_as_null(
        store: Database) -> None:
    client_id, _ = ClientRegistry(store).add("plant-a")
    documents = [report("installing", **stamped(WHEN)),
                 report("installed", **stamped("not a time")),
                 report("failed")]
    before = time.time()
    for index, document in enumerate(documents):
        written = store.write_sync(lambda c, d=document, i=index: records.store_status(
            c, client_id=client_id, deployment_id="d-1", device_id="edge-1",
            state=d["status"]["state"], document=d, digest=f"sha256:{i}", adopted=1))
        assert written.changed
    rows = store.read(lambda c: [tuple(r) for r in c.execute(
        "SELECT state, device_time FROM status_reports WHERE deployment_id = ? ORDER BY id",
        ("d-1",))])
    assert rows == [("installing", WHEN_EPOCH), ("installed", None), ("failed", None)]
    history = store.read(lambda c: records.status_history(c, ["d-1", "d-none"], limit=2))
    assert [h["state"] for h in history["d-1"]] == ["failed", "installed"]  # newest first
    assert [h["deviceTime"] for h in history["d-1"]] == [None, None]
    assert all(before <= h["reportedAt"] <= time.time() for h in history["d-1"])
    assert history["d-none"] == []
    oldest = store.read(lambda c: records.status_history(c, ["d-1"]))["d-1"][-1]
    assert (oldest["state"], oldest["deviceTime"]) == ("installing", WHEN_EPOCH)


def _at_version_6(dialect: str, target: str) -> None:
    """A database as a server before migration 7 left it, with one status report."""
    conn, mark = database_at(dialect, target, 6)
    conn.execute("INSERT INTO status_reports (deployment_id, client_id, device_id, state, "
                 f"document, reported_at) VALUES ({', '.join([mark] * 6)})",
                 ("d-old", "plant-a", "edge-1", "installed", "{}", 1.0))
    conn.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_migration_7_adds_the_device_time_and_keeps_the_history(
        dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    target = str(tmp_path / "wfm.sqlite") if dialect == "sqlite" else \
        request.getfixturevalue("pg_url")
    _at_version_6(dialect, target)
    db = open_database(Path(target) if dialect == "sqlite" else target)
    try:
        assert db.read(schema_version) == MIGRATIONS[-1].version >= 7
        assert db.read(lambda c: records.status_history(c, ["d-old"]))["d-old"] == [
            {"state": "installed", "reportedAt": 1.0, "deviceTime": None}]
        db.write_sync(lambda c: records.store_status(
            c, client_id="plant-a", deployment_id="d-old", device_id="edge-1",
            state="failed", document=report("failed", **stamped(WHEN)), digest="sha256:n",
            adopted=1))
        newest = db.read(lambda c: records.status_history(c, ["d-old"]))["d-old"][0]
        assert (newest["state"], newest["deviceTime"]) == ("failed", WHEN_EPOCH)
    finally:
        db.close()


def test_the_read_api_shows_each_report_with_both_times(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", profile={"type": "compose"})
    fleet.devices["box"] = device("box", types=("compose",))
    fleet.write()
    data = tmp_path / "data"
    token = add_client(data, "plant")
    with running_server(data, "--source", str(fleet.source)) as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.put("/api/v1/capabilities/box", json=fleet.devices["box"]).status_code \
            == 201
        manifest = poll_until("the deployment served", lambda: (
            m := http.get("/api/v1/deployments").json())["deployments"] and m,
            timeout=30, interval=0.2)
        deployment_id = manifest["deployments"][0]["deploymentId"]

        def send(state: str, **extra: Any) -> None:
            body = {**report(state, **extra), "deploymentId": deployment_id,
                    "adoptedManifestVersion": manifest["manifestVersion"],
                    "components": [{"name": "web-compose", "state": state}]}
            response = http.post(f"/api/v1/deployments/{deployment_id}/status", json=body)
            assert response.status_code == 200, response.text  # garbage time: no error

        send("installing", **stamped(WHEN))
        send("installed", **stamped("soon-ish"))
        send("installed")  # says what the last one said (a re-assertion): no history
        send("failed")
        send("failed")  # the same report again: no history
        view = httpx.get(f"{base}/api/fleet/devices/box", timeout=10).json()
    [shown] = view["deployments"]
    history = shown["statusHistory"]
    assert [(h["state"], h["deviceTime"]) for h in history] == [
        ("failed", None), ("installed", None), ("installing", WHEN_EPOCH)]
    received = [h["reportedAt"] for h in history]
    assert received == sorted(received, reverse=True) and all(
        isinstance(t, float) for t in received)
