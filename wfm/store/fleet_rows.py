"""The fleet's own rows: staged rollouts' state, the fleet source's condition, the
published generation, and the lean reads behind the fleet's gauges.

Fleet control (`wfm.fleet.rollouts`, `.sourcecondition`, `.fleetmetrics`) decides what
these rows mean; the SQL that reads and writes them is here, so the store is the one place
that knows the tables. Functions run inside the database's reader or writer threads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from wfm.store.database import Connection

__all__ = [
    "device_owners",
    "fleet_generation",
    "gauge_devices",
    "gauge_statuses",
    "id_lists",
    "lead_marks_in_flight",
    "load_rollout_text",
    "load_rollout_texts",
    "load_rollouts",
    "replace_rollout",
    "rollout_text",
    "save_source_condition",
    "source_condition",
    "status_verdicts",
    "value_rows",
]


def load_rollouts(conn: Connection) -> dict[str, dict[str, Any]]:
    """Every staged rollout's state, by intent."""
    return {name: json.loads(text) for name, text in load_rollout_texts(conn).items()}


def load_rollout_texts(conn: Connection) -> dict[str, str]:
    """Every staged rollout's state as stored, by intent: what `replace_rollout` expects."""
    return {row[0]: row[1] for row in conn.execute(
        "SELECT intent, state FROM rollouts ORDER BY intent")}


def load_rollout_text(conn: Connection, name: str) -> str | None:
    """One rollout's state as stored (None: intent `name` has none)."""
    row = conn.execute("SELECT state FROM rollouts WHERE intent = ?", (name,)).fetchone()
    return None if row is None else str(row[0])


def rollout_text(state: dict[str, Any]) -> str:
    """A rollout's state as it is stored (keys sorted, so equal states store equal text)."""
    return json.dumps(state, sort_keys=True)


def replace_rollout(conn: Connection, name: str, expected: str | None,
                    state: dict[str, Any]) -> bool:
    """Store `state` for intent `name` only if its row still holds `expected` (None: no row
    yet); whether it did. Rollouts are read, changed and written back by the compiling
    replica and by operators on any replica: a write that checked nothing would lose
    whichever change committed in between (a pause overwritten by an evaluation that read
    the rollout just before it). The comparison is part of the statement, so it holds on
    PostgreSQL too, where a concurrent writer's commit is seen by the row's re-check."""
    text = rollout_text(state)
    if expected is None:
        cursor = conn.execute("INSERT INTO rollouts (intent, state) VALUES (?, ?) "
                              "ON CONFLICT (intent) DO NOTHING", (name, text))
    else:
        cursor = conn.execute("UPDATE rollouts SET state = ? WHERE intent = ? AND state = ?",
                              (text, name, expected))
    return cursor.rowcount == 1


def status_verdicts(conn: Connection) -> dict[str, tuple[str, str | None]]:
    """Every stored status (state, the digest it is about) by deployment id."""
    return {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT deployment_id, state, applied_digest FROM statuses")}


def save_source_condition(conn: Connection, condition: dict[str, Any]) -> None:
    conn.execute("UPDATE fleet_state SET source_condition = ? WHERE id = 1",
                 (json.dumps(condition, sort_keys=True),))


def source_condition(conn: Connection) -> dict[str, Any] | None:
    """The stored condition of the fleet source (None before the first compile)."""
    row = conn.execute("SELECT source_condition FROM fleet_state WHERE id = 1").fetchone()
    if row is None or not row[0]:
        return None
    condition: dict[str, Any] = json.loads(row[0])
    return condition


def fleet_generation(conn: Connection) -> int:
    """The newest fleet generation published (replicas serve up to it)."""
    return int(conn.execute("SELECT generation FROM fleet_state WHERE id = 1").fetchone()[0])


def gauge_devices(conn: Connection) -> list[Any]:
    """(device_id, client_id, shape, reported_at) of every device: no documents."""
    return conn.execute("SELECT device_id, client_id, shape, reported_at FROM "
                        "devices").fetchall()


def gauge_statuses(conn: Connection) -> dict[str, tuple[Any, Any, Any]]:
    """(state, applied digest, reported_at) of every deployment's status: no documents."""
    return {r[0]: (r[1], r[2], r[3]) for r in conn.execute(
        "SELECT deployment_id, state, applied_digest, reported_at FROM statuses")}


def lead_marks_in_flight(conn: Connection) -> int:
    """How many compiled changes still wait for their installed report (lead times)."""
    return int(conn.execute("SELECT COUNT(*) FROM lead_marks").fetchone()[0])


#: Ids per statement of a `WHERE ... IN (...)` (SQLite allows 32,766 parameters).
_IDS_PER_STATEMENT = 500


def id_lists(ids: list[str]) -> Iterator[tuple[list[str], str]]:
    """`ids` in parts small enough for one statement, each with its ``?, ?, ...`` marks."""
    for start in range(0, len(ids), _IDS_PER_STATEMENT):
        chunk = ids[start:start + _IDS_PER_STATEMENT]
        yield chunk, ", ".join("?" * len(chunk))


def value_rows(rows: Sequence[Sequence[Any]], per_statement: int
               ) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """`rows` (all of one width) in parts of at most `per_statement`, each as the
    ``(?, ?), (?, ?)`` of a multi-row ``VALUES`` and its parameters, flat: one statement
    writes a part, where a statement per row cost its own step (and round trip)."""
    if not rows:
        return
    row = "(" + ", ".join("?" * len(rows[0])) + ")"
    for start in range(0, len(rows), per_statement):
        chunk = rows[start:start + per_statement]
        yield ", ".join([row] * len(chunk)), tuple(value for values in chunk for value in values)


def device_owners(conn: Connection, device_ids: list[str]) -> list[str]:
    """The clients owning any of these devices (each once)."""
    owners: set[str] = set()
    for chunk, marks in id_lists(device_ids):
        owners.update(row[0] for row in conn.execute(
            f"SELECT DISTINCT client_id FROM devices WHERE device_id IN ({marks})", chunk))
    return sorted(owners)
