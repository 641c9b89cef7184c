"""Waiting polls: conditional requests held until what they poll changes (RFC 7240 `Prefer:
wait=N`), and the one place that wakes them.

A device that sends its usual conditional poll (`If-None-Match` naming what it holds) with
`Prefer: wait=N` is answered exactly as an immediate poll would be, only later: the request
is held until its answer would change or N seconds pass (N clamped to the server's
`--max-wait`), then answered 200 with the new state or 304, with `Preference-Applied:
wait=N`. The REST manifests (`wfm.http.manifests`) and the Git ref advertisement
(`wfm.git.githttp`) hold requests here; what they answer is theirs.

A held request is a `_Ticket`, indexed under keys: ``client:<id>`` (a client's manifest)
and ``device:<id>`` (each device whose branch the answer is made from). What publishes
desired state wakes the tickets whose keys it touched: a compile's committed devices (one
server), the refs a replica's sync moved (replicas), a client whose devices were registered
or deleted. A woken request checks its answer again; if it is unchanged, it goes back to
waiting for the rest of its time. A wake that comes between a request's first check and its
ticket is not lost: every wake bumps `changes`, and a ticket entered after a newer one than
its check saw checks again at once (`mark`).

Wakes come from any thread (the compile thread, the replica's coordination thread) and are
handed to the event loop the requests wait on; the index is only ever touched there.

Bounds. At most `limit` tickets at once (`margo serve --max-waiters`): past it a request is
answered at once, as a plain poll (no `Preference-Applied`), which sheds the load onto the
device's polling interval instead of the server's memory. Each held request costs its
connection (about 10 KiB kept alive) and, held, what waits for it: outside the ASGI stack
(`wfm.admission.parking`), its scope, a few frames, a ticket, a future, a timer and what
authenticates it again at a wake, about 6.6 KiB more (13 KiB while it waited inside the
stack; bench/held_polls.py, the server's RSS with 10,000 idle connections, then with a
held poll on each; docs/benchmarks.md). A waiting device's renewal held on the wire
(`wfm.server.wire`) is held by `hold_soon` instead: its ticket and its connection's
callback, nothing more, and one timer for all that run out in the same second.
A client that disconnects is released at once: its connection says so (`margo serve`
gives each request its connection's `Closing`, `wfm.server.closing`), or,
served without one, its request's `receive`, read by a task meanwhile. `close` (server
shutdown) answers every held request at once (304 with `Preference-Applied`: it was held,
until now) and holds no new ones: the devices poll again at once, find the port closed
(or, behind a balancer, another replica), and come back with jitter
(`reconciler.sources.waiting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from wfm.admission.parking import CONNECTION_SCOPE_KEY
from wfm.telemetry.metrics import HELD_POLL_ENDS, HELD_POLLS

__all__ = ["CLOSING_SCOPE_KEY", "DEFAULT_MAX_WAIT", "DEFAULT_MAX_WAITERS", "Closing", "Outcome",
           "Rewind", "SoonHold", "Waiters", "client_key", "device_key", "prefer_values",
           "requested_wait", "wait_headers"]

log = logging.getLogger("margo.wfm.waiters")

#: Past this many changed devices per held request, a wake has every held request check
#: again instead of looking up each changed device (`Waiters._wake_devices`): a check works
#: out an answer, far more than a look-up costs, so only a change much larger than what is
#: held (a full compile) is answered by checking everything held.
_CHANGED_PER_HELD = 64
#: The longest a request is held unless `margo serve --max-wait` says otherwise (seconds).
DEFAULT_MAX_WAIT = 60.0
#: Requests held at once unless `margo serve --max-waiters` says otherwise: above the
#: 10,000 devices one process serves, below its 16,384 connections (`--max-connections`),
#: so requests that are not held always find a connection.
DEFAULT_MAX_WAITERS = 15_000
#: A held request's deadline is brought forward onto a grid of this many seconds at most
#: (`_on_grid`), and of `_GRID_SHARE` of its wait at most.
_GRID = 1.0
_GRID_SHARE = 1 / 20
#: Digits of a wait value read at most; a longer one is clamped like any long wait.
_DIGITS = 9
#: Woken requests checking their answer at once; the others wait their turn. A compile that
#: wakes 10,000 held polls would otherwise start 10,000 manifest computations together:
#: each waits on the others (the database's threads, its writer), the first answer goes
#: out only once most are done, and the devices' next requests arrive while the answered
#: requests' tasks are still finishing, past uvicorn's limit of tasks (measured with
#: bench/fleet.py: 3,615 of 10,000 follow-up requests answered 503). In turns, answers go
#: out as they are ready.
CONCURRENT_CHECKS = 64

#: Where a request's scope holds its connection's `Closing`, when the server's HTTP protocol
#: gives one (`wfm.server.closing`): the connection itself (`wfm.admission.parking`).
CLOSING_SCOPE_KEY = CONNECTION_SCOPE_KEY

#: What a woken request checks: whether its answer changed, and the keys it waits under now
#: (a client's devices may have changed with it).
Check = Callable[[], Awaitable[tuple[bool, frozenset[str]]]]
#: The owners (client ids) of devices the index does not know (replicas: registered on
#: another replica since the request began waiting).
Owners = Callable[[list[str]], Awaitable[Iterable[str]]]


class Closing(Protocol):
    """A connection that calls back whoever registered when it closes: how a held request
    learns of its client's disconnect without a task of its own reading `receive`
    (`wfm.server.closing`)."""

    def add(self, callback: Callable[[], None]) -> None: ...

    def discard(self, callback: Callable[[], None]) -> None: ...


class Outcome(enum.Enum):
    """How a held request ended."""

    CHANGED = "changed"  # its answer changed: answer the new one
    TIMEOUT = "timeout"  # the wait ran out unchanged: 304
    CLOSED = "closed"  # the server stops: 304 now, as held (the device comes back at once)
    SHED = "shed"  # not held (too many held): answer as a plain poll
    GONE = "gone"  # the client disconnected: nobody reads the answer


_ENDS = {outcome: HELD_POLL_ENDS.labels(outcome.value) for outcome in Outcome}
#: Holds whose check raised (answered as that error, not as an `Outcome`).
_FAILED = HELD_POLL_ENDS.labels("failed")


#: Every `Waiters` of this process, for `margo_waiting_polls_held` (`_held_now`).
_LIVE: weakref.WeakSet[Waiters] = weakref.WeakSet()


def _held_now() -> float:
    """What every `Waiters` of this process holds, read when `/metrics` is scraped. Why
    not set at each hold and release: two gauge updates (and their lock) on every renewal
    of 10,000 waiting devices were about 3 % of a quiet server's CPU (py-spy of
    `bench/fleet.py --polling waiting --quiet`, docs/benchmarks.md)."""
    return float(sum(len(waiters) for waiters in tuple(_LIVE)))


HELD_POLLS.set_function(_held_now)


def client_key(client_id: str) -> str:
    return f"client:{client_id}"


def device_key(device_id: str) -> str:
    return f"device:{device_id}"


def requested_wait(values: Iterable[str], *, limit: float) -> int | None:
    """The wait (whole seconds, at most `limit`) that `Prefer` header values ask for; None
    when none asks for one. Tolerant, as RFC 7240 wants: preferences are comma-separated,
    parameters after `;` are ignored, names are case-insensitive, a value may be quoted, the
    first `wait` counts, and a malformed one is ignored (never an error)."""
    for value in values:
        for preference in value.split(","):
            name, _, argument = preference.split(";", 1)[0].partition("=")
            if name.strip().lower() != "wait":
                continue
            digits = argument.strip().strip('"').strip()
            if not digits.isascii() or not digits.isdigit():
                return None  # the first wait is malformed: no wait asked for
            seconds = int(digits[:_DIGITS]) if len(digits) <= _DIGITS else int(limit)
            return max(0, min(seconds, int(limit)))
    return None


class _Ticket:
    """One held request: its keys, and the future its handler awaits (None between waits,
    when a wake is remembered in `woken`)."""

    __slots__ = ("future", "keys", "outcome")

    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys
        self.future: asyncio.Future[Outcome] | None = None
        self.outcome: Outcome | None = None  # a wake or disconnect that came between waits

    def gone(self, *_: Any) -> None:
        """Its client disconnected (a connection's callback, or a watch task's)."""
        self.resolve(Outcome.GONE)

    def resolve(self, outcome: Outcome) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(outcome)
        elif self.outcome is not Outcome.GONE:  # a disconnect outranks a wake
            self.outcome = outcome


class Waiters:
    """The held requests of one server process (module docstring)."""

    def __init__(self, limit: int = DEFAULT_MAX_WAITERS, *,
                 owners: Owners | None = None) -> None:
        self.limit = limit
        self.owners = owners
        #: Bumped by every wake (module docstring: a wake between a check and its ticket).
        self.changes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._index: dict[str, set[_Ticket]] = {}
        self._tickets: set[_Ticket] = set()
        self._closing = False
        self._lookups: set[asyncio.Future[None]] = set()  # owner look-ups under way
        self._due: dict[float, list[SoonHold]] = {}  # `hold_soon`s by when they run out
        self._checks = asyncio.Semaphore(CONCURRENT_CHECKS)  # (bound to the loop on use)
        self._lock = threading.Lock()  # `_loop` is set once, read from any thread
        _LIVE.add(self)

    def __len__(self) -> int:
        return len(self._tickets)

    # --- waking (any thread) -------------------------------------------------------------

    def wake_devices(self, device_ids: Iterable[str]) -> None:
        """These devices' desired state may have changed (their branches moved)."""
        self._schedule(self._wake_devices, frozenset(device_ids))

    def wake_clients(self, client_ids: Iterable[str]) -> None:
        """These clients' devices were registered or deleted."""
        self._schedule(self._wake_keys, frozenset(map(client_key, client_ids)))

    def wake_all(self) -> None:
        """Anything may have changed: every held request checks again."""
        self._schedule(self._wake_every)

    def close(self) -> None:
        """The server stops: answer every held request now, hold no new ones."""
        self._closing = True
        self._schedule(self._release_all)

    def _schedule(self, callback: Callable[..., None], *args: Any) -> None:
        with self._lock:
            loop = self._loop
        if loop is None or loop.is_closed():
            return  # nothing ever waited: nothing to wake
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(callback, *args)

    # --- on the event loop ---------------------------------------------------------------

    def mark(self) -> int:
        """Before a request checks its answer: what `hold` compares with (module
        docstring). Called on the event loop the request runs on."""
        if self._loop is None:
            with self._lock:
                self._loop = asyncio.get_running_loop()
        return self.changes

    def _wake_keys(self, keys: frozenset[str]) -> None:
        self.changes += 1
        for key in keys:
            for ticket in tuple(self._index.get(key, ())):
                ticket.resolve(Outcome.CHANGED)

    def _wake_devices(self, device_ids: frozenset[str]) -> None:
        """Wake the requests held for these devices. Its cost is bounded by what is held,
        not by what changed: it runs on the event loop every request shares, and a full
        compile of a million devices changes all of them (looking each one up here held the
        loop 2.7 s, `bench/first_manifest.py`). With nothing held, nothing is looked up;
        with many more changed devices than held requests, every held request checks its
        answer again (as a task of its own; one whose answer is unchanged goes on waiting),
        which is also what finding the owners of the changed devices would have led to."""
        if not self._tickets:
            self.changes += 1  # (what `mark` hands a request about to be held)
            return
        if len(device_ids) > _CHANGED_PER_HELD * len(self._tickets):
            self._wake_every()
            return
        self._wake_keys(frozenset(map(device_key, device_ids)))
        unknown = [d for d in device_ids if device_key(d) not in self._index]
        if unknown and self._tickets and self.owners is not None:
            task = asyncio.ensure_future(self._wake_owners(unknown))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)

    async def _wake_owners(self, device_ids: list[str]) -> None:
        """Devices no held request is indexed under: their owners' held requests check again
        (their device lists were read before those devices were registered elsewhere)."""
        assert self.owners is not None
        try:
            owners = await self.owners(device_ids)
        except Exception as exc:  # the requests still end when their wait runs out
            log.warning("waking the owners of %d device(s) failed: %s", len(device_ids), exc)
            return
        self._wake_keys(frozenset(map(client_key, owners)))

    def _wake_every(self) -> None:
        self.changes += 1
        for ticket in tuple(self._tickets):
            ticket.resolve(Outcome.CHANGED)

    def _release_all(self) -> None:
        for ticket in tuple(self._tickets):
            ticket.resolve(Outcome.CLOSED)

    def _enter(self, ticket: _Ticket) -> bool:
        """Hold `ticket`, unless as many as `limit` are held."""
        if len(self._tickets) >= self.limit:
            return False
        self._tickets.add(ticket)
        self._index_ticket(ticket)
        return True

    def _index_ticket(self, ticket: _Ticket) -> None:
        for key in ticket.keys:
            self._index.setdefault(key, set()).add(ticket)

    def _unindex(self, ticket: _Ticket) -> None:
        for key in ticket.keys:
            held = self._index.get(key)
            if held is not None:
                held.discard(ticket)
                if not held:
                    del self._index[key]

    def _leave(self, ticket: _Ticket) -> None:
        self._unindex(ticket)
        self._tickets.discard(ticket)

    def _rekey(self, ticket: _Ticket, keys: frozenset[str]) -> None:
        if keys != ticket.keys:
            self._unindex(ticket)
            ticket.keys = keys
            self._index_ticket(ticket)

    async def hold(self, keys: frozenset[str], seconds: float, *, since: int,
                   receive: Callable[[], Awaitable[Any]], check: Check,
                   closing: Closing | None = None, until: float | None = None) -> Outcome:
        """Hold a request whose answer, checked when `since` was `mark`ed, is unchanged:
        until `check` finds it changed (after a wake), `seconds` pass (or the loop's clock
        reaches `until`: the rest of a hold begun by `hold_soon`), the client disconnects
        or the server stops. The disconnect is told by `closing`, the request's connection
        (`CLOSING_SCOPE_KEY`), else by `receive`, the request's ASGI receive, read
        meanwhile: the body messages it gives first are given back when it is a `Rewind`
        (whoever answers after the hold may need them)."""
        if self._closing:
            _ENDS[Outcome.CLOSED].inc()
            return Outcome.CLOSED
        ticket = _Ticket(keys)
        if not self._enter(ticket):
            _ENDS[Outcome.SHED].inc()
            return Outcome.SHED
        watch = _watch_disconnect(ticket, receive, closing)
        try:
            outcome = await self._held(ticket, seconds, since=since, check=check,
                                       until=until)
        except Exception:  # `check` refused the caller (or the store failed): theirs to answer
            _FAILED.inc()
            raise
        finally:
            _unwatch(ticket, watch, receive, closing)
            self._leave(ticket)
        _ENDS[outcome].inc()
        return outcome

    async def _held(self, ticket: _Ticket, seconds: float, *, since: int,
                    check: Check, until: float | None) -> Outcome:
        """`hold` once the ticket is had and its disconnect watched. (One coroutine: each
        held request keeps its frames for up to a minute.)"""
        loop = asyncio.get_running_loop()
        deadline = until if until is not None else _on_grid(loop.time() + seconds, seconds)
        if self.changes != since:
            ticket.outcome = Outcome.CHANGED  # woken between the check and now
        while True:
            outcome = self._pending(ticket, loop, deadline)
            if outcome is None:
                future: asyncio.Future[Outcome] = loop.create_future()
                ticket.future = future
                timer = loop.call_at(deadline, ticket.resolve, Outcome.TIMEOUT)
                try:
                    outcome = await future
                finally:
                    timer.cancel()
                    ticket.future = None
            if outcome is not Outcome.CHANGED:
                return outcome
            async with self._checks:
                changed, keys = await check()
            if changed:
                return Outcome.CHANGED
            self._rekey(ticket, keys)

    def _pending(self, ticket: _Ticket, loop: asyncio.AbstractEventLoop,
                 deadline: float) -> Outcome | None:
        """What ends the ticket's next wait before it starts: a wake or disconnect that came
        while it was checking, the server stopping, the deadline; None: wait (for the first
        of a wake, a disconnect, the server stopping and the deadline)."""
        if ticket.outcome is not None:
            outcome, ticket.outcome = ticket.outcome, None
            return outcome
        if self._closing:
            return Outcome.CLOSED
        if loop.time() >= deadline:
            return Outcome.TIMEOUT
        return None

    def hold_soon(self, keys: frozenset[str], seconds: float, *, since: int,
                  closing: Closing, then: Callable[[Outcome], None]) -> SoonHold | None:
        """`hold` without a coroutine: the held request is a ticket (its timer shared by
        those due together) and `closing`'s callback, and `then(outcome)` is called on the
        event loop once its wait ran out (`TIMEOUT`), its client went away (`GONE`), or a
        wake or the server's stop came (`CHANGED`, `CLOSED`: not answers yet; the caller
        continues with `hold(..., until=SoonHold.deadline)`, which checks or answers them
        as it would have). None when it cannot be held so now (the server stops, too many
        are held, or a wake came since `since`): the caller holds it with `hold`, which
        answers those cases. Why (`wfm.server.wire`): a waiting device's renewal held as a
        task of a few coroutines cost more than the renewal's bytes on the wire; held so,
        it costs a ticket."""
        loop = self._loop
        if self._closing or since != self.changes or loop is None:
            return None
        held = SoonHold(keys, self, closing, then)
        if not self._enter(held):
            return None
        held.deadline = deadline = _on_grid(loop.time() + seconds, seconds)
        due = self._due.get(deadline)
        if due is None:  # one timer for all that run out together (`_on_grid`)
            due = self._due[deadline] = []
            loop.call_at(deadline, self._run_out, deadline)
        due.append(held)
        closing.add(held.gone)
        return held

    def _run_out(self, deadline: float) -> None:
        """The waits of the `hold_soon`s due at `deadline` ran out (those still held)."""
        for held in self._due.pop(deadline, ()):
            held.resolve(Outcome.TIMEOUT)


