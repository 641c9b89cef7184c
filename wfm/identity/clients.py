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
from wfm.store import client_rows
from wfm.store.database import Connection, Database

__all__ = ["Client", "ClientKey", "ClientRegistry", "ClientRetired", "TokenLookup",
           "token_hash"]

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
    """The clients and what proves each, over the store's rows (`wfm.store.client_rows`)."""

    def __init__(self, db: Database):
        self._db = db

    def get(self, client_id: str) -> Client | None:
        return self._client(self._db.read(lambda conn: client_rows.client_row(conn, client_id)))

    def ensure(self, client_id: str) -> Client:
        """The client row for an identity proven by certificate (no token): created on first
        use when the accepted-client policy admits a client nobody registered."""
        existing = self.get(client_id)
        if existing is not None:
            return existing
        now = time.time()
        self._db.write_sync(lambda conn: client_rows.ensure_client(conn, client_id, now))
        return self.get(client_id) or Client(client_id, False)

    def register_identity(self, client_id: str, *, spiffe_id: str, certificate: str,
                          not_after: float, source: str) -> None:
        """Record an operator-registered SVID (`issue` or `import`): the client is accepted
        from now on (un-retired), and `list` shows which identity it holds."""
        now = time.time()

        def write(conn: Connection) -> None:
            if client_rows.is_retired(conn, client_id):
                client_rows.bump_credentials_epoch(conn)
            client_rows.accept_identity(conn, client_id, spiffe_id=spiffe_id,
                                        certificate=certificate, not_after=not_after,
                                        source=source, now=now)

        self._db.write_sync(write)

    def add_key(self, client_id: str, *, key_id: str, public_key: str,
                certificate: str | None) -> str:
        """Bind an rc.2 key to a client (creating the client); return the client id the key
        is bound to, which is the existing one when the key was onboarded before."""
        now = time.time()

        def write(conn: Connection) -> str:
            owner = client_rows.key_owner(conn, key_id)
            if owner is not None:
                return owner
            client_rows.add_key(conn, client_id, key_id=key_id, public_key=public_key,
                                certificate=certificate, now=now)
            return client_id

        return self._db.write_sync(write)

    def by_key_id(self, key_id: str) -> ClientKey | None:
        row = self._db.read(lambda conn: client_rows.key_row(conn, key_id))
        if row is None:
            return None
        return ClientKey(Client(row[0], row[1]), key_id, row[2])

    def describe(self) -> list[dict[str, Any]]:
        """Every client with what proves it, for `margo clients list`."""
        return self._db.read(client_rows.describe_clients)

    def add(self, client_id: str | None = None, *, certificate: str | None = None,
            reactivate: bool = False) -> tuple[str, str]:
        """Register a client; return (client id, token). An existing id gets a new token.
        A retired client is accepted again only with `reactivate` (`ClientRetired`
        otherwise): retiring is how an operator cuts a device off, and registering the id
        again must not silently undo it."""
        client_id = client_id or str(uuid.uuid4())
        token = secrets.token_urlsafe(32)

        def write(conn: Connection) -> None:
            retired = client_rows.is_retired(conn, client_id)
            if retired and not reactivate:
                raise ClientRetired(client_id)
            if retired is not None:  # its old token stops, or it is accepted again
                client_rows.bump_credentials_epoch(conn)
            client_rows.set_token(conn, client_id, token_hash(token), certificate, time.time())

        self._db.write_sync(write)
        return client_id, token

    def retire(self, client_id: str) -> bool:
        def write(conn: Connection) -> int:
            retired = client_rows.retire(conn, client_id)
            client_rows.bump_credentials_epoch(conn)
            return retired

        return bool(self._db.write_sync(write))

    def _client(self, row: tuple[str, bool] | None) -> Client | None:
        return None if row is None else Client(row[0], row[1])

    def by_token(self, token: str) -> Client | None:
        return self.token_lookup(token).client

    def token_lookup(self, token: str) -> TokenLookup:
        """What `token` proves: a client token (until replaced) or an access token (until
        it expires)."""
        digest = token_hash(token)

        def read(conn: Connection) -> TokenLookup:
            row = client_rows.token_client(conn, digest)
            if row is not None:
                return TokenLookup(self._client(row))
            access = client_rows.access_token_client(conn, digest, time.time())
            if access is None:
                return TokenLookup(None)
            return TokenLookup(Client(access[0], access[1]), access[2])

        return self._db.read(read)

    def credentials_epoch(self) -> int:
        return self._db.read(client_rows.credentials_epoch)

    def by_basic(self, client_id: str, token: str) -> Client | None:
        client = self.by_token(token)
        if client is None or not same_secret(client_id, client.client_id):
            return None
        return client

    def exists(self, client_id: str) -> bool:
        return self._db.read(lambda conn: client_rows.client_exists(conn, client_id))

    async def issue_access_token(self, client: Client) -> tuple[str, int]:
        token = secrets.token_urlsafe(32)
        expires = time.time() + ACCESS_TOKEN_SECONDS
        await self._db.write(lambda conn: client_rows.store_access_token(
            conn, token_hash(token), client.client_id, expires, time.time()))
        return token, ACCESS_TOKEN_SECONDS
