"""Device clients and their credentials (until the mutual-TLS identity work lands).

A client is registered out of band (`margo clients add`) or by rc.2 onboarding, and gets a
random token: requests carry `Authorization: Bearer <token>`, Git uses HTTP basic
(`<clientId>:<token>`), and the Oct-2024 OAuth2 client-credentials endpoint exchanges the
same pair for a short-lived access token. Only hashes are stored.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import sqlite3
import time
import uuid
from dataclasses import dataclass

from wfm.db import Database

__all__ = ["Client", "ClientRegistry", "token_hash"]

ACCESS_TOKEN_SECONDS = 3600


def token_hash(token: str) -> str:
    # Tokens are 256 random bits: a plain hash is enough (no dictionary to attack).
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Client:
    client_id: str
    retired: bool


class ClientRegistry:
    def __init__(self, db: Database):
        self._db = db

    def add(self, client_id: str | None = None, *, certificate: str | None = None,
            ) -> tuple[str, str]:
        """Register a client; return (client id, token). An existing id gets a new token."""
        client_id = client_id or str(uuid.uuid4())
        token = secrets.token_urlsafe(32)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO clients (client_id, token_hash, certificate, created_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (client_id) DO UPDATE SET "
                "token_hash = excluded.token_hash, retired = 0",
                (client_id, token_hash(token), certificate, time.time()))

        self._db.write_sync(write)
        return client_id, token

    def retire(self, client_id: str) -> bool:
        def write(conn: sqlite3.Connection) -> int:
            return conn.execute("UPDATE clients SET retired = 1 WHERE client_id = ?",
                                (client_id,)).rowcount

        return bool(self._db.write_sync(write))

    def _client(self, row: tuple[str, int] | None) -> Client | None:
        return None if row is None else Client(row[0], bool(row[1]))

    def by_token(self, token: str) -> Client | None:
        digest = token_hash(token)

        def read(conn: sqlite3.Connection) -> Client | None:
            row = conn.execute("SELECT client_id, retired FROM clients WHERE token_hash = ?",
                               (digest,)).fetchone()
            if row is not None:
                return self._client(row)
            row = conn.execute(
                "SELECT c.client_id, c.retired FROM access_tokens t JOIN clients c "
                "ON c.client_id = t.client_id WHERE t.token_hash = ? AND t.expires_at > ?",
                (digest, time.time())).fetchone()
            return self._client(row)

        return self._db.read(read)

    def by_basic(self, client_id: str, token: str) -> Client | None:
        client = self.by_token(token)
        if client is None or not hmac.compare_digest(client.client_id, client_id):
            return None
        return client

    def exists(self, client_id: str) -> bool:
        return self._db.read(lambda conn: conn.execute(
            "SELECT 1 FROM clients WHERE client_id = ?", (client_id,)).fetchone()) is not None

    async def issue_access_token(self, client: Client) -> tuple[str, int]:
        token = secrets.token_urlsafe(32)
        expires = time.time() + ACCESS_TOKEN_SECONDS

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM access_tokens WHERE expires_at < ?", (time.time(),))
            conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)",
                         (token_hash(token), client.client_id, expires))

        await self._db.write(write)
        return token, ACCESS_TOKEN_SECONDS


def parse_basic(header: str) -> tuple[str, str] | None:
    """(user, password) of an HTTP basic Authorization header, or None."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None
