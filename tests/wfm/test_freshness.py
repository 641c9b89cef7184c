"""Device freshness (wfm.fleet.freshness) and the poll clock behind last-seen
(wfm.fleet.lastseen)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wfm.fleet.freshness import MIN_STALE, STALE_AFTER, device_freshness
from wfm.fleet.lastseen import PollClock
from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.sqlitedb import SqliteDatabase

NOW = 1_900_000_000.0
HELD = {"d1": "sha256:new", "d2": "sha256:same"}


def freshness(statuses: dict[str, dict[str, object]], *, last_seen: float | None = NOW - 5,
              interval: float | None = 30.0) -> str:
    return device_freshness(deployments=HELD, statuses=statuses, last_seen=last_seen,
                            poll_interval=interval, now=NOW).state


def test_installed_for_the_current_bytes_is_current() -> None:
    assert freshness({"d1": {"state": "installed", "applied": "sha256:new"},
                      "d2": {"state": "installed", "applied": "sha256:same"}}) == "current"


def test_installed_for_an_older_digest_is_pending() -> None:
    """d1 changed: its `installed` for the old bytes says nothing about the new ones; d2
    did not change, so its report still counts."""
    assert freshness({"d1": {"state": "installed", "applied": "sha256:old"},
                      "d2": {"state": "installed", "applied": "sha256:same"}}) == "pending"
    assert freshness({"d2": {"state": "installed", "applied": "sha256:same"}}) == "pending"


def test_failed_for_the_current_bytes_is_failed_on_current_but_an_old_failure_is_not() -> None:
    assert freshness({"d1": {"state": "failed", "applied": "sha256:new"},
                      "d2": {"state": "installed", "applied": "sha256:same"}}
                     ) == "failed-on-current"
    assert freshness({"d1": {"state": "failed", "applied": "sha256:old"},
                      "d2": {"state": "installed", "applied": "sha256:same"}}) == "pending"


def test_a_status_about_unknown_bytes_does_not_count() -> None:
    """No adopted state known (a claim the server could not resolve): not current."""
    assert freshness({"d1": {"state": "installed", "applied": None},
                      "d2": {"state": "installed", "applied": "sha256:same"}}) == "pending"
    assert freshness({"d1": {"state": "installed"},
                      "d2": {"state": "installed", "applied": "sha256:same"}}) == "pending"


def test_silence_makes_a_device_stale_whatever_its_statuses_say() -> None:
    current = {"d1": {"state": "installed", "applied": "sha256:new"},
               "d2": {"state": "installed", "applied": "sha256:same"}}
    assert freshness(current, last_seen=NOW - 3 * 30 + 1, interval=30.0) == "current"
    assert freshness(current, last_seen=NOW - 3 * 30 - 1, interval=30.0) == "stale"
    assert freshness(current, last_seen=NOW - MIN_STALE + 1, interval=1.0) == "current"
    assert freshness(current, last_seen=NOW - STALE_AFTER + 1, interval=None) == "current"
    assert freshness(current, last_seen=NOW - STALE_AFTER - 1, interval=None) == "stale"
    assert freshness(current, last_seen=None) == "stale"


def test_no_deployments_and_heard_from_is_current() -> None:
    assert device_freshness(deployments={}, statuses={}, last_seen=NOW,
                            poll_interval=None, now=NOW).state == "current"


@pytest.fixture
def db(tmp_path: Path) -> SqliteDatabase:
    database = SqliteDatabase(tmp_path / "wfm.sqlite")
    ClientRegistry(database).add("edge")
    yield database
    database.close()


def test_the_poll_clock_learns_the_interval_and_writes_in_batches(db: SqliteDatabase) -> None:
    clock = PollClock(db, flush_every=3600)
    for i in range(6):
        clock.seen("edge", now=NOW + 15 * i)
    assert db.read(records.client_polls)["edge"] == (None, None)  # not flushed yet
    clock.seen("edge", now=NOW + 15 * 6 + 3000)  # switched off for a while: not an interval
    clock.flush()
    db.write_sync(lambda conn: None)  # the batch is committed before this one
    last, interval = db.read(records.client_polls)["edge"]
    assert last == NOW + 15 * 6 + 3000
    assert interval == pytest.approx(15.0)


def test_what_this_process_reads_back_includes_the_polls_not_written_yet(
        db: SqliteDatabase) -> None:
    """The fleet API, the dashboard and `/metrics` see a poll at once, though it is written
    only at the next flush; a newer time stored by another replica is kept."""
    clock = PollClock(db, flush_every=3600)
    clock.seen("edge", now=NOW)
    clock.seen("edge", now=NOW + 15)
    stored = db.read(records.client_polls)
    assert stored["edge"] == (None, None)
    assert clock.up_to_date(stored)["edge"] == (NOW + 15, 15.0)
    assert clock.up_to_date({"edge": (NOW + 40, 20.0), "other": (NOW, 60.0)}) == {
        "edge": (NOW + 40, 20.0), "other": (NOW, 60.0)}


def test_manifest_history_records_each_new_version_only(db: SqliteDatabase) -> None:
    first = db.write_sync(lambda c: records.advance_manifest_version(
        c, "edge", "sha256:a", 0, {"d1": "sha256:x"}))
    again = db.write_sync(lambda c: records.advance_manifest_version(
        c, "edge", "sha256:a", 0, {"d1": "sha256:ignored"}))
    second = db.write_sync(lambda c: records.advance_manifest_version(
        c, "edge", "sha256:b", 0, {"d1": "sha256:y"}))
    assert (first, again, second) == (1, 1, 2)
    assert db.read(lambda c: records.manifest_contents(c, "edge", {1, 2, 3})) == {
        1: {"d1": "sha256:x"}, 2: {"d1": "sha256:y"}}
