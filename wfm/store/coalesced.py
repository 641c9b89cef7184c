"""Concurrent reads of one kind, for different keys, made as one read of many keys.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from wfm.store.database import Database

__all__ = ["Coalesced"]

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
            for future in batch.values():
                if not future.done():
                    future.set_exception(exc)
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