class SoonHold(_Ticket):
    """A request held by `Waiters.hold_soon`: its own ticket, ending in a call to `then`."""

    __slots__ = ("closing", "deadline", "then", "waiters")

    def __init__(self, keys: frozenset[str], waiters: Waiters, closing: Closing,
                 then: Callable[[Outcome], None]) -> None:
        super().__init__(keys)
        self.waiters, self.closing = waiters, closing
        self.then: Callable[[Outcome], None] | None = then
        self.deadline = 0.0  # (`Waiters._run_out` ends it then)

    def resolve(self, outcome: Outcome) -> None:
        then = self.then
        if then is None:
            return  # ended already
        self.release()
        if outcome is Outcome.TIMEOUT or outcome is Outcome.GONE:
            _ENDS[outcome].inc()  # (the others end in the `hold` that continues it)
        then(outcome)

    def release(self) -> None:
        """No longer held (its wait ended, or a `hold` continues it): `then` not called."""
        if self.then is None:
            return
        self.then = None
        self.closing.discard(self.gone)
        self.waiters._leave(self)


def _on_grid(deadline: float, seconds: float) -> float:
    """`deadline` brought forward to the grid of `min(_GRID, seconds * _GRID_SHARE)` seconds:
    the held requests whose waits run out within one step of the grid are answered in one
    turn of the event loop, and their devices' renewals arrive together, so the loop's
    fixed cost per turn (its poll of the sockets, its timers, the interpreter handed between
    threads) is paid once per batch instead of once per request. Never later than asked
    (RFC 7240: the client waits at most N seconds), and never by more than a twentieth of
    the wait. MEASURED (`bench/fleet.py --polling waiting --quiet`, docs/benchmarks.md)."""
    step = min(_GRID, seconds * _GRID_SHARE)
    if step <= 0:
        return deadline
    return math.floor(deadline / step) * step


