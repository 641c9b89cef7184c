"""A waiting device's renewal, answered below uvicorn's request cycle.

While nothing changes, all a waiting device costs the server is its renewal: the poll it
sends again, on the same connection, as soon as its wait ended in a 304
(`wfm.admission.parking`). A renewal that went through uvicorn cost what any request costs
there: the parser calling back into Python for the request line and each header, a scope,
a request cycle and its task, Starlette's and the middlewares' frames around the hold, and
the collector walking all of those while the request is held. MEASURED (`bench/fleet.py
--polling waiting --quiet`, docs/benchmarks.md): about as much as a plain poll, so waiting
devices cost a quarter of what polling every 15 s does, one request a minute against four.

So this mixin for uvicorn's httptools protocol looks at what arrives before the parser
does. When a connection holds a kept renewal (`Connection.kept`), nothing is half-parsed or
in flight on it, and the bytes that arrive in one read are exactly those of the request
the renewal renews (`Connection.arrived`, which this mixin records: the bytes of a read
that held exactly one whole GET), the request is already known: its scope is the one
kept. The renewal runs here and now (`Renewal.renew`, which does not wait when what it
reads is in memory) and holds the request again without a request cycle, a task or a
coroutine: a ticket of the waiters' (`Waiters.hold_soon`). When its wait runs out, the 304
is written by a request cycle of uvicorn's own (its headers, the date, keep-alive, the
access log) made only then. MEASURED (`bench/fleet.py --polling waiting --quiet`,
docs/benchmarks.md). Everything else goes on in a request cycle and its task, as any
request: a renewal that waits on the database, or is declined (the caller refused now,
the answer changed: the whole app answers it); a held one that a wake or the server's
stop ends, or that more bytes arrive behind (`Waiters.hold`, to the same deadline). Any
other bytes (a request in two reads, two in one, a body, another request) are parsed as
always.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from wfm.admission.parking import (
    PARKING_SCOPE_KEY,
    Connection,
    Held,
    ParkingSlot,
    observe_renewal,
    renew_on_wire,
    renewed_on_wire,
)
from wfm.fleet.waiters import Outcome, SoonHold
from wfm.server.closing import closing_protocol

__all__ = ["wire_protocol"]

#: Only a GET is ever renewed: the bytes of any other request are not kept (a connection
#: would hold its last status report's until its next request).
_GET = b"GET "


class _WireHeld(Held, Protocol):
    """A renewal's request held again, as the wire holds it without a coroutine: the
    waiting polls' (`wfm.http.manifest_waits`, `wfm.git.refwaits`)."""

    until: float | None  # where the next `answer` ends a hold it continues

    def hold_soon(self, then: Callable[[Outcome], None]) -> SoonHold | None: ...

    def timed_out(self) -> Response: ...


class _Renewing:
    """The app a renewal's request cycle runs: `renew_on_wire` for its kept renewal (begun,
    or held, on the wire already)."""

    __slots__ = ("app", "held", "kept", "renewing", "start")

    def __init__(self, kept: Any, app: ASGIApp, *, start: float,
                 renewing: Awaitable[Held | None] | None = None,
                 held: Held | None = None) -> None:
        self.kept, self.app, self.start = kept, app, start
        self.renewing, self.held = renewing, held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await renew_on_wire(self.kept, scope, receive, send, self.app,
                            renewing=self.renewing, held=self.held, start=self.start)


class _OnWire:
    """A renewal held on the wire: no request cycle, no task, no coroutine; its `SoonHold`
    calls it when the hold ends."""

    __slots__ = ("held", "hold", "kept", "protocol", "scope", "start")

    def __init__(self, protocol: _WireRenewals, kept: Any, held: _WireHeld, scope: Scope,
                 start: float) -> None:
        self.protocol, self.kept, self.held, self.scope = protocol, kept, held, scope
        self.start = start
        self.hold: SoonHold | None = None

    def __call__(self, outcome: Outcome) -> None:
        self.protocol._wire_ended(self, outcome)


