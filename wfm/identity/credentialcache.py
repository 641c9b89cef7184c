"""Bearer-token lookups, remembered until something that could change them is written.

Why not a time-to-live: each device sends its token with every request, so a cache whose
entries expired after two seconds refreshed them in waves. Measured (`bench/serve.py
--devices 5000`, one connection per device, 2,000 status reports/s): every two seconds
5,000 entries fell due within a few hundred milliseconds, their lookups ran back to back on
the event loop, and each wave stalled every request for ~150 ms (p99 123 ms; 69 ms without
the waves).

So the database counts the writes that can make a remembered lookup wrong:
`wfm.store.client_rows.bump_credentials_epoch` runs in the same transaction as retiring a client,
replacing its token or accepting it again (`wfm.identity.clients.ClientRegistry`), whichever
process writes it (a server, a replica, `margo clients` beside a running server). A server
reads the counter at most every `EPOCH_CHECK_SECONDS` (one small query, however many
devices) and forgets every lookup when it moved: a retired client or a replaced token is
refused within that second. Requests authenticated before and still waiting (held polls)
are told (`on_change`) and authenticate again; while they are held the server reads the
counter itself every second (`wfm.http.device_api.Api.watch_credentials`). An entry is
also dropped when its access token expires, and after `MAX_AGE_SECONDS` in any case (a
bound on how long a fault in that bookkeeping could last).

An entry remembers the epoch its lookup started under and counts only while that is still
the epoch: a lookup that read the row just before a retirement committed, and finished
after the counter was read, is never kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from wfm.identity.clients import Client, TokenLookup

__all__ = ["EPOCH_CHECK_SECONDS", "MAX_AGE_SECONDS", "CredentialCache", "watch_epoch"]

log = logging.getLogger("margo.wfm.credentials")

#: How often a server asks whether credentials changed (the bound on refusing a retired
#: client or a replaced token).
EPOCH_CHECK_SECONDS = 1.0
#: The longest a lookup is remembered, whatever the epoch says.
MAX_AGE_SECONDS = 300.0
#: Past this many remembered lookups (most of them unknown tokens, then) start again.
MAX_ENTRIES = 100_000


@dataclass(frozen=True, slots=True)
class _Entry:
    lookup: TokenLookup
    epoch: int
    until: float  # time.monotonic()


class CredentialCache:
    """The remembered lookups of one server process. `read_epoch` and `lookup` run the
    queries (on a worker thread for a remote store: `wfm.store.database.Database.offload`)."""

    def __init__(self, read_epoch: Callable[[], Awaitable[int]],
                 lookup: Callable[[str], Awaitable[TokenLookup]], *,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """`on_change()`: told, on the event loop, each time the epoch read differs from
        the one read before (the first read too: requests admitted by an SVID or a
        signature may be held before any token lookup read it): requests authenticated
        before may no longer be admitted."""
        self._read_epoch, self._lookup, self._on_change = read_epoch, lookup, on_change
        self._entries: dict[str, _Entry] = {}
        self._epoch: int | None = None
        self._checked = -1e18

    @property
    def epoch(self) -> int | None:
        """The credentials epoch as last read (None before the first read)."""
        return self._epoch

    async def refresh(self) -> None:
        """Read the epoch if it was not read in the last `EPOCH_CHECK_SECONDS` (each lookup
        does; a server holding requests while none arrive calls this itself), and forget
        every lookup when it moved."""
        now = time.monotonic()
        if now - self._checked < EPOCH_CHECK_SECONDS:
            return
        self._checked = now
        epoch = await self._read_epoch()
        if epoch != self._epoch:
            self._entries.clear()
            self._epoch = epoch
            self._on_change()

    async def client(self, token: str) -> Client | None:
        """The client `token` proves, or None."""
        await self.refresh()
        now = time.monotonic()
        entry = self._entries.get(token)
        if entry is not None and entry.epoch == self._epoch and entry.until > now:
            return entry.lookup.client
        started_under = self._epoch
        found = await self._lookup(token)
        until = now + MAX_AGE_SECONDS
        if found.expires_at is not None:
            until = min(until, now + found.expires_at - time.time())
        if started_under is not None and started_under == self._epoch and until > now:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[token] = _Entry(found, started_under, until)
        return found.client


async def watch_epoch(cache: CredentialCache, holding: Callable[[], bool]) -> None:
    """While `holding()` (requests are held), read the epoch every `EPOCH_CHECK_SECONDS`
    (`CredentialCache.refresh`): requests read it as they authenticate, but a held request
    may wait a minute while none arrive. A store that cannot be read is logged once, and
    once more when it answers again (held requests are not re-checked meanwhile; new
    requests fail on the store as usual). Runs until cancelled."""
    failing = False
    while True:
        await asyncio.sleep(EPOCH_CHECK_SECONDS)
        if not holding():
            continue
        try:
            await cache.refresh()
        except Exception as exc:
            if not failing:
                log.warning("credentials epoch not read; held requests are not checked "
                            "against withdrawn credentials until it is: %s", exc)
            failing = True
            continue
        if failing:
            log.info("credentials epoch read again")
            failing = False
