"""`wfm.fleet.leadtime` on one server: a compile's lead-time marks are written after its
state is published, by the thread that checks reports, and always before it checks a report
that came after the compile; on replicas they are written before publication, as before.
A real compile (`kits.fleetkit`), the real Git store and SQLite store."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import CompileReport
from compiler.render import deployment_id
from margo.digests import digest_of
from wfm.fleet import leadtime
from wfm.fleet.desired import DesiredState
from wfm.fleet.leadtime import CompileOrigin, LeadTimes
from wfm.store import lead_rows
from wfm.store.records import Applied
from wfm.store.sqlitedb import SqliteDatabase
from wfm.telemetry.metrics import LEAD_TIME
from wfm.telemetry.tracing import Tracing


@pytest.fixture
def compiled(tmp_path: Path) -> tuple[Fleet, CompileReport]:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web")
    for index in range(3):
        fleet.devices[f"edge-{index}"] = device(f"edge-{index}")
    report = fleet.compile()
    assert report.commits == 3
    return fleet, report


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteDatabase]:
    store = SqliteDatabase(tmp_path / "wfm.sqlite")
    yield store
    store.close()


def observed(trigger: str = "other") -> float:
    return sum(sample.value for metric in LEAD_TIME.collect() for sample in metric.samples
               if sample.name.endswith("_count") and sample.labels.get("trigger") == trigger)


def installed(lead: LeadTimes, fleet: Fleet, device_id: str) -> None:
    """The device's `installed` report of its deployment's current bytes."""
    data = fleet.tree(device_id)["web.yaml"]
    deployment = deployment_id("web", device_id)
    lead.reported(device_id, device_id, deployment, "installed", {}, Applied(
        digest_of(data), "test"), changed=True)


def test_one_server_publishes_first_and_still_times_every_report(
        compiled: tuple[Fleet, CompileReport], db: SqliteDatabase,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, report = compiled
    monkeypatch.setattr(leadtime, "MARKS_PER_WRITE", 2)  # three marks: two transactions
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None),
                     marks_after_publication=True)
    try:
        before = observed()
        origin = CompileOrigin(time.time(), [], 0, time.time())
        assert lead.compiled(origin, report) is None  # queued, not written yet
        # Reports of the published state, at once: each is checked after the marks exist.
        for index in range(3):
            installed(lead, fleet, f"edge-{index}")
        deadline = time.monotonic() + 10
        while observed() < before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert observed() == before + 3
        assert db.read(lambda conn: lead_rows.marks_of(
            conn, [deployment_id("web", f"edge-{i}") for i in range(3)])) == {}  # consumed
    finally:
        lead.stop()


def test_replicas_write_the_marks_before_publishing(
        compiled: tuple[Fleet, CompileReport], db: SqliteDatabase) -> None:
    fleet, report = compiled
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None))
    try:
        assert lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report) == 3
        marks = db.read(lambda conn: lead_rows.marks_of(
            conn, [deployment_id("web", f"edge-{i}") for i in range(3)]))
        assert len(marks) == 3  # in the database when `compiled` returns
    finally:
        lead.stop()


def test_marks_queued_at_stop_are_written(compiled: tuple[Fleet, CompileReport],
                                          db: SqliteDatabase) -> None:
    """A server stopping right after a compile leaves its marks for its next start."""
    fleet, report = compiled
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None),
                     marks_after_publication=True)
    lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report)
    lead.stop()
    marks = db.read(lambda conn: lead_rows.marks_of(
        conn, [deployment_id("web", f"edge-{i}") for i in range(3)]))
    assert len(marks) == 3
