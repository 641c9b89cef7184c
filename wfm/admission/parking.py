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

Renewals skip the stack too. A waiting device that was answered 304 after its wait sends
the very same request again at once, on the same connection, and keeps doing so for as
long as nothing changes: that renewal is all the server does for it. A hold that ends so
may leave a `Renewal` in its slot (`ParkingSlot.renewal`); `Parking` keeps it on the
request's `Connection` (`margo serve`'s HTTP protocol gives every request its connection:
`wfm.server.closing`) with what the request was: its path, query, headers (its
credentials among them), peer and TLS layer, and the route that answered it. The next
request on that connection that may wait and is that same request, byte for byte, is
offered to the renewal, which authenticates it again, looks whether its answer changed,
and holds it again as its handler would have; or declines, and the request goes down the
stack like any other (so does every request that is not the same). What the stack would
have done to it was done to the identical request before: routing, the body guards (a
request with a body is never kept), the signature check (a signed request leaves no
renewal: its signature is checked on every request). MEASURED (`bench/fleet.py --polling
waiting --quiet`, docs/benchmarks.md).

Below the stack, too. A renewal that arrives on its connection in one read, byte for byte
the bytes of the request it renews (`Connection.arrived`, told by `margo serve`'s HTTP
protocol: `wfm.server.wire`), is not parsed again nor sent through uvicorn's request
cycle, Starlette and the middlewares at all: the protocol renews it and holds it itself,
and `renew_on_wire` answers what goes on in a request cycle (counted in the request metrics
under the route that answered it before: `counts_of`, `observe_renewal`), or, declined,
hands it to the whole stack as any request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from wfm.telemetry.metrics import HELD_POLL_RENEWALS
from wfm.telemetry.routes import (
    UNMATCHED,
    answered_by,
    answered_route,
    counts_of,
)

__all__ = ["CONNECTION_SCOPE_KEY", "PARKED", "PARKING_SCOPE_KEY", "Connection", "Held",
           "Parking", "ParkingSlot", "Renewal", "answering", "observe_renewal", "park",
           "parking_slot", "raise_parked_failure", "renew_on_wire", "renewed_on_wire"]

#: Where a request's scope holds its `ParkingSlot` (every copy of the scope shares it).
PARKING_SCOPE_KEY = "margo.parking"
#: Where a request's scope holds its `Connection`, when the server's HTTP protocol gives
#: one (`wfm.server.closing`).
CONNECTION_SCOPE_KEY = "margo.connection"

#: What a parked request's hold resolves to: the answer `Parking` sends.
Hold = Callable[[], Awaitable[Response]]


class Held(Protocol):
    """A renewal's request, held again: its `answer` holds it, then answers it."""

    async def answer(self) -> Response:
        """Held until its answer changes or its wait runs out; then its answer."""
        ...


class Renewal(Protocol):
    """What a held request's hold leaves for the same request again on its connection
    (module docstring)."""

    async def renew(self, scope: Scope, receive: Receive) -> Held | None:
        """This request held again (`scope`, with its own `ParkingSlot`: where it may
        leave the next renewal), the same request again, when its caller is still admitted
        and its answer unchanged; None, or what refusing it raises: it goes down the stack
        (which answers the refusal as it would for any request)."""
        ...


#: What a request was, as far as a renewal must match it: path, query, headers, peer,
#: TLS layer (the ASGI `extensions`).
_Request = tuple[Any, ...]
#: What a kept request's scope keeps: what uvicorn makes a request's scope of, its TLS
#: layer and its connection (a renewal on the wire is answered, or handed to the stack,
#: with a scope made of them).
_SCOPE_KEPT = ("type", "asgi", "http_version", "server", "client", "scheme", "root_path",
               "headers", "method", "path", "raw_path", "query_string", "extensions",
               CONNECTION_SCOPE_KEY)


class _Kept:
    """A renewal kept on a connection, with the request it renews (what its scope was,
    and its bytes when they arrived in one read), the route that answered that request
    and the request counts it was counted in."""

    __slots__ = ("counts", "raw", "renewal", "route", "scope")

    def __init__(self, renewal: Renewal, scope: Scope) -> None:
        self.renewal = renewal
        self.scope = {key: scope[key] for key in _SCOPE_KEPT if key in scope}
        self.route, self.counts = answered_route(scope), counts_of(scope)
        self.raw: bytes | None = None


class Connection:
    """One connection as its requests see it, from one to the next: the renewal the last
    held answer on it left, and the bytes of its last request when they arrived whole in
    one read (module docstring)."""

    __slots__ = ("arrived", "kept")

    def __init__(self) -> None:
        self.kept: _Kept | None = None
        self.arrived: bytes | None = None

    def keep(self, kept: _Kept | None) -> None:
        """What the next request on this connection is offered (None: nothing); it renews
        the bytes that arrived last, when they did in one read."""
        if kept is not None and kept.raw is None:
            kept.raw = self.arrived
        self.kept = kept


class ParkingSlot:
    """One request's way out of the stack: the hold its handler left, what the hold raised
    (taken back through the stack to be answered), and the renewal it left for the same
    request again on its connection."""

    __slots__ = ("failure", "hold", "renewal")

    def __init__(self) -> None:
        self.hold: Hold | None = None
        self.failure: Exception | None = None
        self.renewal: Renewal | None = None


class _Parked(Response):
    """What the handler of a parked request returns: nothing is sent (`Parking` answers
    once the hold is over)."""

    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