class Rewind:
    """An ASGI receive whose body messages a held request's disconnect watch reads are
    kept for whoever answers it after the hold (the Git backend reads the body)."""

    __slots__ = ("_kept", "_receive")

    def __init__(self, receive: Callable[[], Awaitable[Any]]) -> None:
        self._receive = receive
        self._kept: list[Any] = []

    async def __call__(self) -> Any:
        if self._kept:
            return self._kept.pop(0)
        return await self._receive()

    async def disconnected(self) -> None:
        """Return when the client disconnects, keeping what came before."""
        while (message := await self._receive())["type"] != "http.disconnect":
            self._kept.append(message)


def _watch_disconnect(ticket: _Ticket, receive: Callable[[], Awaitable[Any]],
                      closing: Closing | None) -> asyncio.Future[None] | None:
    """Resolve the ticket `GONE` when its client disconnects, as told by the connection's
    `closing` when there is one (None returned), else by a task reading `receive` (that
    task returned)."""
    if closing is not None:
        closing.add(ticket.gone)
        return None
    watch = asyncio.ensure_future(_disconnected(receive))
    watch.add_done_callback(ticket.gone)
    return watch


def _unwatch(ticket: _Ticket, watch: asyncio.Future[None] | None,
             receive: Callable[[], Awaitable[Any]], closing: Closing | None) -> None:
    """End a held request's disconnect watch once its wait is over. A `Rewind`'s watch is
    cancelled: it reads body messages that whoever answers next must get. A plain one is
    left to end by itself: the ASGI server reports a completed response to a pending
    `receive` as a disconnect (uvicorn and Starlette's test client do), while cancelling
    it threw an exception through its frames, CPU spent on every renewal (too little to
    tell apart in `bench/held_polls.py --renewals`, whose runs vary by more). An app that
    never answers would keep it until the connection closes, which then ends it."""
    if closing is not None:
        closing.discard(ticket.gone)
    elif watch is not None and isinstance(receive, Rewind):
        watch.cancel()


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Return when the client disconnects, or when its connection cannot be read any more (a
    body refused by `wfm.admission`). Body messages (a GET's one empty message) are skipped,
    or kept by a `Rewind`."""
    with contextlib.suppress(Exception):
        if isinstance(receive, Rewind):
            await receive.disconnected()
            return
        while (await receive())["type"] != "http.disconnect":
            pass


def wait_headers(seconds: int, outcome: Outcome) -> dict[str, str]:
    """What the answer of a request that went through `hold` says it did (RFC 7240):
    `Preference-Applied` when it was held (until its answer changed, its wait ran out or
    the server stopped), nothing when it was not (shed) or nobody reads it (gone)."""
    if outcome in (Outcome.SHED, Outcome.GONE):
        return {}
    return {"Preference-Applied": f"wait={seconds}"}


def prefer_values(headers: Sequence[tuple[bytes, bytes]]) -> list[str]:
    """Every `Prefer` header of an ASGI scope's headers, decoded leniently."""
    return [value.decode("latin-1") for name, value in headers if name == b"prefer"]
