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
kept, and `renew_on_wire` holds it again on a request cycle of uvicorn's own, which writes
the answer as it writes any (its headers, the date, keep-alive, the access log, the
server's graceful stop). A renewal declined (the caller refused now, the answer changed)
goes to the app as any request. Anything else (a request in two reads, two in one, a body,
another request) is parsed as always.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from wfm.admission.parking import Connection, renew_on_wire
from wfm.server.closing import closing_protocol

__all__ = ["wire_protocol"]

#: Only a GET is ever renewed: the bytes of any other request are not kept (a connection
#: would hold its last status report's until its next request).
_GET = b"GET "


class _Renewing:
    """The app a renewal's request cycle runs: `renew_on_wire` for its kept renewal."""

    __slots__ = ("app", "kept")

    def __init__(self, kept: Any, app: ASGIApp) -> None:
        self.kept, self.app = kept, app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await renew_on_wire(self.kept, scope, receive, send, self.app)


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
        super().connection_made(transport)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
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
        """Nothing half-parsed, queued or being answered on this connection."""
        cycle = self.cycle
        return (not self._in_message and not self.pipeline
                and (cycle is None or cycle.response_complete))

    def _renew(self, kept: Any) -> None:
        """Start `kept`'s renewal on a request cycle of its own (module docstring)."""
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

        scope: Any = {**kept.scope, "state": self.app_state.copy()}
        this: Any = self
        cycle = RequestResponseCycle(
            scope=scope, transport=this.transport, flow=this.flow, logger=this.logger,
            access_logger=this.access_logger, access_log=this.access_log,
            default_headers=this.server_state.default_headers,
            message_event=asyncio.Event(), expect_100_continue=False,
            keep_alive=scope.get("http_version") != "1.0" and self.parser.should_keep_alive(),
            on_response=this.on_response_complete)
        cycle.more_body = False  # (a request without a body, all of it arrived)
        cycle.message_event.set()
        self.cycle_made(cycle)
        self.cycle = cycle
        this._start_asgi_task(cycle, _Renewing(kept, self.app))


def wire_protocol(base: type) -> type:
    """`base`, an httptools protocol class of uvicorn's, giving each request its connection
    (`wfm.server.closing.closing_protocol`) and answering renewals below its request cycle
    (module docstring)."""
    return type(f"Wire{base.__name__}", (_WireRenewals, closing_protocol(base)), {})
