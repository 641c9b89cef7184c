"""A held request waits outside the ASGI stack and is answered from there
(`wfm.admission.parking`), on a real Starlette app driven in-process through httpx's ASGI
transport: while it waits no middleware inside `Parking` keeps a frame; the answer goes
out through the middlewares outside it, once, and not again through those inside; what the
hold raises goes back through the stack to the app's exception handlers; a request that
cannot wait never gets a slot. The server-level checks (rc.3 and rc.2 polls counted once,
over their whole time, by `margo serve`'s request metrics) are in
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

from wfm.admission.parking import PARKED, PARKING_SCOPE_KEY, Parking, park, raise_parked_failure
from wfm.problems import ProblemError, problem_response


class _Counting:
    """A middleware that counts the answers it passes out, by status, in `answers`."""

    def __init__(self, app: ASGIApp, answers: list[int]) -> None:
        self.app, self.answers = app, answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.answers.append(message["status"])
            await send(message)

        await self.app(scope, receive, sending)


class _Outside(_Counting):
    """The same, outside `Parking` (as the request metrics are)."""


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


#: What the middlewares outside and inside `Parking` passed out.
OUTSIDE: list[int] = []
INSIDE: list[int] = []


def _app(hold: _Hold, *, parking: bool = True,
         mounted: bool = False) -> tuple[Starlette, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    OUTSIDE.clear()
    INSIDE.clear()

    async def handler(request: Request) -> Response:
        seen.append({"slot": PARKING_SCOPE_KEY in request.scope})
        raise_parked_failure(request.scope)
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
                    middleware=[Middleware(_Outside, answers=OUTSIDE), *middleware,
                                Middleware(_Counting, answers=INSIDE)],
                    exception_handlers={ProblemError: problem})
    return app, seen


def _coroutines(qualname: str, answers: list[int] | None = None) -> int:
    """Coroutines of that name alive now (of the `_Counting` that fills `answers`)."""
    return sum(1 for o in gc.get_objects()
               if asyncio.iscoroutine(o) and getattr(o, "__qualname__", "") == qualname
               and (answers is None or getattr(o.cr_frame.f_locals.get("self"), "answers",
                                               None) is answers))


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
    hold = _Hold()
    app, seen = _app(hold)

    async def frames() -> tuple[int, int]:
        return (_coroutines("_Counting.__call__", INSIDE),
                _coroutines("Parking.__call__"))

    response, (inner, outer) = asyncio.run(
        _during(app, hold, "GET", {"Prefer": "wait=5"}, frames))
    assert (inner, outer) == (0, 1)  # held: only `Parking` waits
    assert (response.status_code, response.text) == (200, "late")
    assert response.headers["preference-applied"] == "wait=5"
    assert OUTSIDE == [200]  # answered through the middlewares outside, once,
    assert INSIDE == []  # not again through those inside,
    assert seen == [{"slot": True}]  # nor the handler: parked, then answered by `Parking`


def test_a_parked_request_under_a_mount_comes_back_to_its_route() -> None:
    """The Git ref advertisement is mounted: its held answer leaves from `Parking` too."""
    hold = _Hold()
    app, seen = _app(hold, mounted=True)

    async def nothing() -> None:
        return None

    response, _ = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, nothing,
                                      "/git/poll"))
    assert (response.status_code, response.text, OUTSIDE, INSIDE) == (200, "late", [200], [])
    assert seen == [{"slot": True}]


def test_without_parking_the_handler_holds_the_request_itself() -> None:
    """Served without `Parking` (no slot), `park` declines and the handler awaits the hold
    inside the stack: the same answer, the middleware's frame kept meanwhile."""
    hold = _Hold()
    app, seen = _app(hold, parking=False)

    async def frames() -> int:
        return _coroutines("_Counting.__call__", INSIDE)

    response, inner = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, frames))
    assert inner == 1
    assert (response.status_code, response.text, OUTSIDE, INSIDE) == (200, "late", [200],
                                                                      [200])
    assert seen == [{"slot": False}]


def test_what_the_hold_raises_is_answered_by_the_apps_exception_handlers() -> None:
    """Routing writes into the scope it is given (a mount's root path): the second pass
    gets a copy of its own, and finds the same route."""
    hold = _Hold(ProblemError(503, "the fleet's newest desired state is not here yet",
                              retry_after=1))
    app, seen = _app(hold, mounted=True)

    async def nothing() -> None:
        return None

    response, _ = asyncio.run(_during(app, hold, "GET", {"Prefer": "wait=5"}, nothing,
                                      "/git/poll"))
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["retry-after"] == "1"
    assert response.json()["detail"] == "the fleet's newest desired state is not here yet"
    assert (OUTSIDE, INSIDE) == ([503], [503])  # back through the stack, answered once
    assert seen == [{"slot": True}, {"slot": True}]


def test_a_request_that_cannot_wait_gets_no_slot() -> None:
    """Only a GET asking for a wait is given a slot; any other request passes `Parking`
    untouched (and a handler's `park` declines, so it holds in place)."""
    for method, headers in (("GET", {}), ("POST", {"Prefer": "wait=5"})):
        hold = _Hold()
        app, seen = _app(hold)

        async def nothing() -> None:
            return None

        response, _ = asyncio.run(_during(app, hold, method, headers, nothing))
        assert (response.status_code, response.text) == (200, "late")
        assert seen == [{"slot": False}]
