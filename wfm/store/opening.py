"""Opening the fleet server's store: the engine a target names.

Neither engine knows the other: both implement `wfm.store.database.Database`, and only this
module chooses between them (so PostgreSQL's driver loads only where it is used).
"""

from __future__ import annotations

from pathlib import Path

from wfm.store.database import Database
from wfm.store.sqlitedb import SqliteDatabase

__all__ = ["is_url", "open_database"]


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def open_database(target: str | Path) -> Database:
    """A PostgreSQL database for a `postgresql://` URL, else the SQLite file at `target`."""
    if is_url(target):
        from wfm.store.pgdb import PostgresDatabase  # psycopg only where PostgreSQL is used

        return PostgresDatabase(str(target))
    return SqliteDatabase(target)
