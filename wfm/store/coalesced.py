"""Concurrent reads of one kind, for different keys, made as one read of many keys; and
concurrent writes of one kind made as one write of many items.

When a compile publishes a generation, every held poll of a replica wakes and asks for its
client's device list at once: thousands of single-row reads, each a round trip to
PostgreSQL through a worker thread (`Database.aread`), queued behind the pool's few
connections. Here the keys asked for while a read is on its way wait for it to finish and
then go together, in reads of at most `most` keys: the first caller after a quiet moment
is read at once, alone; under load the reads grow to match it (a data loader's batching,
driven by the round trip instead of a timer).

Each caller awaits its own key's answer through `asyncio.shield`: a caller that goes away
(its client disconnected) takes nobody's answer with it. A failed read fails every caller
of its batch with the same error (503 for `DatabaseUnavailable`, as a single read would).

Writes the same way (`CoalescedWrites`): the status reports of a fleet taking up a change
arrive by the thousand, and each read its stored status before writing it, a round trip
of its own on PostgreSQL; written together, the stored statuses are read in one statement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from wfm.store.database import Database, DatabaseUnavailable

__all__ = ["Coalesced", "CoalescedWrites"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalesced(Generic[K, V]):
    """`await get(key)`: `read_many(conn, keys)[key]` (`missing` when it has none), read
    together with the other keys asked for meanwhile, on the event loop it is first
    used on (another loop reads its key alone)."""

    def __init__(self, db: Database, read_many: Callable[[Any, Sequence[K]], dict[K, V]],
                 missing: V, *, most: int = 500) -> None:
        self._db, self._read_many, self._missing, self._most = db, read_many, missing, most
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[K, asyncio.Future[V]] = {}
        self._reading: asyncio.Task[None] | None = None

    async def get(self, key: K) -> V:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            return await self._read_alone(key)
        future = self._waiting.get(key)
        if future is None:
            future = self._waiting[key] = loop.create_future()
            future.add_done_callback(_retrieved)
            if self._reading is None:
                self._next_read()
        return await asyncio.shield(future)

    async def _read_alone(self, key: K) -> V:
        found = await self._db.aread(lambda conn: self._read_many(conn, [key]))
        return found.get(key, self._missing)

    def _next_read(self) -> None:
        self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        """Read the keys waiting when it starts (at most `most`); the rest go when it is
        done. A key asked for after that waits for the next read: this one may predate
        what its caller must see (a device registered since)."""
        batch = {key: self._waiting.pop(key) for key in list(self._waiting)[:self._most]}
        try:
            found = await self._db.aread(lambda conn: self._read_many(conn, list(batch)))
        except asyncio.CancelledError:  # the loop is closing
            for future in batch.values():
                future.cancel()
            raise
        except Exception as exc:
            _fail(list(batch.items()), exc)
        else:
            for key, future in batch.items():
                if not future.done():
                    future.set_result(found.get(key, self._missing))
        finally:
            self._reading = None
            if self._waiting:
                self._next_read()


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a failed answer seen: its callers may all have gone (asyncio would log it)."""
    if not future.cancelled():
        future.exception()


class CoalescedWrites(Generic[K, V]):
    """`await write(item)`: `write_one(conn, item)`'s result, written in one durable write
    with the other items handed in meanwhile (`write_many(conn, items)`, a result per item,
    in order): the first item after a quiet moment goes at once, alone; the items that
    arrive while a write is on its way go together once it is done, at most `most` a
    write. When a write of several fails (other than `DatabaseUnavailable`, which fails
    them all), the database rolled it back whole, and each item is written again on its
    own: its own result, or its own error, as if it had never been grouped."""

    def __init__(self, db: Database, write_many: Callable[[Any, Sequence[K]], list[V]],
                 write_one: Callable[[Any, K], V], *, most: int = 500) -> None:
        self._db, self._most = db, most
        self._write_many, self._write_one = write_many, write_one
        self._waiting: list[tuple[K, asyncio.Future[V]]] = []
        self._writing: asyncio.Task[None] | None = None

    async def write(self, item: K) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)
        self._waiting.append((item, future))
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._next_write())
        return await asyncio.shield(future)

    async def _next_write(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = (self._waiting[:self._most],
                                        self._waiting[self._most:])
                await self._write(batch)
        finally:
            self._writing = None

    async def _write(self, batch: list[tuple[K, asyncio.Future[V]]]) -> None:
        items = [item for item, _ in batch]
        try:
            if len(items) == 1:
                results = [await self._db.write(lambda conn: self._write_one(conn, items[0]))]
            else:
                results = await self._db.write(lambda conn: self._write_many(conn, items))
        except DatabaseUnavailable as exc:
            _fail(batch, exc)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch, exc)
            else:
                await asyncio.gather(*(self._write([entry]) for entry in batch))
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


def _fail(batch: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
