"""PostgreSQL for the tests: one private server per session (tools/postgres.py), started on
first use, and a new empty database per test (or per server data directory) that asks."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
from pathlib import Path

from tools.postgres import PostgresServer, running_postgres

__all__ = ["database_for", "fresh_database", "shared_postgres"]

_names = itertools.count()
_lock = threading.Lock()
_server: list[PostgresServer] = []
_exit = contextlib.ExitStack()
_databases: dict[Path, str] = {}


def shared_postgres() -> PostgresServer:
    """The session's server (started now if it is not yet; stopped when the tests end)."""
    with _lock:
        if not _server:
            _server.append(_exit.enter_context(running_postgres()))
            atexit.register(_exit.close)
        return _server[0]


def fresh_database(server: PostgresServer | None = None, prefix: str = "wfm") -> str:
    """The URL of a new, empty database."""
    server = server or shared_postgres()
    return server.create_database(f"{prefix}_{next(_names)}")


def database_for(data: Path) -> str:
    """The database of a server data directory (made on first use): what `margo clients`
    and `margo serve --database` of one test share."""
    key = Path(data).resolve()
    with _lock:
        found = _databases.get(key)
    if found is None:
        found = fresh_database()
        with _lock:
            _databases[key] = found
    return found
