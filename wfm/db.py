"""Persistence for the fleet server: SQLite (WAL) with durable group commit.

Nothing a device reports may be lost, and every 2xx is sent only after the write is on
disk. One writer thread owns the write connection: request handlers hand it a function
and await its result; the thread runs every function queued at that moment in ONE
transaction and commits with `synchronous=FULL`, so a thousand concurrent status reports
cost a handful of fsyncs instead of a thousand. Reads use per-thread connections.

The SQL is plain (`INSERT ... ON CONFLICT ... DO UPDATE`, no SQLite-only statements), so
PostgreSQL can take SQLite's place behind the same functions for several server replicas
(placeholders are translated by `sql()`).
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Database"]

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY,
    token_hash TEXT UNIQUE,
    certificate TEXT,
    created_at REAL NOT NULL,
    retired INTEGER NOT NULL DEFAULT 0,
    manifest_version INTEGER NOT NULL DEFAULT 0,
    manifest_state TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS access_tokens (
    token_hash TEXT PRIMARY KEY,
    client_id TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY,
    client_id TEXT NOT NULL,
    document TEXT NOT NULL,
    digest TEXT NOT NULL,
    shape TEXT NOT NULL,
    reported_at REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS devices_by_client ON devices (client_id);
CREATE TABLE IF NOT EXISTS capability_reports (
    id INTEGER PRIMARY KEY,
    device_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    document TEXT NOT NULL,
    reported_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS capability_reports_by_device ON capability_reports (device_id);
CREATE TABLE IF NOT EXISTS statuses (
    deployment_id TEXT PRIMARY KEY,
    client_id TEXT NOT NULL,
    device_id TEXT,
    state TEXT NOT NULL,
    document TEXT NOT NULL,
    digest TEXT NOT NULL,
    adopted_manifest_version INTEGER,
    reported_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS status_reports (
    id INTEGER PRIMARY KEY,
    deployment_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    device_id TEXT,
    state TEXT NOT NULL,
    document TEXT NOT NULL,
    reported_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS status_reports_by_deployment ON status_reports (deployment_id);
"""


def sql(statement: str, paramstyle: str = "qmark") -> str:
    """The statement for a driver's parameter style (`?` for sqlite3, `%s` for psycopg)."""
    return statement if paramstyle == "qmark" else statement.replace("?", "%s")


class _Stop:
    pass


class Database:
    """The server's database. Reads: `read(fn)`. Durable writes: `await write(fn)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        setup = self._connect()
        setup.executescript(SCHEMA)
        setup.close()
        self._local = threading.local()
        self._queue: queue.SimpleQueue[tuple[Callable[[sqlite3.Connection], Any],
                                             Future[Any]] | _Stop] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="margo-db-writer",
                                        daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    # --- reads -------------------------------------------------------------------------

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read on this thread's connection (sees every committed write)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return fn(conn)

    # --- writes ------------------------------------------------------------------------

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Queue a write; the future resolves after it is committed (fsync'd)."""
        future: Future[T] = Future()
        self._queue.put((fn, future))
        return future

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def write_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return self.submit(fn).result()

    def _write_loop(self) -> None:
        conn = self._connect()
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
            self._run_batch(conn, batch)
        conn.close()

    @staticmethod
    def _run_batch(conn: sqlite3.Connection,
                   batch: list[tuple[Callable[[sqlite3.Connection], Any], Future[Any]]]) -> None:
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        conn.execute("BEGIN IMMEDIATE")
        for fn, future in batch:
            conn.execute("SAVEPOINT item")
            try:
                results.append((future, fn(conn), None))
                conn.execute("RELEASE item")
            except Exception as exc:  # one bad write must not sink its neighbours
                conn.execute("ROLLBACK TO item")
                conn.execute("RELEASE item")
                results.append((future, None, exc))
        try:
            conn.execute("COMMIT")
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
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
