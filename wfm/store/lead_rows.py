"""The rows lead times are measured with: the changes received and not compiled yet
(`change_origins`), the marks a compile leaves for each deployment it changed
(`lead_marks`), and when a manifest version was first served.

`wfm.fleet.leadtime` decides what they mean; the SQL is here. Functions run inside the
database's reader or writer threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from wfm.store.database import Connection
from wfm.store.fleet_rows import value_rows

__all__ = ["consume_marks", "manifest_served_at", "marks_of", "pending_origins",
           "record_origin", "store_marks"]

#: Marks written per statement (each row is 7 parameters).
_CHUNK = 400
#: Marks taken per statement (each is 3 parameters).
_CONSUMED = 300
_MARK_COLUMNS = ("deployment_id", "device_id", "commit_id", "received_at", "compiled_at",
                 "trigger", "trace")
_UPSERT = (" ON CONFLICT (deployment_id) DO UPDATE SET device_id = excluded.device_id, "
           "commit_id = excluded.commit_id, received_at = excluded.received_at, "
           "compiled_at = excluded.compiled_at, trigger = excluded.trigger, "
           "trace = excluded.trace")


def record_origin(conn: Connection, trigger: str, received_at: float, trace: Any) -> None:
    conn.execute("INSERT INTO change_origins (trigger, received_at, trace) VALUES (?, ?, ?)",
                 (trigger, received_at, trace))


def pending_origins(conn: Connection) -> list[tuple[int, str, float, Any]]:
    """(id, trigger, received_at, trace) of the oldest changes not compiled yet (at most
    1,000: what one compile takes up)."""
    rows = conn.execute("SELECT id, trigger, received_at, trace FROM change_origins "
                        "ORDER BY id LIMIT 1000").fetchall()
    return [(int(r[0]), r[1], float(r[2]), r[3]) for r in rows]


def store_marks(conn: Connection, rows: Sequence[tuple[Any, ...]], last_origin: int) -> None:
    """Upsert the marks (deployment_id, device_id, commit_id, received_at, compiled_at,
    trigger, trace) and drop the origins a compile took up (ids up to `last_origin`)."""
    copy_rows = getattr(conn, "copy_rows", None)
    if copy_rows is not None and len(rows) > _CHUNK:
        _copy_marks(conn, copy_rows, rows)
    else:
        for values, parameters in value_rows(rows, _CHUNK):
            conn.execute("INSERT INTO lead_marks (" + ", ".join(_MARK_COLUMNS) + ") VALUES "
                         + values + _UPSERT, parameters)
    if last_origin:
        conn.execute("DELETE FROM change_origins WHERE id <= ?", (last_origin,))


def _copy_marks(conn: Connection, copy_rows: Any, rows: Sequence[tuple[Any, ...]]) -> None:
    """PostgreSQL: the marks through `COPY` into a session's scratch table, then one upsert
    from it. Replicas write a compile's marks before publishing it (a report may reach any
    replica): 54,000 marks took 1.8-3 s as statements of 400 rows, 0.6-1.3 s this way."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS lead_marks_in (LIKE lead_marks) "
                 "ON COMMIT DELETE ROWS")
    conn.execute("DELETE FROM lead_marks_in")  # (a write earlier in the same transaction)
    copy_rows("lead_marks_in", _MARK_COLUMNS, rows)
    conn.execute("INSERT INTO lead_marks (" + ", ".join(_MARK_COLUMNS) + ") SELECT "
                 + ", ".join(_MARK_COLUMNS) + " FROM lead_marks_in" + _UPSERT)


def marks_of(conn: Connection, deployment_ids: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    """By deployment id: (device_id, commit_id, received_at, compiled_at, trigger, trace)."""
    return {row[0]: tuple(row[1:]) for row in conn.execute(
        "SELECT deployment_id, device_id, commit_id, received_at, compiled_at, trigger, "
        "trace FROM lead_marks WHERE deployment_id IN ("
        + ", ".join("?" for _ in deployment_ids) + ")", tuple(deployment_ids))}


def consume_marks(conn: Connection, marks: Iterable[tuple[str, str]]) -> list[bool]:
    """Delete each (deployment_id, commit_id) mark; whether this call took it (another
    replica may have taken the same mark: it is counted once). A statement per
    `_CONSUMED` marks (a statement per mark was a tenth of the store writer's time while
    10,000 devices took a change up)."""
    wanted = list(marks)
    taken: set[tuple[str, str]] = set()
    for start in range(0, len(wanted), _CONSUMED):
        chunk = wanted[start:start + _CONSUMED]
        # (fetchall: SQLite finishes a RETURNING statement only once its rows are all read)
        taken.update((str(d), str(c)) for d, c in conn.execute(
            "DELETE FROM lead_marks WHERE deployment_id IN ("
            + ", ".join("?" for _ in chunk) + ") AND (deployment_id, commit_id) IN ("
            + ", ".join("(?, ?)" for _ in chunk) + ") RETURNING deployment_id, commit_id",
            (*(d for d, _ in chunk), *(v for mark in chunk for v in mark))).fetchall())
    return [_take(taken, mark) for mark in wanted]


def _take(taken: set[tuple[str, str]], mark: tuple[str, str]) -> bool:
    """Whether `mark` was taken, once (the same mark twice: the second was not)."""
    if mark in taken:
        taken.discard(mark)
        return True
    return False


def manifest_served_at(conn: Connection, client_id: str, version: int) -> float | None:
    """When the client's manifest version was first served (Unix time)."""
    row = conn.execute("SELECT created_at FROM manifest_history WHERE client_id = ? AND "
                       "version = ?", (client_id, version)).fetchone()
    return None if row is None else float(row[0])
