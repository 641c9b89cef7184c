"""`wfm.fleet.leadtime`: a compile's lead-time marks are written after its state is
published, by the thread that checks reports. On one server always before it checks a
report that came after the compile; on replicas a report that came first (through another
replica) is looked at again until its mark is there. A real compile (`kits.fleetkit`), the
real Git store and SQLite store."""

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
from wfm.telemetry.metrics import LEAD_TIME, LEAD_TIME_DROPPED
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
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None))
    try:
        before = observed()
        origin = CompileOrigin(time.time(), [], 0, time.time())
        lead.compiled(origin, report)  # queued, written by the thread
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


def wait_for_observed(count: float) -> None:
    deadline = time.monotonic() + 10
    while observed() < count and time.monotonic() < deadline:
        time.sleep(0.01)


def dropped() -> float:
    return sum(sample.value for metric in LEAD_TIME_DROPPED.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


def test_a_burst_of_reports_is_checked_together(
        compiled: tuple[Fleet, CompileReport], db: SqliteDatabase,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reports that arrive within `GATHER` of the one that woke the thread are checked
    in one batch (one read of their marks): a wake and a read per report cost the request
    path a thread switch each while a change reaches 10,000 devices. Counted by a spy on
    the real store's reads."""
    fleet, report = compiled
    monkeypatch.setattr(leadtime, "GATHER", 1.0)  # (a margin over a slow machine's switch)
    reads: list[int] = []
    marks_of = lead_rows.marks_of

    def counted(conn: object, wanted: list[str]) -> object:
        reads.append(len(wanted))
        return marks_of(conn, wanted)  # type: ignore[arg-type]

    monkeypatch.setattr(lead_rows, "marks_of", counted)
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None))
    try:
        before = observed()
        lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report)
        for index in range(3):
            installed(lead, fleet, f"edge-{index}")
            time.sleep(0.05)  # one at a time, as devices report
        deadline = time.monotonic() + 10
        while observed() < before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert observed() == before + 3
        assert reads == [3]
    finally:
        lead.stop()


def test_replicas_time_a_report_that_came_before_its_mark(
        compiled: tuple[Fleet, CompileReport], db: SqliteDatabase,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The devices' reports reach a replica before the compiling one has written the marks
    (it writes them after publishing): they are looked at again, and timed once."""
    fleet, report = compiled
    monkeypatch.setattr(leadtime, "RECHECK_AFTER", (0.2, 0.4, 0.8))
    monkeypatch.setattr(leadtime, "GATHER", 0.0)  # checked as they come: the sleep below
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None), recheck=True)
    try:
        before = observed()
        for index in range(3):
            installed(lead, fleet, f"edge-{index}")
        time.sleep(0.3)  # checked once at least, no mark yet
        assert observed() == before
        lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report)
        wait_for_observed(before + 3)
        assert observed() == before + 3
        time.sleep(1.0)  # nothing is counted twice
        assert observed() == before + 3
    finally:
        lead.stop()


def test_one_server_does_not_look_again_and_replicas_give_up(
        compiled: tuple[Fleet, CompileReport], db: SqliteDatabase,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A report no compile marked (a reinstall of unchanged bytes) is looked at as often as
    `RECHECK_AFTER` says, then forgotten; beyond `RECHECK_LIMIT` it is counted dropped.
    One server never looks again: its marks are written before it checks any report."""
    fleet, report = compiled
    monkeypatch.setattr(leadtime, "RECHECK_AFTER", (0.1, 0.2))
    monkeypatch.setattr(leadtime, "RECHECK_LIMIT", 2)
    monkeypatch.setattr(leadtime, "GATHER", 0.0)  # checked as they come: the sleeps below
    for recheck in (False, True):
        lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None), recheck=recheck)
        try:
            before, lost = observed(), dropped()
            for index in range(3):
                installed(lead, fleet, f"edge-{index}")
            time.sleep(0.2)
            assert dropped() == lost + (1 if recheck else 0)  # the third: over the limit
            time.sleep(0.6)  # past the last look
            assert observed() == before
        finally:
            lead.stop()
    # The marks written afterwards time nothing: those reports were forgotten.
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None), recheck=True)
    try:
        before = observed()
        lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report)
        time.sleep(0.5)
        assert observed() == before
    finally:
        lead.stop()


def test_marks_queued_at_stop_are_written(compiled: tuple[Fleet, CompileReport],
                                          db: SqliteDatabase) -> None:
    """A server stopping right after a compile leaves its marks for its next start."""
    fleet, report = compiled
    lead = LeadTimes(db, DesiredState(fleet.store), Tracing(None))
    lead.compiled(CompileOrigin(time.time(), [], 0, time.time()), report)
    lead.stop()
    marks = db.read(lambda conn: lead_rows.marks_of(
        conn, [deployment_id("web", f"edge-{i}") for i in range(3)]))
    assert len(marks) == 3
