"""Budgets for request bodies in flight: how many body bytes the server holds at once, per
route class and per client address.

`wfm.admission.bodylimit` caps each body, but a cap per body bounds nothing in total: 40 connections
each holding a forged 24 MiB push hook took the server from 132 to 2,053 MiB, and 400 held
1 MiB onboarding bodies to 957 MiB (`bench/bodies.py`). So every body is also admitted
against two budgets before its first byte is read:

- its route class's (`ROUTE_CLASSES`): push hooks; the anonymous device API (onboarding, the
  OAuth token endpoint, and any request not authenticated by the time its body is read);
  the authenticated device API; pushes to the hosted source; device Git requests. An
  anonymous flood therefore cannot take the bytes that devices' status reports need;
- its client address's (the TCP peer, `BudgetSettings.per_address`): a further body from an
  address is admitted only while the address stays within it, but a body alone from its
  address is never refused by it, so one legitimate large push or hook always gets through.

A body that declares its length (`Content-Length`) is charged all of it at once; a chunked
body is charged chunk by chunk as it arrives. One that does not fit is refused before more
of it is read: 413 when it is larger than its class's whole budget (it can never fit), 503
with Retry-After when the class's budget is spent, 429 with Retry-After when its address's
is. The charge is given back when the request's handling ends, which is when its handler
has let go of the body.

The charge is taken at the body's first read, not when the request arrives: a handler that
refuses a request before reading it (every authenticated route checks credentials first)
costs no budget, and whether a device API request counts as authenticated is decided then:
what authenticated it said so with `vouch` (`wfm.identity.proofs`: an SVID, a token, or an rc.2
signature, which is verified from the headers alone before the body is read).

After large bodies are freed, the memory is given back to the system (`Trimmer`): CPython
hands bodies of more than 512 bytes to glibc's malloc, which keeps freed heap memory for
reuse, so a burst left the server hundreds of MiB larger for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import platform
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from wfm.problems import ProblemError

__all__ = ["DEFAULT_BUDGETS", "ROUTE_CLASSES", "SCOPE_KEY", "BudgetRefused", "BudgetSettings",
           "Ledger", "Ticket", "Trimmer", "vouch"]

log = logging.getLogger("margo.wfm.budgets")

MIB = 1024 * 1024
#: The route classes, each with a budget of its own.
ROUTE_CLASSES = ("webhook", "anonymous", "device", "push", "git")
#: Where a request's `Ticket` travels in the ASGI scope.
SCOPE_KEY = "margo.body_budget"
#: Seconds a refused client is told to wait: bodies in flight finish or time out
#: (`--body-timeout`, 30 s) soon after.
RETRY_AFTER = 5


@dataclass(frozen=True)
class BudgetSettings:
    """Bytes of request bodies the server holds at once, per route class, and per client
    address (0: no per-address limit). `margo serve --budget-*` sets them in MiB."""

    webhook: int = 64 * MIB  # two of GitHub's largest hooks (25 MiB)
    anonymous: int = 16 * MIB  # onboarding bodies are a few KiB
    device: int = 128 * MIB  # 10,000 devices reporting 8 KiB each at the same moment
    push: int = 128 * MIB  # two of the largest pushes (64 MiB)
    git: int = 128 * MIB  # upload-pack requests are a few KiB; they stream to Git
    per_address: int = 32 * MIB

    def __post_init__(self) -> None:
        for name in ROUTE_CLASSES:
            if getattr(self, name) < 1:
                raise ValueError(f"the {name} body budget must be at least one byte")
        if self.per_address < 0:
            raise ValueError("the per-address body budget cannot be negative")

    def of(self, route_class: str) -> int:
        return int(getattr(self, route_class))


DEFAULT_BUDGETS = BudgetSettings()


class BudgetRefused(ProblemError):
    """413, 429 or 503 for a body its budgets cannot take; the connection is closed after
    the answer (the rest of the body is never read). A `wfm.admission.bodylimit.BodyRefused` in all
    but name: that module renders both the same way."""

    def __init__(self, status: int, detail: str):
        super().__init__(status, detail, headers={"Connection": "close"},
                         retry_after=None if status == 413 else RETRY_AFTER)


class Ledger:
    """The bytes in flight, per route class and per client address. Used from the event
    loop only (no locks)."""

    def __init__(self, settings: BudgetSettings = DEFAULT_BUDGETS,
                 trimmer: Trimmer | None = None):
        self.settings = settings
        self.trimmer = trimmer
        self.classes = dict.fromkeys(ROUTE_CLASSES, 0)
        self.addresses: dict[str, int] = {}

    def charge(self, route_class: str, address: str, own: int, size: int) -> None:
        """Add `size` bytes to a request of `address` that holds `own` bytes already, or
        raise `BudgetRefused` (and charge nothing)."""
        limit = self.settings.of(route_class)
        if own + size > limit:
            raise BudgetRefused(413, f"the server holds at most {limit} bytes of {route_class} "
                                     f"request bodies at once; this body needs {own + size}")
        if self.classes[route_class] + size > limit:
            raise BudgetRefused(503, f"the server holds as many {route_class} request bodies "
                                     "as it takes at once; retry later")
        held = self.addresses.get(address, 0)
        per_address = self.settings.per_address
        if per_address and held > own and held + size > per_address:
            raise BudgetRefused(429, f"this client address has {held} bytes of request "
                                     f"bodies in flight, the most it may ({per_address}); "
                                     "retry when they are done")
        self.classes[route_class] += size
        self.addresses[address] = held + size

    def release(self, route_class: str, address: str, size: int) -> None:
        """Give back what a request held, once it is handled."""
        self.classes[route_class] -= size
        left = self.addresses.get(address, 0) - size
        if left > 0:
            self.addresses[address] = left
        else:
            self.addresses.pop(address, None)
        if self.trimmer is not None:
            self.trimmer.freed(size)


class Ticket:
    """One request's share of the budgets. `kind` is its route's class, except "device":
    the authenticated device API when something `vouch`ed for the caller before the first
    read of the body, else "anonymous"."""

    __slots__ = ("address", "held", "kind", "ledger", "route_class", "vouched")

    def __init__(self, ledger: Ledger, kind: str, address: str):
        self.ledger, self.kind, self.address = ledger, kind, address
        self.vouched = False
        self.route_class: str | None = None
        self.held = 0

    def admit(self, declared: int | None) -> None:
        """At the first read of the body: decide the class, charge a declared length."""
        if self.route_class is None:
            self.route_class = self.kind if self.kind != "device" or self.vouched \
                else "anonymous"
        if declared:
            self.charge(declared)

    def charge(self, size: int) -> None:
        assert self.route_class is not None, "admit() first"
        self.ledger.charge(self.route_class, self.address, self.held, size)
        self.held += size

    def release(self) -> None:
        if self.held and self.route_class is not None:
            self.ledger.release(self.route_class, self.address, self.held)
        self.held = 0


def vouch(scope: MutableMapping[str, Any]) -> None:
    """The request's caller is authenticated: its body counts as the authenticated device
    API's (when it is read after this)."""
    ticket = scope.get(SCOPE_KEY)
    if ticket is not None:
        ticket.vouched = True