class _Begun:
    """A coroutine run until it first waited (`_run_now`), awaited for the rest."""

    __slots__ = ("coroutine", "waiting")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self.coroutine, self.waiting = coroutine, waiting

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, waiting = self.coroutine, self.waiting
        while True:
            try:
                sent = yield waiting
            except BaseException as exc:  # (thrown in by the task that awaits it)
                try:
                    waiting = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waiting = coroutine.send(sent)
                except StopIteration as done:
                    return done.value


def _run_now(coroutine: Coroutine[Any, Any, Any]) -> tuple[Any, _Begun | None]:
    """Run `coroutine` here and now: its result when it never waited (what it raises is
    raised), else what awaits the rest of it."""
    try:
        waiting = coroutine.send(None)
    except StopIteration as done:
        return done.value, None
    return None, _Begun(coroutine, waiting)


async def _no_receive() -> Message:
    """A renewal held on the wire has no ASGI receive: its connection tells of a
    disconnect (`wfm.server.closing`), and a GET has no body."""
    raise RuntimeError("a renewal held on the wire reads nothing")


class _WireRenewals:
    """A mixin for uvicorn's httptools protocol, over `wfm.server.closing`'s, whose
    connection it reads and tells what arrived (module docstring)."""

    _closing: Connection
    app: ASGIApp
    app_state: dict[str, Any]
    cycle: Any
    pipeline: Any
    parser: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._in_message = False
        self._begun = self._completed = 0
        self._on_wire: _OnWire | None = None
        super().connection_made(transport)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._on_wire is not None:  # more bytes while a renewal is held on the wire
            self._continue_in_cycle(self._on_wire)
        connection = self._closing
        kept = connection.kept
        idle = self._idle()
        if kept is not None and idle and kept.raw == data:
            connection.kept = None
            self._unset_keepalive_if_required()  # type: ignore[attr-defined]
            self._renew(kept)
            return
        self._begun = self._completed = 0
        super().data_received(data)  # type: ignore[misc]
        whole = idle and self._begun == 1 and self._completed == 1
        connection.arrived = data if whole and data.startswith(_GET) else None

    def shutdown(self) -> None:
        if self._on_wire is not None:  # answered by a request cycle, which uvicorn closes
            self._continue_in_cycle(self._on_wire)
        super().shutdown()  # type: ignore[misc]

    def on_message_begin(self) -> None:
        self._in_message = True
        self._begun += 1
        super().on_message_begin()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._in_message = False
        self._completed += 1
        super().on_message_complete()  # type: ignore[misc]

    def cycle_made(self, cycle: Any) -> None:
        """A request cycle was made (a protocol mixed in outside may dress its transport)."""

    def _idle(self) -> bool:
        """Nothing half-parsed, queued, held or being answered on this connection."""
        cycle = self.cycle
        return (not self._in_message and not self.pipeline and self._on_wire is None
                and (cycle is None or cycle.response_complete))

    def _renew(self, kept: Any) -> None:
        """Renew `kept` here and now, and hold it again on the wire; whatever of it waits
        or declines goes on in a request cycle (module docstring)."""
        start = time.perf_counter()
        scope: Any = {**kept.scope, PARKING_SCOPE_KEY: ParkingSlot()}
        try:
            held, begun = _run_now(kept.renewal.renew(scope, _no_receive))
        except Exception:  # a refusal, a failing store: the stack answers it
            self._in_cycle(scope, self.app)
            return
        if begun is not None:
            self._in_cycle(scope, _Renewing(kept, self.app, start=start, renewing=begun))
        elif held is None:
            self._in_cycle(scope, self.app)
        else:
            renewed_on_wire()
            self._hold_on_wire(_OnWire(self, kept, held, scope, start))

    def _hold_on_wire(self, on: _OnWire) -> None:
        self._on_wire = on
        hold = on.held.hold_soon(on)
        if hold is None:
            if self._on_wire is on:  # (not held: `hold` answers it)
                self._continue_in_cycle(on)
            return
        on.hold = hold

    def _wire_ended(self, on: _OnWire, outcome: Outcome) -> None:
        """`on`'s hold ended: a 304 written here when its wait ran out, nothing when its
        client went away, anything else answered by a request cycle."""
        if self._on_wire is not on:
            return
        this: Any = self
        if outcome is Outcome.GONE or this.transport.is_closing():
            self._on_wire = None
            observe_renewal(on.kept, "GET", 304, on.start)
        elif outcome is Outcome.TIMEOUT and not this.flow.write_paused:
            self._on_wire = None
            self._answer_on_wire(on)
        else:
            self._continue_in_cycle(on)

    def _answer_on_wire(self, on: _OnWire) -> None:
        """The 304 of a wait that ran out, written as uvicorn writes a request cycle's (its
        status line, its default headers with the date, `connection: close` and the close
        when the connection is not kept alive, the access log, then what it does once a
        response is complete: the keep-alive timeout), and the renewal kept again."""
        this: Any = self
        scope = on.scope
        response = on.held.timed_out()
        self._closing.keep(on.kept)  # (the same request again: the same `_Kept`)
        keep_alive = self._keep_alive(scope)
        if this.access_log and this.access_logger.isEnabledFor(logging.INFO):
            _log_access(this.access_logger, scope, response.status_code)
        this.transport.write(_head(response, this.server_state.default_headers, keep_alive))
        if not keep_alive:
            this.transport.close()
        this.on_response_complete()
        observe_renewal(on.kept, "GET", response.status_code, on.start)

    def _continue_in_cycle(self, on: _OnWire) -> None:
        """Go on with `on`'s hold (to the same deadline) and answer it in a request cycle."""
        self._on_wire = None
        if on.hold is not None:
            on.hold.release()
            on.held.until = on.hold.deadline
        self._in_cycle(dict(on.scope), _Renewing(on.kept, self.app, start=on.start,
                                                 held=on.held))

    def _in_cycle(self, scope: Any, app: ASGIApp) -> None:
        """Run `app` for this renewal's request on a request cycle of its own."""
        scope["state"] = self.app_state.copy()
        this: Any = self
        this._start_asgi_task(self._cycle(scope), app)

    def _keep_alive(self, scope: Any) -> bool:
        """Whether the connection is kept alive after this request's answer (as uvicorn
        tells it when it makes a request cycle)."""
        return bool(scope.get("http_version") != "1.0" and self.parser.should_keep_alive())

    def _cycle(self, scope: Any) -> Any:
        """A request cycle of uvicorn's for the request `scope` is, all of it arrived."""
        this: Any = self
        cycle = RequestResponseCycle(
            scope=scope, transport=this.transport, flow=this.flow, logger=this.logger,
            access_logger=this.access_logger, access_log=this.access_log,
            default_headers=this.server_state.default_headers,
            message_event=asyncio.Event(), expect_100_continue=False,
            keep_alive=self._keep_alive(scope), on_response=this.on_response_complete)
        cycle.more_body = False  # (a request without a body, all of it arrived)
        cycle.message_event.set()
        self.cycle_made(cycle)
        self.cycle = cycle
        return cycle


def _head(response: Response, default_headers: list[tuple[bytes, bytes]],
          keep_alive: bool) -> bytes:
    """A bodiless answer's head as uvicorn's request cycle writes it (`response`'s headers
    are ours, checked by Starlette: a 304's, no content-length)."""
    lines = [STATUS_LINE[response.status_code]]
    for name, value in (*default_headers, *response.raw_headers):
        lines += (name.lower(), b": ", value, b"\r\n")
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _log_access(logger: Any, scope: Any, status: int) -> None:
    """The access log's line for an answer, as uvicorn's request cycle logs it (asked only
    when the line is kept: under `margo serve --log-level warning` its client address and
    path would be built for nothing, at every renewal)."""
    logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                get_path_with_query_string(scope), scope["http_version"], status)


def wire_protocol(base: type) -> type:
    """`base`, an httptools protocol class of uvicorn's, giving each request its connection
    (`wfm.server.closing.closing_protocol`) and answering renewals below its request cycle
    (module docstring)."""
    return type(f"Wire{base.__name__}", (_WireRenewals, closing_protocol(base)), {})
