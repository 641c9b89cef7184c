"""Replicas hear of each other's publications through PostgreSQL (LISTEN/NOTIFY).

A replica's coordination loop (`wfm.fleet.coordination`) used to learn of a new generation,
or of a compile another replica asked for, only at its next look at the database (every
0.25 s). The replica that publishes a generation, or asks for a compile, now also
`announce`s it on `replica_rows.NEWS_CHANNEL` in the same transaction, and every replica
keeps one session `listen`ing there: the loop wakes as soon as the transaction commits, syncs,
and wakes its waiting polls (`wfm.fleet.waiters`). The periodic look stays, as the safety
net: a notification lost with a broken session costs what polling costs, never more.

One session per replica, opened lazily and opened again after PostgreSQL was lost (not more
often than every `RECONNECT_EVERY` seconds, so an outage does not add a connection attempt
to every turn of the loop).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import psycopg

from wfm.store import replica_rows
from wfm.store.database import DatabaseUnavailable
from wfm.store.pgdb import PgConnection, PostgresDatabase

__all__ = ["RECONNECT_EVERY", "News"]

log = logging.getLogger("margo.wfm.replicas")

#: The least time between two attempts to open the listening session.
RECONNECT_EVERY = 5.0
_LOST = (psycopg.Error, DatabaseUnavailable, OSError)


class News:
    """The replica's listening session; `wait` returns when news arrive (or at its timeout).
    Used by one thread (the coordination loop); `close` from any."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db
        self._conn: PgConnection | None = None
        self._next_attempt = 0.0
        self._lock = threading.Lock()

    def wait(self, timeout: float, stopping: threading.Event) -> bool:
        """Until news arrive (True; every notification already queued is taken with it),
        `timeout` seconds pass or `stopping` is set (False)."""
        conn = self._session()
        if conn is None:
            stopping.wait(timeout)
            return False
        try:
            heard = any(True for _ in conn.raw.notifies(timeout=timeout, stop_after=1))
            if heard:
                for _ in conn.raw.notifies(timeout=0.0):
                    pass
            return heard
        except _LOST as exc:
            log.warning("replica news: the listening session was lost (%s); looking at the "
                        "database on schedule until it is back", exc)
            self._drop()
            return False

    def _session(self) -> PgConnection | None:
        with self._lock:
            if self._conn is not None:
                return self._conn
            if time.monotonic() < self._next_attempt:
                return None
            self._next_attempt = time.monotonic() + RECONNECT_EVERY
        try:
            conn = self._db.connect()
        except _LOST:
            return None
        try:
            replica_rows.listen(conn)
        except _LOST:
            conn.close()
            return None
        with self._lock:
            self._conn = conn
        return conn

    def _drop(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        self._drop()
