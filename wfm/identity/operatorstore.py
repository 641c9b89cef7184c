"""Operators registered in the store (`margo operators add|list|revoke|rotate`): a name, a
role and the SHA-256 of a random token (`wfm.identity.clients.token_hash`, as device
tokens), shown once when made and never stored.

`OperatorRegistry` changes them, from a server or a `margo` command beside it (any replica's
store); each change moves the credentials epoch in its own transaction
(`wfm.store.client_rows.bump_credentials_epoch`, the one `wfm.identity.credentialcache`
follows). `StoreOperators` is the server's lookup for `OperatorAuth`: it holds the whole
(small) table in memory, token hash to operator, and reads it again when the epoch moved,
checked at most every `check_seconds` (one small query however many people call): a revoked
operator or a replaced token is refused within that, on every replica, without a restart.
An unknown token costs a hash and a dictionary lookup, never a query. While the store cannot
be read, a server goes on with the operators it read last (it still answers `/metrics` and
the read API's callers then; a change made meanwhile cannot have reached its store either).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

from wfm.identity.clients import token_hash
from wfm.identity.credentialcache import EPOCH_CHECK_SECONDS
from wfm.identity.operators import Operator, Role
from wfm.store import client_rows, operator_rows
from wfm.store.database import Connection, Database, DatabaseUnavailable

__all__ = ["OperatorError", "OperatorRegistry", "StoreOperators", "check_name"]

#: What an operator's name may be: it is shown in the audit trail and on the dashboard.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")
NAME_LENGTH = 64
#: The names the server gives callers that are no registered operator.
RESERVED = frozenset({"admin-token", "anonymous"})


class OperatorError(Exception):
    """A change the registry refuses (a name taken, unknown or revoked); says why."""


def check_name(name: str) -> str:
    """`name`, when it can be an operator's; OperatorError saying why not."""
    if not name or len(name) > NAME_LENGTH or not set(name) <= NAME_CHARS or \
            name[0] in ".-" or ":" in name:
        raise OperatorError(
            f"operator name {name!r}: 1 to {NAME_LENGTH} letters, digits, '.', '_', '@' or "
            "'-', not starting with '.' or '-' (names with ':' are the server's own: "
            "oidc:..., local:...)")
    if name in RESERVED:
        raise OperatorError(f"operator name {name!r} is the server's own (the audit trail "
                            "names the admin token and callers of an open server so)")
    return name


class OperatorRegistry:
    """The operators of a store (`wfm.store.operator_rows`)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, name: str, role: Role) -> str:
        """Register `name` with `role`; its token (shown once). A name is never reused,
        revoked or not: the audit trail's entries keep meaning one holder."""
        check_name(name)
        token = secrets.token_urlsafe(32)

        def write(conn: Connection) -> None:
            existing = operator_rows.operator_row(conn, name)
            if existing is not None:
                state = "revoked" if existing[2] is not None else f"role {existing[1]}"
                raise OperatorError(
                    f"operator {name!r} exists ({state}); names are not reused, so the "
                    "audit trail's entries keep meaning one holder: choose another name"
                    + ("" if existing[2] is not None else
                       ", or 'margo operators rotate' for a new token"))
            operator_rows.insert_operator(conn, name, role.label, token_hash(token),
                                          time.time())
            client_rows.bump_credentials_epoch(conn)  # an open server closes now

        self._db.write_sync(write)
        return token

    def rotate(self, name: str) -> str:
        """A new token for `name`; the old one stops working (within a second)."""
        token = secrets.token_urlsafe(32)

        def write(conn: Connection) -> None:
            if not operator_rows.set_operator_token(conn, name, token_hash(token),
                                                    time.time()):
                raise OperatorError(self._unknown(conn, name))
            client_rows.bump_credentials_epoch(conn)

        self._db.write_sync(write)
        return token

    def revoke(self, name: str) -> None:
        def write(conn: Connection) -> None:
            if not operator_rows.revoke_operator(conn, name, time.time()):
                raise OperatorError(self._unknown(conn, name))
            client_rows.bump_credentials_epoch(conn)

        self._db.write_sync(write)

    def describe(self) -> list[dict[str, Any]]:
        """Every operator (revoked ones too), never a token."""
        return self._db.read(operator_rows.describe_operators)

    @staticmethod
    def _unknown(conn: Connection, name: str) -> str:
        existing = operator_rows.operator_row(conn, name)
        return (f"no operator {name!r}" if existing is None
                else f"operator {name!r} is revoked")


class StoreOperators:
    """The store's operators as a token lookup (`OperatorAuth(lookups=...)`); the store is
    set when the server starts (`open`). Synchronous, for `OperatorAuth.require`: on
    PostgreSQL the epoch check is one small query a second at most while operators call,
    and a table read after each change."""

    def __init__(self, db: Database | None = None, *,
                 check_seconds: float = EPOCH_CHECK_SECONDS) -> None:
        self._db = db
        self.check_seconds = check_seconds
        self._lock = threading.Lock()
        self._tokens: dict[str, Operator] = {}
        self._registered = 0
        self._epoch: int | None = None
        self._checked = -1e18

    def open(self, db: Database) -> None:
        """Read the operators of `db` now (the server starts with them: never open by
        mistake because the store was away at its first request)."""
        self._db = db
        self._refresh()

    def __call__(self, token: str) -> Operator | None:
        self._refresh()
        return self._tokens.get(token_hash(token))

    def registered(self) -> bool:
        """Whether any operator was ever registered (then the server is not open)."""
        self._refresh()
        return self._registered > 0

    def _refresh(self) -> None:
        db = self._db
        if db is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.check_seconds:
                return
            self._checked = now
            try:
                epoch = db.read(client_rows.credentials_epoch)
                if epoch == self._epoch:
                    return
                # The epoch first, then the table: a change committed in between moves the
                # epoch past what is remembered, and the next check reads the table again.
                rows, registered = db.read(operator_rows.token_table)
            except DatabaseUnavailable:
                if self._epoch is None:
                    raise  # nothing read yet: refuse (503) rather than guess
                return  # what was read last holds until the store answers again
            self._tokens = {digest: Operator(name, Role.parse(role), "token")
                            for digest, name, role in rows}
            self._registered, self._epoch = registered, epoch
