"""A request through the server's middlewares leaves no reference cycle behind: what a
request allocates is freed by reference counting as it ends, so request traffic does not
drive the cyclic collector, whose collections stop the event loop for as long as they walk
(`wfm.server.gcpolicy`). The route cell of `RouteMiddleware` once held the scope that held
it: ten cyclic objects a request (`bench/held_polls.py --renewals` under `gc.DEBUG_SAVEALL`).

Starlette's own stack, `Parking` (a held request is answered from there, and renewed on its
connection) and the metrics middlewares, as `create_app` orders them, driven over ASGI on
one event loop; the collector's own count of what it found unreachable is the measure."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route

from wfm.admission.parking import CONNECTION_SCOPE_KEY, PARKED, Parking, park, parking_slot
from wfm.http.metrics_endpoint import HttpStats, MetricsMiddleware, RouteMiddleware
from wfm.server.closing import ConnectionClosing


async def _plain(request: Request) -> Response:
    return PlainTextResponse("ok")


async def _held(request: Request) -> Response:
    """Parks its request (the waiting poll's way); `Parking` answers it."""

    async def hold() -> Response:
        await asyncio.sleep(0)
        return Response(status_code=304)

    return PARKED if park(request.scope, hold) else await hold()


class _Renewing:
    """A held request that, answered, leaves itself as the renewal of the same request, and
    refers to its connection (as a held poll does, through its `Closing`)."""

    renewed = 0

    def __init__(self, scope: dict[str, Any]) -> None:
        self.slot, self.connection = parking_slot(scope), scope.get(CONNECTION_SCOPE_KEY)

    async def answer(self) -> Response:
        await asyncio.sleep(0)
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.renewal = self
        return Response(status_code=304)

    async def renew(self, scope: dict[str, Any], receive: Any) -> _Renewing:
        self.slot = parking_slot(scope)
        _Renewing.renewed += 1
        return self


async def _renewing(request: Request) -> Response:
    renewing = _Renewing(request.scope)
    return PARKED if park(request.scope, renewing.answer) else await renewing.answer()


def _app(stats: HttpStats) -> Starlette:
    return Starlette(routes=[Route("/plain/{name}", _plain),
                             Route("/held", _held), Route("/renewing", _renewing),
                             Mount("/mounted", routes=[Route("/{name}", _plain)])],
                     middleware=[Middleware(MetricsMiddleware, stats=stats), Middleware(Parking),
                                 Middleware(RouteMiddleware)])


async def _request(app: Starlette, path: str, headers: list[tuple[bytes, bytes]],
                   connection: ConnectionClosing | None = None) -> int:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    if connection is not None:
        scope[CONNECTION_SCOPE_KEY] = connection
    await app(scope, receive, send)
    return int(sent[0]["status"])


def test_requests_leave_no_cyclic_garbage() -> None:
    stats = HttpStats()
    app = _app(stats)

    async def scenario() -> tuple[list[int], int]:
        statuses = [await _request(app, "/plain/warm-up", [])]  # the stack is built once
        gc.collect()
        gc.disable()
        try:
            for index in range(50):
                statuses.append(await _request(app, f"/plain/{index}", []))
                statuses.append(await _request(app, f"/mounted/{index}", []))
                statuses.append(await _request(app, "/held", [(b"prefer", b"wait=1")]))
                statuses.append(await _request(app, "/nowhere", []))
            return statuses, gc.collect()
        finally:
            gc.enable()

    statuses, unreachable = asyncio.run(scenario())
    assert statuses.count(200) == 101 and statuses.count(304) == 50
    assert statuses.count(404) == 50
    assert unreachable == 0
    routes = {route for route, _, _ in stats.series}
    assert {"/plain/{name}", "/mounted/{name}", "/held", "unmatched"} <= routes


def test_renewals_on_a_connection_leave_no_cyclic_garbage() -> None:
    """A renewal kept on a connection refers back to it (a held poll's `Closing`); taken by
    the next request, or dropped when the connection closes, it leaves nothing for the
    collector — also when the connection closed before the answer that keeps it."""
    stats = HttpStats()
    app = _app(stats)
    waiting = [(b"prefer", b"wait=1")]

    async def scenario() -> tuple[list[int], int]:
        statuses = [await _request(app, "/renewing", waiting, ConnectionClosing())]
        gc.collect()
        gc.disable()
        try:
            for _ in range(10):
                connection = ConnectionClosing()
                for _ in range(5):  # the first down the stack, the next four renewed
                    statuses.append(await _request(app, "/renewing", waiting, connection))
                assert connection.kept is not None
                connection.close()
                closed = ConnectionClosing()
                closed.close()
                statuses.append(await _request(app, "/renewing", waiting, closed))
                assert closed.kept is None
            return statuses, gc.collect()
        finally:
            gc.enable()

    renewed = _Renewing.renewed
    statuses, unreachable = asyncio.run(scenario())
    assert _Renewing.renewed - renewed == 40
    assert statuses == [304] * 61
    assert unreachable == 0
    assert stats.series[("/renewing", "GET", 304)].count == 61
