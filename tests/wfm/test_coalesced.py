"""Concurrent reads for different keys made as one (wfm.store.coalesced), on both engines:
what held polls of a replica do when a generation wakes them all (each asks for its
client's device list)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from margo.digests import sorted_json
from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.coalesced import Coalesced, CoalescedWrites
from wfm.store.database import Database

DOC = {"properties": {"id": "x", "vendor": "Example"}}


def _fleet(store: Database, clients: int) -> None:
    """Client `plant-c` has devices `dev-c-0` .. (c % 3 of them)."""
    registry = ClientRegistry(store)
    for c in range(clients):
        registry.add(f"plant-{c}")
    written = [store.submit(lambda conn, c=c, d=d: records.store_capabilities(
        conn, client_id=f"plant-{c}", device_id=f"dev-{c}-{d}", document=DOC,
        digest=f"dev-{c}-{d}", shape="rc3")) for c in range(clients) for d in range(c % 3)]
    for future in written:
        future.result(timeout=30)


class Counted:
    """`records.clients_devices` on the real store, counting its calls and the keys of
    each; its first `fail` calls raise instead: a read that fails once and then works is a
    fault the real database cannot produce on demand (stopping it fails every read)."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, conn: Any, keys: Sequence[str]) -> dict[str, tuple[str, ...]]:
        self.calls.append(len(keys))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the read failed")
        return records.clients_devices(conn, keys)


def test_concurrent_reads_go_together_and_answer_each_key(store: Database) -> None:
    _fleet(store, 300)
    read = Counted()
    reads = Coalesced(store, read, (), most=100)

    async def main() -> list[tuple[str, ...]]:
        first = await reads.get("plant-2")  # alone: read at once
        many = await asyncio.gather(*(reads.get(f"plant-{c}") for c in range(300)),
                                    reads.get("plant-4"), reads.get("nobody"))
        return [first, *many]

    answers = asyncio.run(main())
    assert answers[0] == ("dev-2-0", "dev-2-1")
    assert answers[1:301] == [tuple(f"dev-{c}-{d}" for d in range(c % 3)) for c in range(300)]
    assert answers[301] == ("dev-4-0",) and answers[302] == ()
    # the first alone; then the first of the crowd alone, the rest 100 at a time
    assert read.calls[0] == 1 and sum(read.calls) == 1 + 301
    assert len(read.calls) <= 6 and max(read.calls) == 100


def test_a_failed_read_fails_its_own_callers_and_a_gone_caller_takes_no_answer(
        store: Database) -> None:
    _fleet(store, 5)
    read = Counted(fail=1)
    reads = Coalesced(store, read, ())

    async def main() -> tuple[list[Any], tuple[str, ...], tuple[str, ...]]:
        # asked together: one read, which fails for all three callers
        failed = await asyncio.gather(reads.get("plant-1"), reads.get("plant-1"),
                                      reads.get("plant-2"), return_exceptions=True)
        # while plant-3 is read, two callers wait for plant-2's answer; one goes away
        reading = asyncio.ensure_future(reads.get("plant-3"))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(reads.get("plant-2"))
        kept = asyncio.ensure_future(reads.get("plant-2"))
        await asyncio.sleep(0)
        gone.cancel()
        await reading
        return failed, await kept, await reads.get("plant-1")

    failed, kept, again = asyncio.run(main())
    assert [str(e) for e in failed] == ["the read failed"] * 3
    assert kept == ("dev-2-0", "dev-2-1") and again == ("dev-1-0",)
    assert read.calls == [2, 1, 1, 1]  # (plant-2 read once for both its callers)


def test_a_second_event_loop_reads_alone(store: Database) -> None:
    _fleet(store, 3)
    read = Counted()
    reads = Coalesced(store, read, ())
    assert asyncio.run(reads.get("plant-1")) == ("dev-1-0",)
    assert asyncio.run(reads.get("plant-2")) == ("dev-2-0", "dev-2-1")
    assert read.calls == [1, 1]


@pytest.mark.parametrize("clients", [0, 1, 501])
def test_device_lists_of_many_clients_match_one_at_a_time(store: Database,
                                                          clients: int) -> None:
    _fleet(store, clients)
    ids = [f"plant-{c}" for c in range(clients)]
    together = store.read(lambda conn: records.clients_devices(conn, ids))
    assert {c: together.get(c, ()) for c in ids} == {
        c: store.read(lambda conn, c=c: records.client_devices(conn, c)) for c in ids}


