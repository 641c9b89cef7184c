"""The operators' rows: name, role, the hash of the current token, and when each was
created, last given a new token and revoked.

`wfm.identity.operatorstore` decides what may change and when servers must forget what
they hold (the credentials epoch, `client_rows.bump_credentials_epoch`); the SQL is here.
Only token hashes are ever stored; a revoked operator's hash is gone.
"""

from __future__ import annotations

from typing import Any

from wfm.store.database import Connection

__all__ = ["describe_operators", "insert_operator", "operator_row", "revoke_operator",
           "set_operator_token", "token_table"]


def operator_row(conn: Connection, name: str) -> tuple[str, str, float | None] | None:
    """(name, role, revoked at) of an operator, or None for a name never registered."""
    row = conn.execute("SELECT name, role, revoked_at FROM operators WHERE name = ?",
                       (name,)).fetchone()
    return None if row is None else (str(row[0]), str(row[1]), row[2])


def insert_operator(conn: Connection, name: str, role: str, digest: str, now: float) -> None:
    conn.execute("INSERT INTO operators (name, role, token_hash, created_at) "
                 "VALUES (?, ?, ?, ?)", (name, role, digest, now))


def set_operator_token(conn: Connection, name: str, digest: str, now: float) -> int:
    """A new token hash for an operator not revoked; how many rows changed (0: none such)."""
    return int(conn.execute("UPDATE operators SET token_hash = ?, rotated_at = ? "
                            "WHERE name = ? AND revoked_at IS NULL",
                            (digest, now, name)).rowcount)


def revoke_operator(conn: Connection, name: str, now: float) -> int:
    """Revoke an operator (its token hash is dropped); how many rows changed (0: unknown
    or revoked before)."""
    return int(conn.execute("UPDATE operators SET token_hash = NULL, revoked_at = ? "
                            "WHERE name = ? AND revoked_at IS NULL", (now, name)).rowcount)


def token_table(conn: Connection) -> tuple[list[tuple[str, str, str]], int]:
    """(token hash, name, role) of every operator that holds a token, and how many
    operators were ever registered (revoked ones too)."""
    rows = conn.execute("SELECT token_hash, name, role FROM operators").fetchall()
    return ([(str(r[0]), str(r[1]), str(r[2])) for r in rows if r[0] is not None],
            len(rows))


def describe_operators(conn: Connection) -> list[dict[str, Any]]:
    """Every operator, for `margo operators list` and the read API (never a token)."""
    rows = conn.execute("SELECT name, role, created_at, rotated_at, revoked_at "
                        "FROM operators ORDER BY name").fetchall()
    return [{"name": r[0], "role": r[1], "createdAt": r[2], "rotatedAt": r[3],
             "revokedAt": r[4], "revoked": r[4] is not None} for r in rows]
