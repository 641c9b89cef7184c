"""When each client last polled its desired state, and how often it polls.

A manifest poll is a read, often answered 304 from memory; writing a row for each would
make polling cost a write (10,000 devices at 15 s are 667 a second). So polls are kept in
memory and written in one batch at most every `FLUSH_EVERY` seconds (and at shutdown).
What this process reads back (the fleet API, the dashboard, `/metrics`) is the stored
times brought up to date with its own (`up_to_date`), so on one server a last-seen time is
exact; what another replica stored is at most `FLUSH_EVERY` late, which freshness
(`wfm.fleet.freshness`: a minute at least) does not notice. A flush the database refuses
(locked, unreachable) is kept for the next one, unless a newer poll of the same client
replaced it: an outage must not make devices look silent.

The polling interval is observed, not configured: a moving average of the gaps between a
client's polls on this replica, ignoring gaps far from it (a device that was switched off).
Behind a balancer that spreads one client's polls over N replicas, each replica sees every
Nth poll and reports up to N times the interval; the freshness threshold is then that much
looser, never tighter.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from wfm.store import records
from wfm.store.database import Database, DatabaseUnavailable

__all__ = ["FLUSH_EVERY", "PollClock"]

#: Seconds between two writes of the polls seen. MEASURED (`bench/fleet.py --polling waiting
#: --quiet`, docs/benchmarks.md): with 10,000 waiting devices, a write every 5 s updated
#: about 830 rows spread over most of the table's pages each time, a tenth of a quiet
#: server's CPU; every 30 s each page is written about once per write.
FLUSH_EVERY = 30.0
#: Weight of the newest gap in the moving average.
_ALPHA = 0.3
#: A gap this many times the current estimate is an outage, not a polling interval.
_OUTAGE = 4.0
log = logging.getLogger("margo.wfm.lastseen")


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

    def up_to_date(self, stored: dict[str, tuple[float | None, float | None]]
                   ) -> dict[str, tuple[float | None, float | None]]:
        """`stored` (`records.client_polls`: client -> last poll, interval) with this
        process's newer polls and intervals, including those not written yet."""
        with self._lock:
            last, interval = dict(self._last), dict(self._interval)
        merged = dict(stored)
        for client_id, when in last.items():
            stored_when, stored_interval = merged.get(client_id, (None, None))
            if stored_when is None or when > stored_when:
                merged[client_id] = (when, interval.get(client_id, stored_interval))
        return merged

    def flush(self) -> None:
        """Queue the pending polls as one write (the database's writer commits it)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._flushed = time.monotonic()
        if batch:
            self._db.submit(lambda conn: records.record_polls(conn, batch)) \
                .add_done_callback(lambda written: self._kept(written, batch))

    def _kept(self, written: Future[None], batch: dict[str, tuple[float, float | None]]
              ) -> None:
        """After a flush: when the store could not take it, put its polls back (the writer
        calls this, or `flush` itself when the writer refused at once; never with the lock
        held). Any other failure is a defect that retrying would only repeat: logged."""
        error = None if written.cancelled() else written.exception()
        if error is None:
            return
        if not isinstance(error, DatabaseUnavailable):
            log.error("last-seen times of %d client(s) not stored", len(batch),
                      exc_info=error)
            return
        log.warning("last-seen times of %d client(s) kept for the next flush: %s",
                    len(batch), error)
        with self._lock:
            for client_id, poll in batch.items():
                self._pending.setdefault(client_id, poll)
