"""The audit trail's rows (`wfm.fleet.audit` decides what an entry says).

Appended to, never updated. The one deletion is `trim`, which drops what is older than the
server's retention. Nothing else here may change a row.
"""

from __future__ import annotations

from typing import Any

from wfm.store.database import Connection

__all__ = ["COLUMNS", "append", "select", "trim"]

#: The columns of an entry, in the order `append` takes and `select` returns them (after
#: the id).
COLUMNS = ("at", "actor", "via", "role", "action", "target", "outcome", "detail", "address",
           "replica")


def append(conn: Connection, values: tuple[Any, ...]) -> None:
    """One entry, its values in `COLUMNS` order."""
    conn.execute(f"INSERT INTO audit_log ({', '.join(COLUMNS)}) "
                 f"VALUES ({', '.join('?' * len(COLUMNS))})", values)


def select(conn: Connection, *, since: float | None = None, actor: str | None = None,
           limit: int | None = None) -> list[tuple[Any, ...]]:
    """(id, *COLUMNS) of the entries at or after `since` by `actor`, oldest first; with
    `limit`, the newest `limit` of them (still oldest first)."""
    where: list[str] = []
    params: list[Any] = []
    if since is not None:
        where.append("at >= ?")
        params.append(since)
    if actor is not None:
        where.append("actor = ?")
        params.append(actor)
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    sql = f"SELECT id, {', '.join(COLUMNS)} FROM audit_log{clause} ORDER BY id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    rows = [tuple(r) for r in conn.execute(sql, tuple(params)).fetchall()]
    rows.reverse()
    return rows


def trim(conn: Connection, before: float) -> int:
    """Delete the entries older than `before` (the retention); how many."""
    return int(conn.execute("DELETE FROM audit_log WHERE at < ?", (before,)).rowcount)
