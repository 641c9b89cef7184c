"""A held request waits outside the ASGI stack, and its answer leaves from there.

Why: a waiting poll (`wfm.fleet.waiters`) held inside its handler keeps the whole stack
alive for up to a minute: a coroutine per middleware and per routing layer, the closures
each wraps `send` in, the requests and contexts they made. MEASURED (a census of the
server's heap with 10,000 held polls, `bench/fleet.py --polling waiting`): about 110
containers per held request, 1.1 million of the 1.4 million the collector walks. Every
young collection walked the new ones and every full one walked them all (the one after a
compile held the interpreter 1.4-1.8 s, in the push window when it came there), which cost
more per renewal than the renewal's own request.

So a request that may be held gets a `ParkingSlot` from `Parking` (just inside the request
metrics). The handler that decides to hold it `park`s instead: it leaves the slot an
awaitable that holds and then works out the answer, and returns `PARKED`, a response that
sends nothing; the stack inside `Parking` unwinds. `Parking` awaits the hold (one coroutine
of its own, the waiters' ticket, a timer) and sends the answer it came to itself, through
the middlewares outside it: the metrics count the request once, when answered, over its
whole time. Those inside it checked the request on its way in and have nothing to add to
an answer (no one of them changes a response), so the answer does not cross them again.
MEASURED (`bench/held_polls.py --connections 5000 --renewals 30`, three runs each): a
waiting device's renewal cost 1.40-2.01 times a plain poll answered 304 when the answer
went through the stack a second time, 1.06-1.21 times answered from here.

An exception the hold raises goes back through the stack: the handler raises it again
(`raise_parked_failure`) where the app's exception handlers turn it into the same problem
response as before; `answering` tells the middlewares inside that pass apart (a signature
is checked once, on the way in).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["PARKED", "PARKING_SCOPE_KEY", "Parking", "ParkingSlot", "answering", "park",
           "raise_parked_failure"]

#: Where a request's scope holds its `ParkingSlot` (every copy of the scope shares it).
PARKING_SCOPE_KEY = "margo.parking"

#: What a parked request's hold resolves to: the answer `Parking` sends.
Hold = Callable[[], Awaitable[Response]]


class ParkingSlot:
    """One request's way out of the stack: the hold its handler left, and what the hold
    raised (taken back through the stack to be answered)."""

    __slots__ = ("failure", "hold")

    def __init__(self) -> None:
        self.hold: Hold | None = None
        self.failure: Exception | None = None


class _Parked(Response):
    """What the handler of a parked request returns: nothing is sent (`Parking` answers
    once the hold is over)."""

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


def answering(scope: MutableMapping[str, Any]) -> bool:
    """Whether this is a parked request's second pass (its hold raised)."""
    slot = _slot(scope)
    return slot is not None and slot.failure is not None


def raise_parked_failure(scope: MutableMapping[str, Any]) -> None:
    """On a parked request's second pass, raise what its hold raised; nothing on any other
    pass."""
    slot = _slot(scope)
    if slot is not None and slot.failure is not None:
        failure, slot.failure = slot.failure, None
        raise failure


def _may_wait(scope: Scope) -> bool:
    """A GET that asks for a wait (`Prefer`): the only requests a handler holds."""
    return scope["method"] == "GET" and any(name == b"prefer" for name, _ in scope["headers"])


class Parking:
    """Parks the requests their handlers hold, and answers them (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _may_wait(scope):
            await self.app(scope, receive, send)
            return
        slot = ParkingSlot()
        scope = {**scope, PARKING_SCOPE_KEY: slot}
        # Each pass gets a copy: routing writes into the scope it is given (a mount's root
        # path, its path parameters), which a second pass must not find there.
        await self.app(dict(scope), receive, send)
        if slot.hold is None:
            return  # answered in place
        hold, slot.hold = slot.hold, None
        try:
            answer = await hold()
        except Exception as exc:  # raised again where the app's handlers answer it
            slot.failure = exc
            await self.app(dict(scope), receive, send)
            return
        await answer(scope, receive, send)
