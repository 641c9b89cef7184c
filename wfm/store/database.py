"""Persistence for the fleet server, whatever the engine: durable group commit.

Nothing a device reports may be lost, and every 2xx is sent only after the write is
durable. One writer thread owns the write connection: request handlers hand it a function
and await its result; the thread runs every function queued at that moment in ONE
transaction (each in a savepoint, so one bad write does not sink its neighbours) and
commits, so a thousand concurrent status reports cost a handful of commits instead of a
thousand. Reads run on other connections and see every committed write.

The SQL is plain (`INSERT ... ON CONFLICT ... DO UPDATE`, `?` placeholders), so PostgreSQL
(`wfm.store.pgdb`, several server replicas on one database; its connections translate the
placeholders) and SQLite (`wfm.store.sqlitedb`) take each other's place behind the same
functions: both engines implement `Database` here, and `wfm.store.opening.open_database` picks one.
This module knows neither engine. When the store cannot be reached, reads and writes
raise `DatabaseUnavailable`, which the API answers with 503 and `Retry-After`: nothing is
acknowledged that was not stored.

The writer thread must outlive every error: an error outside a single write's savepoint
(`BEGIN`, `COMMIT`, connecting; SQLite's "database is locked" when another process holds
the write lock past the busy timeout) fails that batch's writes, `DatabaseUnavailable` when
it means "not now", lets go of the connection (it may be broken) and goes on with the next
batch. Were the thread to stop anyway, writes fail at once instead of waiting for nobody.
`alive()` and `readiness()` tell `/livez` and `/readyz` (`wfm.server.app`) which of those it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import anyio.to_thread

from wfm.telemetry.metrics import (
    DB_BATCH_SECONDS,
    DB_BATCH_WRITES,
    DB_PERIODIC_READS,
    DB_REQUEST_READS,
)

__all__ = ["Connection", "Cursor", "Database", "DatabaseUnavailable"]

T = TypeVar("T")
log = logging.getLogger("margo.wfm.db")


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What the record functions use of a connection (sqlite3's, or `wfm.store.pgdb`'s)."""

    def execute(self, sql: str, parameters: Any = ...) -> Cursor: ...

    def executemany(self, sql: str, rows: Any, /) -> Any: ...


class DatabaseUnavailable(RuntimeError):
    """The store cannot be reached now; the request may be retried later."""



class _Stop:
    pass


class _Awaited:
    """A write awaited on an event loop: the writer settles its asyncio future on that loop,
    every write of a batch in one callback (`_settle_on_loops`). A `concurrent.futures`
    future chained to the loop cost a lock, a condition and one loop wakeup per write: at
    thousands of status reports a second, a tenth of what the event loop spent on one."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]):
        self.loop, self.future = loop, future

    def set_running_or_notify_cancel(self) -> bool:
        # Read on the writer thread: a caller cancelled from now on is like one cancelled
        # while its write ran (it is stored, the caller is told nothing), as before.
        return not self.future.cancelled()

    def done(self) -> bool:
        return self.future.done()


Waiter = Future[Any] | _Awaited
Work = tuple[Callable[[Any], Any], Waiter]


def _settle_on_loops(results: list[tuple[Waiter, Any, BaseException | None]]) -> None:
    """Resolve the waiters of a batch: thread futures here, loop futures with one callback
    per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any,
                                                        BaseException | None]]] = {}
    for waiter, value, error in results:
        if isinstance(waiter, _Awaited):
            by_loop.setdefault(waiter.loop, []).append((waiter.future, value, error))
        elif error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(value)
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, settled)


def _answered() -> None:
    """Every statement sent was answered already (statements wait for their answers)."""


