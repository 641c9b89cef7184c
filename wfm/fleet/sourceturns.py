"""Replicas take turns changing the fleet source (a push, a fetch).

A turn is a PostgreSQL session advisory lock on a connection of its own: `begin` waits for
it and brings this replica's copy of the source to what the replicas published; `finish`
publishes what changed (`Coordinator.publish_source`) and ends the session, which releases
the lock (a replica that dies mid-turn releases it too).
"""

from __future__ import annotations

from typing import Protocol

from wfm.fleet.replication import Published, RepoReplica
from wfm.store import replica_rows
from wfm.store.pgdb import PgConnection, PostgresDatabase

__all__ = ["SOURCE_KEY", "SourceUpdate"]

#: The advisory lock under which replicas take turns updating the fleet source ("source").
SOURCE_KEY = 0x736F75726365


class SourceHolder(Protocol):
    """What a turn needs of the replica (`wfm.fleet.coordination.Coordinator`)."""

    db: PostgresDatabase
    source: RepoReplica | None

    def sync_source(self) -> bool: ...

    def publish_source(self, before: dict[str, str]) -> Published | None: ...


class SourceUpdate:
    """One replica's turn at the fleet source (see `Coordinator.source_update`)."""

    def __init__(self, coordinator: SourceHolder) -> None:
        self._coordinator = coordinator
        self._conn: PgConnection | None = None
        self._before: dict[str, str] = {}

    def begin(self) -> None:
        source = self._coordinator.source
        assert source is not None
        conn = self._coordinator.db.connect()
        try:
            replica_rows.wait_advisory_lock(conn, SOURCE_KEY, timeout_ms=120000)
            self._coordinator.sync_source()
        except BaseException:
            conn.close()
            raise
        self._conn, self._before = conn, source.refs()

    def finish(self, *, publish: bool = True) -> Published | None:
        """Publish what the turn changed (unless `publish` is false) and end the turn."""
        conn, self._conn = self._conn, None
        try:
            source = self._coordinator.source
            if not publish or source is None:
                return None
            return self._coordinator.publish_source(self._before)
        finally:
            if conn is not None:
                conn.close()  # ends the session: the advisory lock goes with it
