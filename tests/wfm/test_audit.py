"""The audit trail's store (`wfm.fleet.audit`), on SQLite and on PostgreSQL: entries come
back as recorded, filtered and limited; the retention is the only deletion (at start and
with each entry the server appends); details are cut, outcomes checked."""

from __future__ import annotations

import asyncio
import time

import pytest

from wfm.fleet.audit import (
    DETAIL_CHARS,
    Auditor,
    entries,
    local_operator,
    record,
    record_sync,
)
from wfm.identity.operators import ANONYMOUS, Operator, Role
from wfm.store import audit_rows
from wfm.store.database import Database

OTTO = Operator("otto", Role.OPERATOR, "token")


def _old(db: Database, days: float, action: str) -> None:
    at = time.time() - days * 86400
    db.write_sync(lambda conn: audit_rows.append(
        conn, (at, "old", "token", "viewer", action, "x", "ok", None, None, None)))


def test_entries_come_back_as_recorded_filtered_and_limited(store: Database) -> None:
    asyncio.run(record(store, OTTO, "rollout.pause", "web", address="10.0.0.7",
                       replica="r1"))
    record_sync(store, local_operator(), "operator.add", "ada", detail="role admin")
    asyncio.run(record(store, ANONYMOUS, "rollout.abort", "web", outcome="failed",
                       detail="x" * 5000))
    found = entries(store)
    assert [(e.actor, e.via, e.role, e.action, e.target, e.outcome) for e in found] == [
        ("otto", "token", "operator", "rollout.pause", "web", "ok"),
        (local_operator().name, "local", "admin", "operator.add", "ada", "ok"),
        ("anonymous", "open", "admin", "rollout.abort", "web", "failed")]
    assert found[0].address == "10.0.0.7" and found[0].replica == "r1"
    assert len(found[2].detail or "") == DETAIL_CHARS
    assert found[0].id is not None and found[0].id < found[1].id < found[2].id  # type: ignore[operator]
    assert [e.action for e in entries(store, actor="otto")] == ["rollout.pause"]
    assert [e.action for e in entries(store, limit=2)] == ["operator.add", "rollout.abort"]
    assert entries(store, since=time.time() + 10) == []
    doc = found[0].to_json()
    assert doc["at"].endswith("Z") and doc["actor"] == "otto"
    with pytest.raises(ValueError, match="outcome"):
        record_sync(store, OTTO, "rollout.pause", "web", outcome="maybe")


def test_the_retention_is_the_only_deletion(store: Database) -> None:
    _old(store, 400, "ancient")
    _old(store, 20, "last-month")
    auditor = Auditor(retention_days=30)
    auditor.open(store)  # trims at start (not awaited: read after a write that follows it)
    asyncio.run(auditor.record(OTTO, "rollout.resume", "web"))
    assert [e.action for e in entries(store)] == ["last-month", "rollout.resume"]
    _old(store, 45, "late-arrival")
    asyncio.run(_recorded(store, 30))
    assert [e.action for e in entries(store)] == ["last-month", "rollout.resume",
                                                  "rollout.pause"]
    with pytest.raises(ValueError):
        Auditor(retention_days=0)


async def _recorded(db: Database, days: float) -> None:
    auditor = Auditor(retention_days=days)
    auditor.db = db  # as opened, without the trim at start: the append trims by itself
    await auditor.record(OTTO, "rollout.pause", "web")