# --- giving memory back -------------------------------------------------------------------


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, None elsewhere (musl, macOS: their allocators differ)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    with contextlib.suppress(OSError, AttributeError):
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return lambda: trim(0)
    return None


class Trimmer:
    """Return freed heap memory to the system after large bodies were let go.

    glibc raises its mmap threshold after a large block is freed, so later bodies (and
    their joined copies) come from the heap, and freed heap memory stays with the process:
    after 40 held 24 MiB bodies, about 900 MiB stayed. `malloc_trim(0)` gives back every
    free page; it takes a few ms per 100 MiB of heap, so it runs in a worker thread,
    `delay` seconds after `threshold` bytes of bodies were released (a burst ends first),
    at most once per `delay`."""

    def __init__(self, threshold: int = 8 * MIB, delay: float = 1.0,
                 trim: Callable[[], object] | None = None):
        self.threshold, self.delay = threshold, delay
        self._trim = trim if trim is not None else _malloc_trim()
        self._freed = 0
        self._scheduled = False

    @property
    def available(self) -> bool:
        return self._trim is not None

    def freed(self, size: int) -> None:
        if self._trim is None:
            return
        self._freed += size
        if self._freed >= self.threshold and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(self.delay, self._start)

    def _start(self) -> None:
        self._freed = 0
        task = asyncio.ensure_future(asyncio.to_thread(self._run))
        task.add_done_callback(self._done)

    def _run(self) -> None:
        assert self._trim is not None
        self._trim()

    def _done(self, task: asyncio.Future[None]) -> None:
        self._scheduled = False
        if not task.cancelled() and task.exception() is not None:
            log.warning("malloc_trim failed: %s", task.exception())
        self.freed(0)  # what was freed meanwhile
