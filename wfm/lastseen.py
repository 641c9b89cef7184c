"""When each client last polled its desired state, and how often it polls.

A manifest poll is a read, often answered 304 from memory; writing a row for each would
make polling cost a write (10,000 devices at 15 s are 667 a second). So polls are kept in
memory and written in one batch at most every `FLUSH_EVERY` seconds (and at shutdown): a
last-seen time is at most that much late, which freshness (minutes) does not notice.

The polling interval is observed, not configured: a moving average of the gaps between a
client's polls on this replica, ignoring gaps far from it (a device that was switched off).
Behind a balancer that spreads one client's polls over N replicas, each replica sees every
Nth poll and reports up to N times the interval; the freshness threshold is then that much
looser, never tighter.
"""

from __future__ import annotations

import threading
import time

from wfm import records
from wfm.db import Database

__all__ = ["FLUSH_EVERY", "PollClock"]

FLUSH_EVERY = 5.0
#: Weight of the newest gap in the moving average.
_ALPHA = 0.3
#: A gap this many times the current estimate is an outage, not a polling interval.
_OUTAGE = 4.0


class PollClock:
    def __init__(self, db: Database, *, flush_every: float = FLUSH_EVERY) -> None:
        self._db, self._flush_every = db, flush_every
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._interval: dict[str, float] = {}
        self._pending: dict[str, tuple[float, float | None]] = {}
        self._flushed = time.monotonic()

    def seen(self, client_id: str, now: float | None = None) -> None:
        """A poll from `client_id` (call on every manifest request, 200 or 304)."""
        now = time.time() if now is None else now
        with self._lock:
            last = self._last.get(client_id)
            self._last[client_id] = now
            if last is not None and now > last:
                self._observe(client_id, now - last)
            self._pending[client_id] = (now, self._interval.get(client_id))
            due = time.monotonic() - self._flushed >= self._flush_every
        if due:
            self.flush()

    def _observe(self, client_id: str, gap: float) -> None:
        estimate = self._interval.get(client_id)
        if estimate is None:
            self._interval[client_id] = gap
        elif gap <= _OUTAGE * estimate:
            self._interval[client_id] = (1 - _ALPHA) * estimate + _ALPHA * gap

    def flush(self) -> None:
        """Queue the pending polls as one write (the database's writer commits it)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._flushed = time.monotonic()
        if batch:
            self._db.submit(lambda conn: records.record_polls(conn, batch))
