"""Persistence for the fleet server: SQLite (WAL) or PostgreSQL, with durable group commit.

Nothing a device reports may be lost, and every 2xx is sent only after the write is
durable. One writer thread owns the write connection: request handlers hand it a function
and await its result; the thread runs every function queued at that moment in ONE
transaction (each in a savepoint, so one bad write does not sink its neighbours) and
commits, so a thousand concurrent status reports cost a handful of commits instead of a
thousand. Reads run on other connections and see every committed write.

The SQL is plain (`INSERT ... ON CONFLICT ... DO UPDATE`, `?` placeholders), so PostgreSQL
takes SQLite's place behind the same functions (`wfm.pgdb`, several server replicas on one
database; its connections translate the placeholders). `open_database` picks the store from
its argument: a path, or a `postgresql://` URL. When the store cannot be reached, reads and
writes raise `DatabaseUnavailable`, which the API answers with 503 and `Retry-After`:
nothing is acknowledged that was not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar

from wfm.schema import migrate

__all__ = ["Connection", "Database", "DatabaseUnavailable", "SqliteDatabase", "is_url",
           "open_database"]

T = TypeVar("T")


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What the record functions use of a connection (sqlite3's, or `wfm.pgdb`'s)."""

    def execute(self, sql: str, parameters: Any = ...) -> Cursor: ...


class DatabaseUnavailable(RuntimeError):
    """The store cannot be reached now; the request may be retried later."""


class _Stop:
    pass


Work = tuple[Callable[[Any], Any], Future[Any]]


class Database:
    """The server's database. Reads: `read(fn)`. Durable writes: `await write(fn)`.
    Subclasses say how to connect, how a write transaction begins and which errors mean
    the store is gone."""

    dialect = "sqlite"
    begin = "BEGIN"
    #: Errors that mean "the store is unreachable", reported as `DatabaseUnavailable`.
    unavailable: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Work | _Stop] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="margo-db-writer",
                                        daemon=True)
        self._writer.start()

    # --- to provide --------------------------------------------------------------------

    def _write_connection(self) -> Any:
        raise NotImplementedError

    def _close_write_connection(self, conn: Any) -> None:
        conn.close()

    def read(self, fn: Callable[[Any], T]) -> T:
        """Run a read on a connection that sees every committed write."""
        raise NotImplementedError

    # --- writes ------------------------------------------------------------------------

    def submit(self, fn: Callable[[Any], T]) -> Future[T]:
        """Queue a write; the future resolves after it is committed (durably)."""
        future: Future[T] = Future()
        self._queue.put((fn, future))
        return future

    async def write(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def write_sync(self, fn: Callable[[Any], T]) -> T:
        return self.submit(fn).result()

    def _write_loop(self) -> None:
        conn: Any = None
        while True:
            first = self._queue.get()
            if isinstance(first, _Stop):
                break
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
            try:
                if conn is None:
                    conn = self._write_connection()
                self._run_batch(conn, batch)
            except self.unavailable as exc:  # the store went away: fail this batch,
                self._fail(batch, exc)  # connect again for the next one
                conn = self._drop(conn)
        if conn is not None:
            self._close_write_connection(conn)

    def _drop(self, conn: Any) -> None:
        if conn is not None:  # it is broken: we only let go of it
            with contextlib.suppress(Exception):
                self._close_write_connection(conn)

    def _fail(self, batch: list[Work], exc: BaseException) -> None:
        error = DatabaseUnavailable(f"the database is unavailable: {exc}")
        for _, future in batch:
            if not future.done():
                future.set_exception(error)

    def _run_batch(self, conn: Any, batch: list[Work]) -> None:
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        conn.execute(self.begin)
        for fn, future in batch:
            conn.execute("SAVEPOINT item")
            try:
                results.append((future, fn(conn), None))
                conn.execute("RELEASE SAVEPOINT item")
            except self.unavailable:
                raise
            except Exception as exc:  # one bad write must not sink its neighbours
                conn.execute("ROLLBACK TO SAVEPOINT item")
                conn.execute("RELEASE SAVEPOINT item")
                results.append((future, None, exc))
        try:
            conn.execute("COMMIT")
        except self.unavailable:
            raise
        except Exception as exc:
            conn.execute("ROLLBACK")
            for future, _, _ in results:
                future.set_exception(exc)
            return
        for future, value, error in results:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def close(self) -> None:
        self._queue.put(_Stop())
        self._writer.join(timeout=30)


class SqliteDatabase(Database):
    """One file (WAL, `synchronous=FULL`); one server process at a time (`wfm.datalock`)."""

    dialect = "sqlite"
    begin = "BEGIN IMMEDIATE"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        setup = self._connect()
        migrate(setup, self.dialect)
        setup.close()
        self._local = threading.local()
        super().__init__()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def _write_connection(self) -> sqlite3.Connection:
        return self._connect()

    def read(self, fn: Callable[[Any], T]) -> T:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return fn(conn)

    def close(self) -> None:
        super().close()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def open_database(target: str | Path) -> Database:
    """A PostgreSQL database for a `postgresql://` URL, else the SQLite file at `target`."""
    if is_url(target):
        from wfm.pgdb import PostgresDatabase  # psycopg only where PostgreSQL is used

        return PostgresDatabase(str(target))
    return SqliteDatabase(target)
