"""Which devices each client has, as the request handlers need it on every status report
and manifest poll.

On one server (SQLite, `wfm.server.datalock`) this process is the only writer of the `devices`
table: every registration and deletion goes through `wfm.http.capabilities`, which says
so here, so the answer can be remembered until it changes. That took two indexed reads
off the event loop per status report, about a sixth of what the server spent on one. With replicas
another process registers and forgets devices, and a stale answer would serve a state
without a device another replica just registered: every lookup reads, and the lookups made
while a read is on its way are read together (`wfm.store.coalesced`: a generation wakes
thousands of held polls at once, each asking for its client's list).
"""

from __future__ import annotations

from collections.abc import Callable

from wfm.store import records
from wfm.store.coalesced import Coalesced
from wfm.store.database import Database

__all__ = ["ClientDevices"]

#: More clients than this remembered at once: forget them all (and read again).
_MAX_REMEMBERED = 200_000


class ClientDevices:
    """Per client, the ids of its devices (sorted), read from `devices`."""

    def __init__(self, db: Database, *, sole_writer: bool,
                 on_change: Callable[[str], None] | None = None):
        """`on_change(client_id)` is told of every change (the client's waiting polls check
        again: `wfm.fleet.waiters`)."""
        self._db = db
        self._on_change = on_change
        self._sole_writer = sole_writer
        self._known: dict[str, tuple[str, ...]] = {}
        self._reads: Coalesced[str, tuple[str, ...]] = Coalesced(db, records.clients_devices,
                                                                 ())
        # Bumped by every change: a read that started before one is not remembered.
        self._changes = 0

    async def of(self, client_id: str) -> tuple[str, ...]:
        known = self._known.get(client_id)
        if known is not None:
            return known
        changes = self._changes
        devices = await self._reads.get(client_id)
        if self._sole_writer and changes == self._changes:
            if len(self._known) >= _MAX_REMEMBERED:
                self._known.clear()
            self._known[client_id] = devices
        return devices

    def changed(self, client_id: str) -> None:
        """A write registered or forgot devices of this client (call after it committed)."""
        self._changes += 1
        self._known.pop(client_id, None)
        if self._on_change is not None:
            self._on_change(client_id)
