"""The status history is bounded (issue 15: 120 large reports grew the database by 109 MB):
each deployment keeps its newest `records.STATUS_HISTORY` changed reports, trimmed by one
indexed DELETE every few reports rather than one per report, and a history row stores at
most `records.STATUS_HISTORY_BYTES` of a report. On SQLite and on a real PostgreSQL
server; a database that grew before migration 8 is trimmed by the next report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kits.schemakit import database_at

from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import Database
from wfm.store.opening import open_database
from wfm.store.schema import MIGRATIONS, schema_version

BOUND = records.STATUS_HISTORY + records._STATUS_TRIM_EVERY


class Recording:
    """A connection that remembers the statements run through it."""

    def __init__(self, conn: Any, seen: list[str]) -> None:
        self._conn, self._seen = conn, seen

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        self._seen.append(sql)
        return self._conn.execute(sql, parameters)


def report(index: int, message: str = "") -> dict[str, Any]:
    state = ("installing", "installed", "failed")[index % 3]
    component: dict[str, Any] = {"name": "web", "state": state}
    if message:
        component["error"] = {"code": "E", "message": message}
    return {"deploymentId": "d-1", "adoptedManifestVersion": 1, "status": {"state": state},
            "components": [component], "x-margo-gitops-extensions": {"index": index}}


def send(store: Database, client_id: str, index: int, seen: list[str] | None = None,
         deployment_id: str = "d-1", message: str = "") -> None:
    document = report(index, message)
    written = store.write_sync(lambda c: records.store_status(
        c if seen is None else Recording(c, seen), client_id=client_id,
        deployment_id=deployment_id, device_id="edge-1", state=document["status"]["state"],
        document=document, digest=f"sha256:{deployment_id}:{index}", adopted=1))
    assert written.changed


def rows(store: Database, deployment_id: str = "d-1") -> list[tuple[int, str]]:
    return store.read(lambda c: [(int(r[0]), r[1]) for r in c.execute(
        "SELECT id, document FROM status_reports WHERE deployment_id = ? ORDER BY id",
        (deployment_id,))])


def test_500_changed_reports_keep_a_bounded_history_of_the_newest(store: Database) -> None:
    client_id, _ = ClientRegistry(store).add("plant-a")
    sizes = []
    for index in range(500):
        send(store, client_id, index)
        if index < 30:
            send(store, client_id, index, deployment_id="d-2")
        sizes.append(len(rows(store)))
    assert max(sizes) <= BOUND
    assert records.STATUS_HISTORY <= sizes[-1] <= BOUND
    kept = [json.loads(d)["x-margo-gitops-extensions"]["index"]
            for _, d in rows(store)]
    assert kept == list(range(500 - len(kept), 500))  # the newest, in order, none missing
    assert len(rows(store, "d-2")) == 30  # another deployment's history is its own
    history = store.read(lambda c: records.status_history(c, ["d-1"], limit=1000))["d-1"]
    assert len(history) == len(kept) and history[0]["state"] == report(499)["status"]["state"]


def test_trimming_is_not_a_delete_per_report(store: Database) -> None:
    client_id, _ = ClientRegistry(store).add("plant-a")
    seen: list[str] = []
    for index in range(300):
        send(store, client_id, index, seen)
    deletes = [s for s in seen if s.lstrip().upper().startswith("DELETE")]
    assert 0 < len(deletes) <= 300 // records._STATUS_TRIM_EVERY
    assert len(seen) <= 3 * 300 + 3 * len(deletes)  # read, upsert, insert; a trim's three


def test_a_large_report_is_summarized_in_the_history_but_kept_whole_as_the_status(
        store: Database) -> None:
    client_id, _ = ClientRegistry(store).add("plant-a")
    message = "x" * 900_000  # just under the API's 1 MiB body limit
    for index in range(3):
        send(store, client_id, index, message=message)
    stored = rows(store)
    assert len(stored) == 3
    assert all(len(d.encode()) <= records.STATUS_HISTORY_BYTES for _, d in stored)
    summary = json.loads(stored[-1][1])
    assert summary["status"] == {"state": "failed"}
    assert summary["components"] == [{"name": "web", "state": "failed"}]
    assert summary["x-margo-gitops-history"]["bytes"] > 900_000
    current = store.read(lambda c: c.execute(
        "SELECT document FROM statuses WHERE deployment_id = ?", ("d-1",)).fetchone()[0])
    assert message in current
    send(store, client_id, 3)  # a small one is kept as it is
    assert json.loads(rows(store)[-1][1]) == report(3)


def _at_version_7(dialect: str, target: str, reports: int) -> None:
    """A database as a server before migration 8 left it, whose history grew unbounded."""
    conn, mark = database_at(dialect, target, 7)
    conn.execute("INSERT INTO clients (client_id, created_at) VALUES "
                 f"({mark}, {mark})", ("plant-a", 1.0))
    conn.execute("INSERT INTO statuses (deployment_id, client_id, device_id, state, "
                 f"document, digest, reported_at) VALUES ({', '.join([mark] * 7)})",
                 ("d-1", "plant-a", "edge-1", "installed", "{}", "sha256:old", 1.0))
    for index in range(reports):
        conn.execute("INSERT INTO status_reports (deployment_id, client_id, device_id, "
                     f"state, document, reported_at) VALUES ({', '.join([mark] * 6)})",
                     ("d-1", "plant-a", "edge-1", "installed", "{}", float(index)))
    conn.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_migration_8_counts_an_overgrown_history_and_the_next_report_trims_it(
        dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    target = str(tmp_path / "wfm.sqlite") if dialect == "sqlite" else \
        request.getfixturevalue("pg_url")
    _at_version_7(dialect, target, 400)
    db = open_database(Path(target) if dialect == "sqlite" else target)
    try:
        assert db.read(schema_version) == MIGRATIONS[-1].version >= 8
        assert db.read(lambda c: c.execute("SELECT history_count FROM statuses").fetchone()[0]
                       ) == 400
        send(db, "plant-a", 1)
        assert len(rows(db)) == records.STATUS_HISTORY
        assert db.read(lambda c: c.execute("SELECT history_count FROM statuses").fetchone()[0]
                       ) == records.STATUS_HISTORY
    finally:
        db.close()


def capabilities(device_id: str, index: int) -> dict[str, Any]:
    return {"properties": {"id": device_id, "vendor": "Example", "serialNumber": str(index)}}


def test_a_device_that_keeps_changing_its_capabilities_keeps_a_bounded_history(
        store: Database) -> None:
    """Each changed document is history; only the newest `CAPABILITY_HISTORY` of a device
    stay, the other devices' are untouched, and an unchanged report adds nothing."""
    ClientRegistry(store).add("acme")
    keep = records.CAPABILITY_HISTORY

    def put(device_id: str, index: int) -> records.CapabilityWrite:
        document = capabilities(device_id, index)
        return store.write_sync(lambda c: records.store_capabilities(
            c, client_id="acme", device_id=device_id, document=document,
            digest=f"sha256:{device_id}:{index}", shape="rc3"))

    for index in range(3):
        put("quiet", index)
    for index in range(keep * 3):
        assert put("noisy", index).changed
    assert not put("noisy", keep * 3 - 1).changed

    def history(device_id: str) -> list[str]:
        return store.read(lambda c: [json.loads(r[0])["properties"]["serialNumber"]
                                     for r in c.execute(
            "SELECT document FROM capability_reports WHERE device_id = ? ORDER BY id",
            (device_id,))])

    assert history("noisy") == [str(i) for i in range(keep * 2, keep * 3)]
    assert history("quiet") == ["0", "1", "2"]
