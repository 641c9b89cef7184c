"""The client registry's rows: clients, their SVIDs, rc.2 keys, token hashes and access
tokens, and the credentials epoch that tells servers to forget remembered lookups.

`wfm.identity.clients` decides what a row proves (retired or not, which token, when to
move the epoch); the SQL is here. Functions run inside the database's reader or writer
threads; only token hashes are ever stored.
"""

from __future__ import annotations

from typing import Any

from wfm.store.database import Connection

__all__ = [
    "accept_identity",
    "access_token_client",
    "add_key",
    "bump_credentials_epoch",
    "client_exists",
    "client_row",
    "credentials_epoch",
    "describe_clients",
    "ensure_client",
    "is_retired",
    "key_owner",
    "key_row",
    "retire",
    "set_token",
    "store_access_token",
    "token_client",
]


def bump_credentials_epoch(conn: Connection) -> None:
    """In the transaction of every write that can change what a token proves (a client
    retired or accepted again, its token replaced): servers forget the lookups they
    remember when it moves (`wfm.identity.credentialcache`)."""
    conn.execute("UPDATE fleet_state SET credentials_epoch = credentials_epoch + 1 "
                 "WHERE id = 1")


def credentials_epoch(conn: Connection) -> int:
    row = conn.execute("SELECT credentials_epoch FROM fleet_state WHERE id = 1").fetchone()
    return int(row[0]) if row is not None else 0


def client_row(conn: Connection, client_id: str) -> tuple[str, bool] | None:
    """(client id, retired), or None for an unknown client."""
    row = conn.execute("SELECT client_id, retired FROM clients WHERE client_id = ?",
                       (client_id,)).fetchone()
    return None if row is None else (str(row[0]), bool(row[1]))


def is_retired(conn: Connection, client_id: str) -> bool | None:
    """Whether the client is retired; None for an unknown client."""
    row = conn.execute("SELECT retired FROM clients WHERE client_id = ?",
                       (client_id,)).fetchone()
    return None if row is None else bool(row[0])


def client_exists(conn: Connection, client_id: str) -> bool:
    return conn.execute("SELECT 1 FROM clients WHERE client_id = ?",
                        (client_id,)).fetchone() is not None


def ensure_client(conn: Connection, client_id: str, created_at: float) -> None:
    conn.execute("INSERT INTO clients (client_id, created_at) VALUES (?, ?) "
                 "ON CONFLICT (client_id) DO NOTHING", (client_id, created_at))


def accept_identity(conn: Connection, client_id: str, *, spiffe_id: str, certificate: str,
                    not_after: float, source: str, now: float) -> None:
    """The client (created or un-retired) and the SVID it holds."""
    conn.execute("INSERT INTO clients (client_id, created_at) VALUES (?, ?) "
                 "ON CONFLICT (client_id) DO UPDATE SET retired = 0", (client_id, now))
    conn.execute(
        "INSERT INTO client_identities VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT "
        "(client_id) DO UPDATE SET spiffe_id = excluded.spiffe_id, certificate = "
        "excluded.certificate, not_after = excluded.not_after, source = excluded.source",
        (client_id, spiffe_id, certificate, not_after, source, now))


def key_owner(conn: Connection, key_id: str) -> str | None:
    row = conn.execute("SELECT client_id FROM client_keys WHERE key_id = ?",
                       (key_id,)).fetchone()
    return None if row is None else str(row[0])


def add_key(conn: Connection, client_id: str, *, key_id: str, public_key: str,
            certificate: str | None, now: float) -> None:
    """The client (created unless there) and its rc.2 key."""
    conn.execute("INSERT INTO clients (client_id, certificate, created_at) "
                 "VALUES (?, ?, ?) ON CONFLICT (client_id) DO NOTHING",
                 (client_id, certificate, now))
    conn.execute("INSERT INTO client_keys VALUES (?, ?, ?, ?, ?)",
                 (key_id, client_id, public_key, certificate, now))


def key_row(conn: Connection, key_id: str) -> tuple[str, bool, str] | None:
    """(client id, retired, public key PEM) of an onboarded key."""
    row = conn.execute(
        "SELECT c.client_id, c.retired, k.public_key FROM client_keys k JOIN clients c "
        "ON c.client_id = k.client_id WHERE k.key_id = ?", (key_id,)).fetchone()
    return None if row is None else (str(row[0]), bool(row[1]), str(row[2]))


def describe_clients(conn: Connection) -> list[dict[str, Any]]:
    """Every client with what proves it, for `margo clients list`."""
    rows = conn.execute(
        "SELECT c.client_id, c.retired, c.created_at, c.token_hash IS NOT NULL, "
        "i.spiffe_id, i.not_after, i.source, "
        "(SELECT COUNT(*) FROM client_keys k WHERE k.client_id = c.client_id) "
        "FROM clients c LEFT JOIN client_identities i ON i.client_id = c.client_id "
        "ORDER BY c.client_id").fetchall()
    return [{"clientId": r[0], "retired": bool(r[1]), "createdAt": r[2],
             "token": bool(r[3]), "spiffeId": r[4], "svidNotAfter": r[5],
             "svidSource": r[6], "signingKeys": int(r[7])} for r in rows]


def set_token(conn: Connection, client_id: str, digest: str, certificate: str | None,
              now: float) -> None:
    """The client (created, or un-retired) with the hash of its new token."""
    conn.execute(
        "INSERT INTO clients (client_id, token_hash, certificate, created_at) "
        "VALUES (?, ?, ?, ?) ON CONFLICT (client_id) DO UPDATE SET "
        "token_hash = excluded.token_hash, retired = 0",
        (client_id, digest, certificate, now))


def retire(conn: Connection, client_id: str) -> int:
    """Mark the client retired; how many rows that changed (0: unknown)."""
    return int(conn.execute("UPDATE clients SET retired = 1 WHERE client_id = ?",
                            (client_id,)).rowcount)


def token_client(conn: Connection, digest: str) -> tuple[str, bool] | None:
    """(client id, retired) of the client whose token hashes to `digest`."""
    row = conn.execute("SELECT client_id, retired FROM clients WHERE token_hash = ?",
                       (digest,)).fetchone()
    return None if row is None else (str(row[0]), bool(row[1]))


def access_token_client(conn: Connection, digest: str,
                        now: float) -> tuple[str, bool, float] | None:
    """(client id, retired, expires at) of an access token still valid at `now`."""
    row = conn.execute(
        "SELECT c.client_id, c.retired, t.expires_at FROM access_tokens t JOIN "
        "clients c ON c.client_id = t.client_id WHERE t.token_hash = ? AND "
        "t.expires_at > ?", (digest, now)).fetchone()
    return None if row is None else (str(row[0]), bool(row[1]), float(row[2]))


def store_access_token(conn: Connection, digest: str, client_id: str, expires: float,
                       now: float) -> None:
    """Drop the expired access tokens and store a new one's hash."""
    conn.execute("DELETE FROM access_tokens WHERE expires_at < ?", (now,))
    conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)", (digest, client_id, expires))
