"""A server database as an older version of the server left it: the migration tests build
one at a given schema version, add the rows that version would hold, and let the current
server migrate it."""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg

from wfm.store.schema import MIGRATIONS


def database_at(dialect: str, target: str, version: int) -> tuple[Any, str]:
    """A connection to `target` (an SQLite path or a PostgreSQL URL) whose schema is what
    migrations 1..`version` made, and the dialect's parameter mark; the caller adds rows
    and closes it."""
    if dialect == "sqlite":
        conn: Any = sqlite3.connect(target, isolation_level=None)
        mark = "?"
    else:
        conn = psycopg.connect(target, autocommit=True)
        mark = "%s"
    real = "REAL" if dialect == "sqlite" else "DOUBLE PRECISION"
    conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
                 f"description TEXT NOT NULL, applied_at {real} NOT NULL)")
    for migration in MIGRATIONS:
        if migration.version > version:
            continue
        for statement in migration.statements(dialect):
            conn.execute(statement)
        conn.execute(f"INSERT INTO schema_migrations VALUES ({mark}, {mark}, {mark})",
                     (migration.version, migration.description, 0.0))
    return conn, mark
