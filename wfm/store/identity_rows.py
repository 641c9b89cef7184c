"""The rows of identity that live in the store: the CA replicas share for rc.2 onboarding,
and the other secrets replicas must share (the dashboard's session secret).

`wfm.identity.authority` makes the CA and decides when; the SQL is here. (The client
registry's rows are still read and written by `wfm.identity.clients`.)
"""

from __future__ import annotations

from wfm.store.database import Connection

__all__ = ["ca_certificate", "offer_ca", "offer_secret", "shared_secret"]


def offer_ca(conn: Connection, name: str, certificate: str, key: str) -> None:
    """Store a CA under `name` unless one is there already (the first replica's wins)."""
    conn.execute("INSERT INTO authority (name, certificate, key) VALUES (?, ?, ?) "
                 "ON CONFLICT (name) DO NOTHING", (name, certificate, key))


def ca_certificate(conn: Connection, name: str) -> str | None:
    """The stored CA certificate (PEM) under `name`, if any."""
    row = conn.execute("SELECT certificate FROM authority WHERE name = ?",
                       (name,)).fetchone()
    return None if row is None else str(row[0])


#: What a shared secret's row holds where a CA row holds its certificate.
_NOT_A_CERTIFICATE = "(a shared secret: see the key column)"


def offer_secret(conn: Connection, name: str, secret: str) -> None:
    """Store a secret replicas share under `name` unless one is there already (the first
    replica's wins, as with the CA). It lives in the `authority` table's `key` column."""
    offer_ca(conn, name, _NOT_A_CERTIFICATE, secret)


def shared_secret(conn: Connection, name: str) -> str | None:
    """The shared secret stored under `name`, if any."""
    row = conn.execute("SELECT key FROM authority WHERE name = ?", (name,)).fetchone()
    return None if row is None else str(row[0])
