"""A held request waits outside the ASGI stack and goes back through it to be answered
(`wfm.admission.parking`), on a real Starlette app driven in-process through httpx's ASGI
transport: while it waits no middleware inside `Parking` keeps a frame; the answer goes
through every middleware once; what the hold raises is answered by the app's exception
handlers; a request that cannot wait never gets a slot. The server-level checks (rc.3 and
rc.2 polls counted once, over their whole time, by `margo serve`'s request metrics) are in
tests/wfm/test_waiting_polls_server.py."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wfm.admission.parking import PARKED, PARKING_SCOPE_KEY, Parking, park, parked_answer
from wfm.problems import ProblemError, problem_response


class _Counting:
    """A middleware inside `Parking`: counts the answers it passes out, per status."""

    answers: list[int]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                _Counting.answers.append(message["status"])
            await send(message)

        await self.app(scope, receive, sending)


class _Hold:
    """What the handler leaves to `Parking`: waits for `release`, then answers (or raises
    `failure`)."""

    def __init__(self, failure: Exception | None = None) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.failure = failure

    async def __call__(self) -> Response:
        self.entered.set()
        await self.release.wait()
        if self.failure is not None:
            raise self.failure
        return PlainTextResponse("late", headers={"Preference-Applied": "wait=5"})


def _app(hold: _Hold, *, parking: bool = True,
         mounted: bool = False) -> tuple[Starlette, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    async def handler(request: Request) -> Response:
        seen.append({"slot": PARKING_SCOPE_KEY in request.scope})
        answer = parked_answer(request.scope)
        if answer is not None:
            return answer
        if park(request.scope, hold):
            return PARKED
        return await hold()

    async def problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProblemError)
        return problem_response(exc)

    middleware = [Middleware(Parking)] if parking else []
    route = Route("/poll", handler, methods=["GET", "POST"])
    routes: list[BaseRoute] = [Mount("/git", routes=[route])] if mounted else [route]
    app = Starlette(routes=routes,
                    middleware=[*middleware, Middleware(_Counting)],
                    exception_handlers={ProblemError: problem})
    return app, seen


def _coroutines(qualname: str) -> int:
    return sum(1 for o in gc.get_objects()
               if asyncio.iscoroutine(o) and getattr(o, "__qualname__", "") == qualname)


async def _during(app: Starlette, hold: _Hold, method: str, headers: dict[str, str],
                  meanwhile: Callable[[], Awaitable[Any]],
                  path: str = "/poll") -> tuple[httpx.Response, Any]:
    """Send one request; once its hold is entered run `meanwhile`, then release it."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        sent = asyncio.ensure_future(http.request(method, path, headers=headers))
        await asyncio.wait_for(hold.entered.wait(), 5)
        found = await meanwhile()
        hold.release.set()
        return await asyncio.wait_for(sent, 5), found


def test_a_parked_request_keeps_no_middleware_frame_while_it_waits() -> None:
    _Counting.answers = []
    hold = _Hold()
    app, seen = _app(hold)

    async def frames() -> tuple[int, int]:
        return _coroutines("_Counting.__call__"), _coroutines("Parking.__call__")

    response, (inner, outer) = asyncio.run(
        _during(app, hold, "GET", {"Prefer": "wait=5"}, frames))
    assert (inner, outer) == (0, 1)  # held: only `Parking` waits
    assert (response.status_code, response.text) == (200, "late")
    assert response.headers["preference-applied"] == "wait=5"
    assert _Counting.answers == [200]  # answered through the stack, once
    assert seen == [{"slot": True}, {"slot": True}]  # parked, then back to be answered


def test_a_parked_request_under_a_mount_comes_back_to_its_route() -> None:
    """Routing writes into the scope it is given (a mount's root path): each pass gets its
    own copy, so the second finds the same route (the Git ref advertisement is mounted)."""
    _Counting.answers = []
    hold = _Hold()
    app, seen = _app(hold, mounted=True)

    async def nothing() -> None:
        return None

    response, _ = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, nothing,
                                      "/git/poll"))
    assert (response.status_code, response.text, _Counting.answers) == (200, "late", [200])
    assert seen == [{"slot": True}, {"slot": True}]


def test_without_parking_the_handler_holds_the_request_itself() -> None:
    """Served without `Parking` (no slot), `park` declines and the handler awaits the hold
    inside the stack: the same answer, the middleware's frame kept meanwhile."""
    _Counting.answers = []
    hold = _Hold()
    app, seen = _app(hold, parking=False)

    async def frames() -> int:
        return _coroutines("_Counting.__call__")

    response, inner = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, frames))
    assert inner == 1
    assert (response.status_code, response.text, _Counting.answers) == (200, "late", [200])
    assert seen == [{"slot": False}]


def test_what_the_hold_raises_is_answered_by_the_apps_exception_handlers() -> None:
    _Counting.answers = []
    hold = _Hold(ProblemError(503, "the fleet's newest desired state is not here yet",
                              retry_after=1))
    app, _ = _app(hold)

    async def nothing() -> None:
        return None

    response, _ = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, nothing))
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["retry-after"] == "1"
    assert response.json()["detail"] == "the fleet's newest desired state is not here yet"
    assert _Counting.answers == [503]


def test_a_request_that_cannot_wait_gets_no_slot() -> None:
    """Only a GET asking for a wait is given a slot; any other request passes `Parking`
    untouched (and a handler's `park` declines, so it holds in place)."""
    for method, headers in (("GET", {}), ("POST", {"Prefer": "wait=5"})):
        _Counting.answers = []
        hold = _Hold()
        app, seen = _app(hold)

        async def nothing() -> None:
            return None

        response, _ = asyncio.run(_during(app, hold, method, headers, nothing))
        assert (response.status_code, response.text) == (200, "late")
        assert seen == [{"slot": False}]
