"""The rows of identity that live in the store: the CA replicas share for rc.2 onboarding.

`wfm.identity.authority` makes the CA and decides when; the SQL is here. (The client
registry's rows are still read and written by `wfm.identity.clients`.)
"""

from __future__ import annotations

from wfm.store.database import Connection

__all__ = ["ca_certificate", "offer_ca"]


def offer_ca(conn: Connection, name: str, certificate: str, key: str) -> None:
    """Store a CA under `name` unless one is there already (the first replica's wins)."""
    conn.execute("INSERT INTO authority (name, certificate, key) VALUES (?, ?, ?) "
                 "ON CONFLICT (name) DO NOTHING", (name, certificate, key))


def ca_certificate(conn: Connection, name: str) -> str | None:
    """The stored CA certificate (PEM) under `name`, if any."""
    row = conn.execute("SELECT certificate FROM authority WHERE name = ?",
                       (name,)).fetchone()
    return None if row is None else str(row[0])
