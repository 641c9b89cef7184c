"""A held request waits outside the ASGI stack, and goes back through it to be answered.

Why: a waiting poll (`wfm.fleet.waiters`) held inside its handler keeps the whole stack
alive for up to a minute: a coroutine per middleware and per routing layer, the closures
each wraps `send` in, the requests and contexts they made. MEASURED (a census of the
server's heap with 10,000 held polls, `bench/fleet.py --polling waiting`): about 110
containers per held request, 1.1 million of the 1.4 million the collector walks. Every
young collection walked the new ones and every full one walked them all (the one after a
compile held the interpreter 1.4-1.8 s, in the push window when it came there), which cost
more per renewal than the renewal's own request.

So a request that may be held gets a `ParkingSlot` from `Parking` (the outermost
middleware). The handler that decides to hold it `park`s instead: it leaves the slot an
awaitable that holds and then works out the answer, and returns `PARKED`, a response that
sends nothing; the stack unwinds. `Parking` awaits the hold (one coroutine of its own, the
waiters' ticket, a timer) and then runs the request through the stack again, where the
handler hands back what the hold came to (`parked_answer`): every middleware sees the
answer as it would have, once. The middlewares that count or check a request know the two
passes apart (`parked`, `answering`): a request is counted once, when answered, over its
whole time; a signature is checked once, on the way in.

An exception the hold raises is kept and raised again by the handler on the answering pass,
where the app's exception handlers turn it into the same problem response as before.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["PARKED", "PARKING_SCOPE_KEY", "Parking", "ParkingSlot", "answering", "park",
           "parked", "parked_answer", "started"]

#: Where a request's scope holds its `ParkingSlot` (every copy of the scope shares it).
PARKING_SCOPE_KEY = "margo.parking"

#: What a parked request's hold resolves to: the answer, handed back on the second pass.
Hold = Callable[[], Awaitable[Response]]


class ParkingSlot:
    """One request's way out of the stack and back: the hold its handler left (first
    pass), then what the hold came to (second pass), and when the request began."""

    __slots__ = ("answer", "failure", "hold", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.hold: Hold | None = None
        self.answer: Response | None = None
        self.failure: Exception | None = None


class _Parked(Response):
    """The first pass's response of a parked request: nothing is sent (`Parking` answers
    on the second pass)."""

    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


#: What a handler returns once it parked its request.
PARKED: Response = _Parked()


def _slot(scope: MutableMapping[str, Any]) -> ParkingSlot | None:
    slot = scope.get(PARKING_SCOPE_KEY)
    return slot if isinstance(slot, ParkingSlot) else None


def park(scope: MutableMapping[str, Any], hold: Hold) -> bool:
    """Leave `hold` to `Parking` (True: return `PARKED`), or False when this request
    cannot park (no slot: served without `Parking`, or already answering): then the
    caller awaits `hold` itself."""
    slot = _slot(scope)
    if slot is None or slot.hold is not None or answering(scope):
        return False
    slot.hold = hold
    return True


def started(scope: MutableMapping[str, Any]) -> float | None:
    """When a request that may park began (`time.perf_counter()`), for what times it over
    both passes; None for any other request."""
    slot = _slot(scope)
    return slot.started if slot is not None else None


def parked(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request left the stack to wait (its first pass ends unanswered)."""
    slot = _slot(scope)
    return slot is not None and slot.hold is not None


def answering(scope: MutableMapping[str, Any]) -> bool:
    """Whether this is a parked request's second pass (its answer is ready)."""
    slot = _slot(scope)
    return slot is not None and (slot.answer is not None or slot.failure is not None)


def parked_answer(scope: MutableMapping[str, Any]) -> Response | None:
    """On a parked request's second pass, what its hold came to (raising what it raised);
    None on any other pass."""
    slot = _slot(scope)
    if slot is None:
        return None
    answer, failure = slot.answer, slot.failure
    slot.answer = slot.failure = None
    if failure is not None:
        raise failure
    return answer


def _may_wait(scope: Scope) -> bool:
    """A GET that asks for a wait (`Prefer`): the only requests a handler holds."""
    return scope["method"] == "GET" and any(name == b"prefer" for name, _ in scope["headers"])


class Parking:
    """Outermost middleware: parks the requests their handlers hold (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _may_wait(scope):
            await self.app(scope, receive, send)
            return
        slot = ParkingSlot(time.perf_counter())
        scope = {**scope, PARKING_SCOPE_KEY: slot}
        # Each pass gets a copy: routing writes into the scope it is given (a mount's root
        # path, its path parameters), which a second pass must not find there.
        await self.app(dict(scope), receive, send)
        while slot.hold is not None:
            hold, slot.hold = slot.hold, None
            try:
                slot.answer = await hold()
            except Exception as exc:  # raised again where the app's handlers answer it
                slot.failure = exc
            await self.app(dict(scope), receive, send)