#: Renewals taken, by how the request was told to be the same (`HELD_POLL_RENEWALS`).
_MATCHED_REQUEST = HELD_POLL_RENEWALS.labels("request")
_MATCHED_BYTES = HELD_POLL_RENEWALS.labels("bytes")

#: What a handler returns once it parked its request.
PARKED: Response = _Parked()


def _slot(scope: MutableMapping[str, Any]) -> ParkingSlot | None:
    slot = scope.get(PARKING_SCOPE_KEY)
    return slot if isinstance(slot, ParkingSlot) else None


def park(scope: MutableMapping[str, Any], hold: Hold) -> ParkingSlot | None:
    """Leave `hold` to `Parking` (its slot returned: return `PARKED`; the hold may leave a
    `Renewal` there), or None when this request cannot park (no slot: served without
    `Parking`, or already answering): then the caller awaits `hold` itself."""
    slot = _slot(scope)
    if slot is None or slot.hold is not None or answering(scope):
        return None
    slot.hold = hold
    return slot


def parking_slot(scope: MutableMapping[str, Any]) -> ParkingSlot | None:
    """The request's `ParkingSlot` (a renewed request's: where it leaves the next)."""
    return _slot(scope)


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
        connection = scope.get(CONNECTION_SCOPE_KEY)
        if not isinstance(connection, Connection):
            connection = None
        slot = ParkingSlot()
        scope = {**scope, PARKING_SCOPE_KEY: slot}
        hold = await _renewed(connection, scope, receive)
        if hold is None:
            # Each pass gets a copy: routing writes into the scope it is given (a mount's
            # root path, its path parameters), which a second pass must not find there.
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
        if connection is not None:
            connection.keep(_kept(slot, scope))
        await answer(scope, receive, send)


def _request(scope: Scope) -> _Request:
    return (scope["path"], scope["query_string"], scope["headers"], scope.get("client"),
            scope.get("extensions"))


def _kept(slot: ParkingSlot, scope: Scope) -> _Kept | None:
    """What the connection keeps of a request whose hold ended: the renewal the hold left
    (taken from the slot), unless the request has a body (the body guards must see it)."""
    renewal, slot.renewal = slot.renewal, None
    if renewal is None:
        return None
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return None
    return _Kept(renewal, scope)


async def _renewed(connection: Connection | None, scope: Scope,
                   receive: Receive) -> Hold | None:
    """The hold the connection's renewal makes of this request, when it is the request the
    renewal was kept for (module docstring); the renewal is taken either way: it serves
    one request."""
    if connection is None or connection.kept is None:
        return None
    kept, connection.kept = connection.kept, None
    if _request(scope) != _request(kept.scope):
        return None
    hold = await _renewal_hold(kept, scope, receive, _MATCHED_REQUEST)
    if hold is not None and kept.route is not None:
        answered_by(scope, kept.route)  # counted under the route that answered it before
    return hold


async def _renewal_hold(kept: _Kept, scope: Scope, receive: Receive, matched: Counter,
                        renewing: Awaitable[Held | None] | None = None) -> Hold | None:
    """The hold `kept`'s renewal makes of the same request again (counted in `matched`),
    or None. `renewing`: its `renew` of this request, already begun (`wfm.server.wire`)."""
    try:
        held = await (renewing or kept.renewal.renew(scope, receive))
    except Exception:  # a refusal, a failing store: the stack answers it, as any request
        return None
    if held is None:
        return None
    matched.inc()
    return held.answer


async def renew_on_wire(kept: _Kept, scope: Scope, receive: Receive, send: Send,
                        app: ASGIApp, *, renewing: Awaitable[Held | None] | None = None,
                        held: Held | None = None, start: float | None = None) -> None:
    """Answer the same request again as `kept` renews, arrived on its connection byte for
    byte as before (`Connection.arrived`; `scope` made of `kept.scope` by the HTTP protocol
    that saw it, `wfm.server.wire`): held again and answered from here, counted where the
    request was counted, under the route that answered it; or, when the renewal declines
    or its hold raises, handed to `app` (the whole stack, which counts it itself) as any
    request, which answers it as it would have without a renewal. The wire may have begun
    the renewal (`renewing`), or renewed it already and held it (`held`, whose `answer`
    continues that hold), since `start`."""
    start = time.perf_counter() if start is None else start
    slot = scope.setdefault(PARKING_SCOPE_KEY, ParkingSlot())  # (the stack's has its own)
    if held is not None:
        hold: Hold | None = held.answer
    else:
        hold = await _renewal_hold(kept, scope, receive, _MATCHED_BYTES, renewing)
    answer = None
    if hold is not None:
        try:
            answer = await hold()
        except Exception:  # a refusal at a wake, a failing store: answered by the stack
            answer = None
    if answer is None:
        await app(scope, receive, send)
        return
    renewal, slot.renewal = slot.renewal, None
    connection = scope.get(CONNECTION_SCOPE_KEY)
    if renewal is not None and isinstance(connection, Connection):
        kept.renewal = renewal  # (the same request again: the same `_Kept`)
        connection.keep(kept)
    await answer(scope, receive, send)
    observe_renewal(kept, scope["method"], answer.status_code, start)


def observe_renewal(kept: _Kept, method: str, status: int, start: float) -> None:
    """Count a renewal answered where its request was counted, under the route that
    answered it (`counts_of`), over its time since `start`."""
    if kept.counts is not None:
        kept.counts.observe(kept.route or UNMATCHED, method, status,
                            time.perf_counter() - start)


def renewed_on_wire() -> None:
    """Count a renewal the wire held again itself (`wfm.server.wire`), as `renew_on_wire`
    counts its own."""
    _MATCHED_BYTES.inc()