def _settle(settled: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, value, error in settled:
        if future.done():  # cancelled while its write ran
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


class Database:
    """The server's database. Reads: `read(fn)`. Durable writes: `await write(fn)`.
    Subclasses say how to connect, how a write transaction begins, which errors mean
    the store is gone and how to probe that it is back."""

    dialect = "sqlite"
    begin = "BEGIN"
    #: Errors that mean "the store is unreachable", reported as `DatabaseUnavailable`.
    unavailable: tuple[type[BaseException], ...] = ()
    #: A batch still unfinished after this many seconds makes the store "not ready": the
    #: writer is alive but stuck (a connection that hangs), and writes are waiting on it.
    stalled_after = 60.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Work | _Stop] = queue.SimpleQueue()
        #: Orders `submit` against the writer's exit, so no write is queued for nobody.
        self._state = threading.Lock()
        #: Why the writer takes no more writes (closed, or stopped); None while it runs.
        self._stopped: str | None = None
        #: Why the last batch was refused as unavailable; None since a batch committed.
        self._last_failure: str | None = None
        #: When the batch in progress started (`time.monotonic`); None between batches.
        self._batch_started: float | None = None
        self._writer = threading.Thread(target=self._writer_main, name="margo-db-writer",
                                        daemon=True)
        self._writer.start()

    # --- to provide --------------------------------------------------------------------

    def _write_connection(self) -> Any:
        raise NotImplementedError

    def _close_write_connection(self, conn: Any) -> None:
        conn.close()

    def _pipelined(self, conn: Any) -> contextlib.AbstractContextManager[Callable[[], None]]:
        """How a batch's statements travel on the write connection: here each waits for
        its answer. An engine across a network sends a write's statements without waiting
        (`wfm.store.pgdb`); the callable it yields waits for them, so that a write's errors
        are raised while it is still the one to roll back. Left, it waits for the rest."""
        return contextlib.nullcontext(_answered)

    def read(self, fn: Callable[[Any], T]) -> T:
        """Run a read on a connection that sees every committed write."""
        raise NotImplementedError

    #: Whether a read waits on another machine (PostgreSQL). An event loop that waited for
    #: it would answer nobody meanwhile, so `aread` hands such reads to a worker thread;
    #: a local SQLite read takes microseconds and is cheaper run where it is.
    remote_reads = False

    async def aread(self, fn: Callable[[Any], T], *, periodic: bool = False) -> T:
        """`read`, for code on the event loop (`periodic`: see `offload`)."""
        return await self.offload(self.read, fn, periodic=periodic)

    async def offload(self, fn: Callable[..., T], *args: Any, periodic: bool = False) -> T:
        """Run `fn(*args)`, a call that reads this store (a registry lookup, say), from the
        event loop: in place for a local store, on a worker thread for a remote one.
        Counted as a request's read, or with `periodic` as a check made at most once a
        second per process (what a device update costs is then the first count alone,
        however long the update took)."""
        (DB_PERIODIC_READS if periodic else DB_REQUEST_READS).inc()
        if not self.remote_reads:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args)

    def _probe(self) -> None:
        """Raise unless a write could be taken right now; quick (readiness calls it while
        the store is failing, and must not hang itself)."""
        raise NotImplementedError

    def _is_unavailable(self, exc: BaseException) -> bool:
        """Whether an error outside a single write means "the store cannot take writes
        now" (answered 503 with `Retry-After`) rather than a defect (answered 500)."""
        return isinstance(exc, self.unavailable)

    # --- writes ------------------------------------------------------------------------

    def submit(self, fn: Callable[[Any], T]) -> Future[T]:
        """Queue a write; the future resolves after it is committed (durably). When the
        writer is gone, the future has failed already: waiting would be forever."""
        future: Future[T] = Future()
        refused = self._enqueue((fn, future))
        if refused is not None:
            future.set_exception(DatabaseUnavailable(refused))
        return future

    async def write(self, fn: Callable[[Any], T]) -> T:
        """`submit`, awaited on the running event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        refused = self._enqueue((fn, _Awaited(loop, future)))
        if refused is not None:
            raise DatabaseUnavailable(refused)
        return await future

    def _enqueue(self, work: Work) -> str | None:
        """Queue a write for the writer; why not when it is gone (None: queued)."""
        with self._state:
            if self._stopped is None and self._writer.is_alive():
                self._queue.put(work)
                return None
            return self._stopped or "the database writer stopped"

    def write_sync(self, fn: Callable[[Any], T]) -> T:
        return self.submit(fn).result()

    def write_apart(self, fn: Callable[[Any], T]) -> T:
        """A durable write in a transaction of its own, beside the writer's batches where
        the engine allows (PostgreSQL: a connection of its own), so a long one (a compile's
        pack, hundreds of megabytes) holds back no other write. Here: `write_sync`."""
        return self.write_sync(fn)

    # --- health ------------------------------------------------------------------------

    def alive(self) -> bool:
        """Whether the writer runs (liveness: a server whose writer stopped must restart;
        one that cannot reach its store now must not, it would only lose its caches)."""
        return self._stopped is None and self._writer.is_alive()

    def readiness(self) -> str | None:
        """None when durable writes can be taken now, else why not (readiness). Cheap: the
        store is probed only after a batch was refused as unavailable, and a batch that
        committed since settles it."""
        if not self.alive():
            return self._stopped or "the database writer stopped"
        started = self._batch_started
        if started is not None and time.monotonic() - started > self.stalled_after:
            return (f"a database write has been waiting for "
                    f"{time.monotonic() - started:.0f} s")
        failure = self._last_failure
        if failure is None:
            return None
        try:
            self._probe()
        except Exception as exc:
            return f"{failure} (and still: {exc})"
        return None

    # --- the writer --------------------------------------------------------------------

    def _writer_main(self) -> None:
        reason = "the database is closed"
        try:
            self._write_loop()
        except BaseException as exc:  # not an Exception: nothing to go on after
            reason = f"the database writer stopped: {exc!r}"
            log.critical("the database writer stopped; writes fail until the server is "
                         "restarted", exc_info=True)
        finally:
            with self._state:
                self._stopped = reason
            self._fail_queued(reason)

    def _write_loop(self) -> None:
        conn: Any = None
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    break
                if not batch:
                    continue  # every write in it was given up on before it ran
                self._batch_started = started = time.monotonic()
                outcome = "failed"
                try:
                    if conn is None:
                        conn = self._write_connection()
                    self._run_batch(conn, batch)
                    self._last_failure = None
                    outcome = "committed"
                except Exception as exc:  # outside any one write: the batch fails, the
                    self._batch_failed(batch, exc)  # writer goes on, on a new connection
                    self._drop(conn)
                    conn = None
                    outcome = "unavailable" if self._is_unavailable(exc) else "failed"
                except BaseException as exc:
                    self._batch_failed(batch, exc)
                    raise
                finally:
                    self._batch_started = None
                    DB_BATCH_SECONDS.labels(outcome).observe(time.monotonic() - started)
                    DB_BATCH_WRITES.observe(len(batch))
        finally:
            self._drop(conn)

    def _next_batch(self) -> list[Work] | None:
        """Every write queued now (None: stop). Each future is marked running first, so a
        caller can no longer cancel it under the writer; one cancelled already is skipped
        (its caller was told nothing, so nothing is stored)."""
        first = self._queue.get()
        if isinstance(first, _Stop):
            return None
        batch = [first]
        while len(batch) < 1000:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Stop):
                self._queue.put(item)
                break
            batch.append(item)
        return [work for work in batch if work[1].set_running_or_notify_cancel()]

    def _drop(self, conn: Any) -> None:
        if conn is not None:  # it may be broken: we only let go of it (closing rolls back)
            with contextlib.suppress(Exception):
                self._close_write_connection(conn)

    def _batch_failed(self, batch: list[Work], exc: BaseException) -> None:
        """Answer every write of a batch that failed as a whole: 503 when the store cannot
        take writes now, else the error itself (a defect, logged with its traceback)."""
        unavailable = self._is_unavailable(exc)
        if unavailable:
            reason = f"the database is unavailable: {exc}"
            self._last_failure = reason
            log.warning("%d write(s) refused: %s", len(batch), reason)
        else:
            log.error("a batch of %d write(s) failed", len(batch), exc_info=exc)
        failed: list[tuple[Waiter, Any, BaseException | None]] = []
        for _, future in batch:
            if future.done():
                continue
            if unavailable:
                error = DatabaseUnavailable(reason)
                error.__cause__ = exc
                failed.append((future, None, error))
            else:
                failed.append((future, None, exc))
        _settle_on_loops(failed)

    def _fail_queued(self, reason: str) -> None:
        """Fail what is still queued when the writer ends (written after `close`)."""
        failed: list[tuple[Waiter, Any, BaseException | None]] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Stop) and item[1].set_running_or_notify_cancel():
                failed.append((item[1], None, DatabaseUnavailable(reason)))
        _settle_on_loops(failed)

    def _run_batch(self, conn: Any, batch: list[Work]) -> None:
        """One transaction, each write in its own savepoint; the futures resolve after the
        commit. Any error outside a write's savepoint propagates: the batch fails whole."""
        results: list[tuple[Waiter, Any, BaseException | None]] = []
        with self._pipelined(conn) as answered:
            conn.execute(self.begin)
            for fn, future in batch:
                # Each write's savepoint stays on the stack until the commit: `ROLLBACK TO`
                # goes back to the newest of that name, this write's, and not releasing
                # saves a round trip per write (on PostgreSQL, the writer's cost is its
                # round trips).
                conn.execute("SAVEPOINT item")
                try:
                    value = fn(conn)
                    answered()  # (a pipelined write's errors are raised here, still its own)
                    results.append((future, value, None))
                except self.unavailable:
                    raise
                except Exception as exc:  # one bad write must not sink its neighbours
                    conn.execute("ROLLBACK TO SAVEPOINT item")
                    results.append((future, None, exc))
            conn.execute("COMMIT")
        _settle_on_loops(results)

    def close(self) -> None:
        self._queue.put(_Stop())
        self._writer.join(timeout=30)