def _report(deployment: str, state: str, *, client: str = "plant-0",
            device: str = "dev-0-0", error: str | None = None) -> records.StatusReport:
    status: dict[str, Any] = {"state": state}
    if error is not None:
        status["error"] = {"message": error}
    document = {"deploymentId": deployment, "status": status, "components": []}
    return records.StatusReport(client, deployment, device, state, document,
                                f"{deployment}:{state}:{error}", 1)


def _stored(store: Database, prefix: str) -> list[tuple[Any, ...]]:
    """The statuses (their documents as stored) and their history under deployments named
    `prefix`..., without times and with the prefix cut off."""
    def read(conn: Any) -> list[tuple[Any, ...]]:
        rows = [("status", r[0][len(prefix):], *r[1:5], r[5].replace(f'"{prefix}', '"'))
                for r in conn.execute(
                    "SELECT deployment_id, state, digest, history_count, meaning, document "
                    "FROM statuses WHERE deployment_id LIKE ? ORDER BY deployment_id",
                    (prefix + "%",))]
        return rows + [("history", r[0][len(prefix):], *r[1:]) for r in conn.execute(
            "SELECT deployment_id, state FROM status_reports WHERE deployment_id LIKE ? "
            "ORDER BY id", (prefix + "%",))]
    return store.read(read)


def test_reports_written_together_store_what_one_at_a_time_would(store: Database) -> None:
    """New, repeated (same bytes), re-asserted (same meaning, other bytes) and changed
    reports, one deployment reported twice in one write: the same answers and rows (the
    reports written together carry their serialized text, as the status intake's do)."""
    ClientRegistry(store).add("plant-0")

    def reports(prefix: str) -> list[list[records.StatusReport]]:
        def r(name: str, state: str, error: str | None = None) -> records.StatusReport:
            report = _report(prefix + name, state, error=error)
            return records.StatusReport(**{**{f: getattr(report, f) for f in (
                "client_id", "deployment_id", "device_id", "state", "document", "adopted",
                "applied")}, "digest": report.digest.removeprefix(prefix),
                "text": sorted_json(report.document) if prefix == "all-" else None})
        return [[r("a", "installing"), r("b", "installing"), r("c", "failed", "x")],
                [r("a", "installing"), r("b", "installed"), r("b", "installed"),
                 r("c", "failed", "y"), r("d", "installing"), r("d", "installed")]]

    one_at_a_time = [[store.write_sync(lambda c, r=r: records.store_status(
        c, client_id=r.client_id, deployment_id=r.deployment_id, device_id=r.device_id,
        state=r.state, document=r.document, digest=r.digest, adopted=r.adopted))
        for r in group] for group in reports("one-")]
    together = [store.write_sync(lambda c, g=group: records.store_statuses(c, g))
                for group in reports("all-")]
    assert together == one_at_a_time
    assert [w.changed for w in together[1]] == [False, True, False, True, True, True]
    assert _stored(store, "all-") == _stored(store, "one-")


def test_writes_that_arrive_together_go_together_and_keep_their_own_outcomes(
        store: Database) -> None:
    ClientRegistry(store).add("plant-0")
    groups: list[int] = []

    def many(conn: Any, reports: Sequence[records.StatusReport]) -> list[records.StatusWrite]:
        groups.append(len(reports))
        return records.store_statuses(conn, reports)

    def one(conn: Any, report: records.StatusReport) -> records.StatusWrite:
        if report.deployment_id == "bad":  # a write the database refuses, alone or grouped
            conn.execute("INSERT INTO nowhere VALUES (1)")
        return records.store_statuses(conn, [report])[0]

    def many_with_bad(conn: Any, reports: Sequence[records.StatusReport]
                      ) -> list[records.StatusWrite]:
        return [one(conn, report) for report in reports] if any(
            r.deployment_id == "bad" for r in reports) else many(conn, reports)

    writes = CoalescedWrites(store, many_with_bad, one, most=4)

    async def main() -> list[Any]:
        first = await writes.write(_report("first", "installing"))
        rest = await asyncio.gather(*(writes.write(_report(f"d{i}", "installing"))
                                      for i in range(6)),
                                    writes.write(_report("bad", "installing")),
                                    writes.write(_report("d0", "installed")),
                                    return_exceptions=True)
        return [first, *rest]

    answers = asyncio.run(main())
    assert answers[0] == records.StatusWrite(created=True, changed=True)
    assert answers[1:7] == [records.StatusWrite(created=True, changed=True)] * 6
    assert isinstance(answers[7], (sqlite3.OperationalError, psycopg.errors.UndefinedTable))
    assert answers[8] == records.StatusWrite(created=False, changed=True)
    assert groups[0] == 4  # the first went alone, then four at a time: d0..d3 together
    assert store.read(lambda c: c.execute(
        "SELECT COUNT(*) FROM statuses").fetchone()[0]) == 7
