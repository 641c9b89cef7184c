"""Concurrent reads for different keys made as one (wfm.store.coalesced), on both engines:
what held polls of a replica do when a generation wakes them all (each asks for its
client's device list)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.coalesced import Coalesced
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
    """`records.clients_devices`, counting its calls and the keys of each."""

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
