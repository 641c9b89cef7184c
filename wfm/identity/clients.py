"""Device clients and their credentials.

A client is one row, whatever proves it: an rc.3 X.509-SVID naming its client id (registered
with `margo clients issue|import`, or accepted on first use when the operator trusts the whole
SPIFFE namespace), an rc.2 onboarded key (requests signed with RFC 9421; the key is found by its
key id, the hex SHA-256 of the SPKI), or, in development, a random token: `Authorization:
Bearer <token>`, Git HTTP basic (`<clientId>:<token>`), and the Oct-2024 OAuth2
client-credentials exchange. Only token hashes are stored; certificates and public keys are
public material and are kept as PEM so `margo clients list` can show what each client holds.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from wfm.identity.credentials import same_secret
from wfm.store.database import Connection, Database

__all__ = ["Client", "ClientKey", "ClientRegistry", "ClientRetired", "TokenLookup",
           "bump_credentials_epoch", "read_credentials_epoch", "token_hash"]

ACCESS_TOKEN_SECONDS = 3600

def token_hash(token: str) -> str:
    # Tokens are 256 random bits: a plain hash is enough (no dictionary to attack).
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Client:
    client_id: str
    retired: bool


@dataclass(frozen=True, slots=True)
class TokenLookup:
    """What a token proves: its client (None: nothing), and until when (wall-clock seconds,
    for an access token; None for a client token, which lasts until replaced)."""

    client: Client | None
    expires_at: float | None = None


def bump_credentials_epoch(conn: Connection) -> None:
    """In the transaction of every write that can change what a token proves (a client
    retired or accepted again, its token replaced): servers forget the lookups they
    remember when it moves (`wfm.identity.credentialcache`)."""
    conn.execute("UPDATE fleet_state SET credentials_epoch = credentials_epoch + 1 "
                 "WHERE id = 1")


def _was_retired(conn: Connection, client_id: str) -> bool:
    row = conn.execute("SELECT retired FROM clients WHERE client_id = ?",
                       (client_id,)).fetchone()
    return row is not None and bool(row[0])


def read_credentials_epoch(conn: Connection) -> int:
    row = conn.execute("SELECT credentials_epoch FROM fleet_state WHERE id = 1").fetchone()
    return int(row[0]) if row is not None else 0


@dataclass(frozen=True, slots=True)
class ClientKey:
    """An rc.2 onboarded public key (PEM) and the client it signs for."""

    client: Client
    key_id: str
    public_key: str


class ClientRetired(Exception):
    """`ClientRegistry.add` of a retired client without `reactivate`."""

    def __init__(self, client_id: str) -> None:
        super().__init__(f"client {client_id!r} is retired; accepting it again gives it a new "
                         "token and undoes the retirement (margo clients add --reactivate)")
        self.client_id = client_id


class ClientRegistry:
    def __init__(self, db: Database):
        self._db = db

    def get(self, client_id: str) -> Client | None:
        return self._client(self._db.read(lambda conn: conn.execute(
            "SELECT client_id, retired FROM clients WHERE client_id = ?",
            (client_id,)).fetchone()))

    def ensure(self, client_id: str) -> Client:
        """The client row for an identity proven by certificate (no token): created on first
        use when the accepted-client policy admits a client nobody registered."""
        existing = self.get(client_id)
        if existing is not None:
            return existing
        self._db.write_sync(lambda conn: conn.execute(
            "INSERT INTO clients (client_id, created_at) VALUES (?, ?) "
            "ON CONFLICT (client_id) DO NOTHING", (client_id, time.time())))
        return self.get(client_id) or Client(client_id, False)

    def register_identity(self, client_id: str, *, spiffe_id: str, certificate: str,
                          not_after: float, source: str) -> None:
        """Record an operator-registered SVID (`issue` or `import`): the client is accepted
        from now on (un-retired), and `list` shows which identity it holds."""
        now = time.time()

        def write(conn: Connection) -> None:
            if _was_retired(conn, client_id):
                bump_credentials_epoch(conn)
            conn.execute("INSERT INTO clients (client_id, created_at) VALUES (?, ?) "
                         "ON CONFLICT (client_id) DO UPDATE SET retired = 0", (client_id, now))
            conn.execute(
                "INSERT INTO client_identities VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT "
                "(client_id) DO UPDATE SET spiffe_id = excluded.spiffe_id, certificate = "
                "excluded.certificate, not_after = excluded.not_after, source = excluded.source",
                (client_id, spiffe_id, certificate, not_after, source, now))

        self._db.write_sync(write)

    def add_key(self, client_id: str, *, key_id: str, public_key: str,
                certificate: str | None) -> str:
        """Bind an rc.2 key to a client (creating the client); return the client id the key
        is bound to, which is the existing one when the key was onboarded before."""
        now = time.time()

        def write(conn: Connection) -> str:
            row = conn.execute("SELECT client_id FROM client_keys WHERE key_id = ?",
                               (key_id,)).fetchone()
            if row is not None:
                return str(row[0])
            conn.execute("INSERT INTO clients (client_id, certificate, created_at) "
                         "VALUES (?, ?, ?) ON CONFLICT (client_id) DO NOTHING",
                         (client_id, certificate, now))
            conn.execute("INSERT INTO client_keys VALUES (?, ?, ?, ?, ?)",
                         (key_id, client_id, public_key, certificate, now))
            return client_id

        return self._db.write_sync(write)

    def by_key_id(self, key_id: str) -> ClientKey | None:
        row = self._db.read(lambda conn: conn.execute(
            "SELECT c.client_id, c.retired, k.public_key FROM client_keys k JOIN clients c "
            "ON c.client_id = k.client_id WHERE k.key_id = ?", (key_id,)).fetchone())
        if row is None:
            return None
        return ClientKey(Client(row[0], bool(row[1])), key_id, row[2])

    def describe(self) -> list[dict[str, Any]]:
        """Every client with what proves it, for `margo clients list`."""
        def read(conn: Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT c.client_id, c.retired, c.created_at, c.token_hash IS NOT NULL, "
                "i.spiffe_id, i.not_after, i.source, "
                "(SELECT COUNT(*) FROM client_keys k WHERE k.client_id = c.client_id) "
                "FROM clients c LEFT JOIN client_identities i ON i.client_id = c.client_id "
                "ORDER BY c.client_id").fetchall()
            return [{"clientId": r[0], "retired": bool(r[1]), "createdAt": r[2],
                     "token": bool(r[3]), "spiffeId": r[4], "svidNotAfter": r[5],
                     "svidSource": r[6], "signingKeys": int(r[7])} for r in rows]

        return self._db.read(read)

    def add(self, client_id: str | None = None, *, certificate: str | None = None,
            reactivate: bool = False) -> tuple[str, str]:
        """Register a client; return (client id, token). An existing id gets a new token.
        A retired client is accepted again only with `reactivate` (`ClientRetired`
        otherwise): retiring is how an operator cuts a device off, and registering the id
        again must not silently undo it."""
        client_id = client_id or str(uuid.uuid4())
        token = secrets.token_urlsafe(32)

        def write(conn: Connection) -> None:
            row = conn.execute("SELECT retired FROM clients WHERE client_id = ?",
                               (client_id,)).fetchone()
            if row is not None and row[0] and not reactivate:
                raise ClientRetired(client_id)
            if row is not None:
                bump_credentials_epoch(conn)  # its old token stops, or it is accepted again
            conn.execute(
                "INSERT INTO clients (client_id, token_hash, certificate, created_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (client_id) DO UPDATE SET "
                "token_hash = excluded.token_hash, retired = 0",
                (client_id, token_hash(token), certificate, time.time()))

        self._db.write_sync(write)
        return client_id, token

    def retire(self, client_id: str) -> bool:
        def write(conn: Connection) -> int:
            retired = conn.execute("UPDATE clients SET retired = 1 WHERE client_id = ?",
                                   (client_id,)).rowcount
            bump_credentials_epoch(conn)
            return retired

        return bool(self._db.write_sync(write))

    def _client(self, row: tuple[str, int] | None) -> Client | None:
        return None if row is None else Client(row[0], bool(row[1]))

    def by_token(self, token: str) -> Client | None:
        return self.token_lookup(token).client

    def token_lookup(self, token: str) -> TokenLookup:
        """What `token` proves: a client token (until replaced) or an access token (until
        it expires)."""
        digest = token_hash(token)

        def read(conn: Connection) -> TokenLookup:
            row = conn.execute("SELECT client_id, retired FROM clients WHERE token_hash = ?",
                               (digest,)).fetchone()
            if row is not None:
                return TokenLookup(self._client(row))
            row = conn.execute(
                "SELECT c.client_id, c.retired, t.expires_at FROM access_tokens t JOIN "
                "clients c ON c.client_id = t.client_id WHERE t.token_hash = ? AND "
                "t.expires_at > ?", (digest, time.time())).fetchone()
            if row is None:
                return TokenLookup(None)
            return TokenLookup(Client(row[0], bool(row[1])), float(row[2]))

        return self._db.read(read)

    def credentials_epoch(self) -> int:
        return self._db.read(read_credentials_epoch)

    def by_basic(self, client_id: str, token: str) -> Client | None:
        client = self.by_token(token)
        if client is None or not same_secret(client_id, client.client_id):
            return None
        return client

    def exists(self, client_id: str) -> bool:
        return self._db.read(lambda conn: conn.execute(
            "SELECT 1 FROM clients WHERE client_id = ?", (client_id,)).fetchone()) is not None

    async def issue_access_token(self, client: Client) -> tuple[str, int]:
        token = secrets.token_urlsafe(32)
        expires = time.time() + ACCESS_TOKEN_SECONDS

        def write(conn: Connection) -> None:
            conn.execute("DELETE FROM access_tokens WHERE expires_at < ?", (time.time(),))
            conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)",
                         (token_hash(token), client.client_id, expires))

        await self._db.write(write)
        return token, ACCESS_TOKEN_SECONDS
