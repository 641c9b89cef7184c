"""The fleet server's store in one SQLite file (WAL, `synchronous=FULL`), and the checks
that refuse a file that cannot be trusted before a server starts on it.

One server process at a time uses a file (`wfm.server.datalock`); its durable writes go through
the group-commit writer of `wfm.store.database`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from wfm.store.database import Database
from wfm.store.schema import migrate

__all__ = ["DatabaseDamaged", "SqliteDatabase", "check_sqlite_file"]

T = TypeVar("T")

#: How long a SQLite write waits for the write lock (held by another process: a backup, an
#: operator's `sqlite3` shell) before its batch is refused with 503 and `Retry-After`.
_BUSY_TIMEOUT = 30.0
#: Overrides `_BUSY_TIMEOUT` (seconds) for servers that are started as processes (tests).
_BUSY_TIMEOUT_ENV = "MARGO_SQLITE_BUSY_TIMEOUT"
#: SQLite's primary result codes that mean "the file cannot be written now", not "this
#: statement is wrong": BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN, PROTOCOL.
_SQLITE_UNAVAILABLE = frozenset({5, 6, 8, 10, 13, 14, 15})


class DatabaseDamaged(RuntimeError):
    """The server's SQLite file cannot be trusted (empty, unreadable, failing its integrity
    check, or gone from a data directory that was used): refused at start, because starting
    on an empty database would silently drop every client and their manifestVersions."""



class SqliteDatabase(Database):
    """One file (WAL, `synchronous=FULL`); one server process at a time (`wfm.server.datalock`).

    `busy_timeout`: seconds a statement waits for a lock another process holds before it
    fails (then its writes are answered 503); by default `$MARGO_SQLITE_BUSY_TIMEOUT`, else
    30 s."""

    dialect = "sqlite"
    begin = "BEGIN IMMEDIATE"

    def __init__(self, path: str | Path, *, busy_timeout: float | None = None):
        self.path = Path(path)
        self.busy_timeout = _busy_timeout() if busy_timeout is None else busy_timeout
        self.stalled_after = max(Database.stalled_after, 2 * self.busy_timeout)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_sqlite_file(self.path, integrity=False)  # `margo serve` checks it whole first
        try:
            setup = self._connect()
            try:
                migrate(setup, self.dialect)
            finally:
                setup.close()
        except sqlite3.DatabaseError as exc:
            if _sqlite_code(exc) not in _SQLITE_DAMAGED:
                raise
            raise DatabaseDamaged(f"{self.path}: the server's database is unreadable ({exc}); "
                                  f"{_WHAT_TO_DO}") from exc
        self._local = threading.local()
        super().__init__()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=self.busy_timeout)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def _is_unavailable(self, exc: BaseException) -> bool:
        if isinstance(exc, sqlite3.OperationalError):
            code = getattr(exc, "sqlite_errorcode", None)
            if code is not None:
                return code & 0xFF in _SQLITE_UNAVAILABLE
            return any(word in str(exc) for word in ("locked", "busy"))
        return super()._is_unavailable(exc)

    def _probe(self) -> None:
        """Take the write lock and give it back, on a connection of its own that waits a
        moment only (the writer's own short transactions), never the busy timeout."""
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0.25)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()

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


#: SQLite's result codes for a file that is not (or no longer) a sound database: CORRUPT,
#: NOTADB.
_SQLITE_DAMAGED = frozenset({11, 26})
#: What every refusal of a damaged database file ends with: what to do about it.
_WHAT_TO_DO = ("restore it from a backup, or move it (with its -wal and -shm files) aside "
               "and start `margo serve` with --new-database to begin again on purpose (see "
               "'Damaged state: what the server does' in docs/operations.md); an empty "
               "database has no clients (every device is refused until added again) and "
               "starts manifestVersions over, below what devices adopted")


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def check_sqlite_file(path: str | Path, *, used_before: tuple[str, ...] = (),
                      integrity: bool = True) -> None:
    """Refuse (`DatabaseDamaged`) a server database that must not be opened as it is.

    SQLite itself takes a 0-byte file, or no file, for a new empty database, and a
    write-ahead log without its database for nothing: each would start a server with no
    clients, silently. So: a 0-byte file is refused; a missing one is refused when its
    `-wal` is there or when `used_before` names what shows the data directory served before
    (its repositories, its lock file); with `integrity`, `PRAGMA quick_check` must pass (it
    reads every page once: seconds for gigabytes, at start only)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        wal = path.with_name(path.name + "-wal")
        if wal.is_file() and wal.stat().st_size > 0:
            raise DatabaseDamaged(f"{path}: the server's database is missing but its "
                                  f"write-ahead log {wal.name} is there: the file was deleted "
                                  f"or lost; {_WHAT_TO_DO}") from None
        if used_before:
            raise DatabaseDamaged(f"{path}: the server's database is missing, but "
                                  f"{path.parent} was used by a server before (it holds "
                                  f"{', '.join(used_before)}): the file was deleted or lost; "
                                  f"{_WHAT_TO_DO}") from None
        return
    except OSError as exc:
        raise DatabaseDamaged(f"{path}: cannot read the server's database: {exc}") from exc
    if size == 0 and path.is_file():
        raise DatabaseDamaged(f"{path}: the server's database is empty (0 bytes): its content "
                              "was lost (a power cut before the file system wrote it, a "
                              f"failed copy or restore); {_WHAT_TO_DO}")
    if not integrity:
        return
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=_busy_timeout())
    except sqlite3.Error as exc:
        raise DatabaseDamaged(f"{path}: cannot open the server's database: {exc}") from exc
    try:
        check = [tuple(row) for row in conn.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        if _sqlite_code(exc) not in _SQLITE_DAMAGED:
            raise
        raise DatabaseDamaged(f"{path}: the server's database is unreadable ({exc}); "
                              f"{_WHAT_TO_DO}") from exc
    finally:
        conn.close()
    if check != [("ok",)]:
        detail = "; ".join(str(row[0]) for row in check[:3]).replace("\n", " ")
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        raise DatabaseDamaged(f"{path}: the server's database is corrupt ({detail}); "
                              f"{_WHAT_TO_DO}")


def _busy_timeout() -> float:
    value = os.environ.get(_BUSY_TIMEOUT_ENV)
    if not value:
        return _BUSY_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{_BUSY_TIMEOUT_ENV}={value!r}: not a number of seconds") from None
    if seconds < 0:
        raise ValueError(f"{_BUSY_TIMEOUT_ENV}={value!r}: must not be negative")
    return seconds
