"""The audit trail: who changed what through the operator surface, when, from where, and
how it ended.

Every door that changes something appends one entry (`record` on the server, awaited
before the answer goes out; `record_sync` for `margo` commands run beside the server):
rollout pause, resume and abort (refusals of a known caller below the role too), pushes to
the hosted source, operators added, revoked or given a new token, device clients added,
issued, imported or retired, the trust bundle rotated. An entry names its actor
(`Operator.name`: a registered operator, `oidc:<subject>`, `admin-token`, `anonymous` on an
open server, `local:<OS user>` for a command run on the server's machine), the credential
that proved it (`via`), the role it held, the action, its target, the outcome (`ok`,
`refused` or `failed`, with a detail), the caller's address and the replica that served it.
Never a secret: tokens, passwords and keys are not among what an entry can hold, and a
detail is the server's own words, cut at `DETAIL_CHARS`.

Append-only: there is no update and no delete, but for the retention (`Auditor`, `trim`):
the server deletes entries older than `--audit-retention-days` (default
`RETENTION_DAYS`) when it starts and with each entry it appends. Unauthenticated refusals
(401) are not recorded: anyone can send them, and they would drown the trail.
"""

from __future__ import annotations

import getpass
import time
from dataclasses import asdict, dataclass
from typing import Any

from wfm.identity.operators import Operator, Role
from wfm.store import audit_rows
from wfm.store.database import Connection, Database

__all__ = ["DETAIL_CHARS", "FAILED", "OK", "OUTCOMES", "REFUSED", "RETENTION_DAYS",
           "AuditEntry", "Auditor", "entries", "local_operator", "record", "record_sync",
           "trim"]

OK, REFUSED, FAILED = "ok", "refused", "failed"
OUTCOMES = (OK, REFUSED, FAILED)
#: How long entries are kept unless `margo serve --audit-retention-days` says otherwise.
RETENTION_DAYS = 365
#: The longest detail an entry keeps.
DETAIL_CHARS = 1000


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One line of the trail (`at`: Unix time; `id`: its place, once stored)."""

    at: float
    actor: str
    via: str
    role: str
    action: str
    target: str
    outcome: str
    detail: str | None = None
    address: str | None = None
    replica: str | None = None
    id: int | None = None

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, column) for column in audit_rows.COLUMNS)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["at"] = _iso(self.at)
        return doc


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def _entry(caller: Operator, action: str, target: str, outcome: str, detail: str | None,
           address: str | None, replica: str | None) -> AuditEntry:
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: one of {', '.join(OUTCOMES)}")
    if detail is not None and len(detail) > DETAIL_CHARS:
        detail = detail[:DETAIL_CHARS - 3] + "..."
    return AuditEntry(time.time(), caller.name, caller.via, caller.role.name.lower(),
                      action, target, outcome, detail, address, replica)


async def record(db: Database, caller: Operator, action: str, target: str, *,
                 outcome: str = OK, detail: str | None = None, address: str | None = None,
                 replica: str | None = None) -> AuditEntry:
    """Append one entry, durably, from the event loop: `action` such as `rollout.pause`,
    `target` what it acted on (an intent, an operator's name), `outcome` ok, refused or
    failed with `detail` saying why (never a secret)."""
    entry = _entry(caller, action, target, outcome, detail, address, replica)
    await db.write(lambda conn: audit_rows.append(conn, entry.values()))
    return entry


def record_sync(db: Database, caller: Operator, action: str, target: str, *,
                outcome: str = OK, detail: str | None = None,
                address: str | None = None) -> AuditEntry:
    """`record`, for a command beside the server (it blocks until the entry is stored)."""
    entry = _entry(caller, action, target, outcome, detail, address, None)
    db.write_sync(lambda conn: audit_rows.append(conn, entry.values()))
    return entry


def local_operator() -> Operator:
    """The actor of a `margo` command run against the server's store: the OS user, who
    holds the data directory (or the database's URL) and so every power."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        import os

        user = str(os.getuid())
    return Operator(f"local:{user}", Role.ADMIN, "local")


def entries(db: Database, *, since: float | None = None, actor: str | None = None,
            limit: int | None = None) -> list[AuditEntry]:
    """The entries at or after `since` (Unix time) by `actor`, oldest first; with `limit`,
    only the newest `limit`."""
    rows = db.read(lambda conn: audit_rows.select(conn, since=since, actor=actor,
                                                  limit=limit))
    return [AuditEntry(**dict(zip(audit_rows.COLUMNS, row[1:], strict=True)), id=int(row[0]))
            for row in rows]


def trim(conn: Connection, days: float, now: float | None = None) -> int:
    """Delete the entries older than `days`; how many (the trail's only deletion)."""
    return audit_rows.trim(conn, (time.time() if now is None else now) - days * 86400)


class Auditor:
    """The server's trail: its store and this replica's name are set when the server starts
    (`open`); each entry it appends also trims what is past the retention."""

    def __init__(self, retention_days: float = RETENTION_DAYS) -> None:
        if retention_days <= 0:
            raise ValueError("the audit retention must be a positive number of days")
        self.retention_days = retention_days
        self.db: Database | None = None
        self.replica: str | None = None

    def open(self, db: Database, replica: str | None = None) -> None:
        """Start recording on `db`; what is past the retention goes now (not awaited)."""
        self.db, self.replica = db, replica
        db.submit(lambda conn: trim(conn, self.retention_days))

    async def record(self, caller: Operator, action: str, target: str, *, outcome: str = OK,
                     detail: str | None = None, address: str | None = None) -> AuditEntry:
        """`record` on the server's store, as this replica, trimming in the same write."""
        if self.db is None:
            raise RuntimeError("the audit trail is not open (the server has not started)")
        entry = _entry(caller, action, target, outcome, detail, address, self.replica)

        def write(conn: Connection) -> None:
            audit_rows.append(conn, entry.values())
            trim(conn, self.retention_days, entry.at)

        await self.db.write(write)
        return entry
