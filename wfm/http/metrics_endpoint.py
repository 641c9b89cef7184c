"""`GET /metrics`, and the request counts it serves with the metric families
(`wfm.telemetry.metrics`).

Requests are counted by a pure ASGI middleware on every request, so it must cost next to
nothing: plain dict and list arithmetic on the event loop's thread (measured ~2 us a
request; `prometheus_client`'s labelled Counter + Histogram cost ~5 us there), turned into
metric families only when scraped. Labels are the route template (never the raw path),
the method (unknown methods folded into `other`) and the status code: bounded whatever
clients send. A scrape needs the metrics token or an operator credential of the viewer
role when the server has either.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wfm.identity.credentials import same_secret
from wfm.identity.operators import OperatorAuth, Role, bearer_token, refusal
from wfm.problems import ProblemError
from wfm.telemetry.metrics import PROCESS, TEXT_FORMAT
from wfm.telemetry.routes import (
    COUNTS_SCOPE_KEY,
    ROUTE_CELL,
    UNMATCHED,
    answered_by,
    route_of,
)

__all__ = ["HttpStats", "MetricsEndpoint", "MetricsMiddleware", "RouteMiddleware", "route_of"]

#: Request latency buckets (seconds): polls answer in milliseconds, Git pushes in minutes.
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class RouteMiddleware:
    """Innermost: tells `MetricsMiddleware` which route answered. The middlewares between
    them pass copies of the scope down, and the router marks the copy it was given; the
    cell is shared by every copy. It gets the route's label, never the scope: a scope in a
    cell in that scope is a reference cycle, which only the collector frees. MEASURED
    (`bench/held_polls.py --renewals`, `gc.DEBUG_SAVEALL`): ten cyclic objects a request,
    the scope copies and what they held, about 1 s of young collections per two quiet
    minutes of 10,000 waiting devices."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            answered_by(scope, route_of(scope))


class _Series:
    """One (route, method, code) series: a request count and a latency histogram."""

    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(HTTP_BUCKETS) + 1)
        self.count = 0
        self.total = 0.0


class HttpStats:
    """Requests by route, method and code, written only from the event loop's thread;
    a scrape reads a copy from a worker thread (a request counted meanwhile shows up in
    the next scrape)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str, int], _Series] = {}

    def observe(self, route: str, method: str, code: int, seconds: float) -> None:
        key = (route, method if method in _METHODS else "other", code)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series()
        series.buckets[bisect.bisect_left(HTTP_BUCKETS, seconds)] += 1
        series.count += 1
        series.total += seconds

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily(
            "margo_http_requests", "HTTP requests answered, by route template, method and "
            "status code.", labels=["route", "method", "code"])
        latency = HistogramMetricFamily(
            "margo_http_request_duration_seconds", "Time from a request's arrival to the "
            "end of its answer, by route template and method.", labels=["route", "method"])
        merged: dict[tuple[str, str], tuple[list[int], float]] = {}
        for (route, method, code), series in list(self.series.items()):
            requests.add_metric([route, method, str(code)], series.count)
            buckets, total = merged.get((route, method), ([0] * len(series.buckets), 0.0))
            merged[(route, method)] = ([a + b for a, b in zip(buckets, series.buckets,
                                                               strict=True)],
                                       total + series.total)
        for (route, method), (buckets, total) in sorted(merged.items()):
            cumulative, running = [], 0
            for bound, count in zip((*HTTP_BUCKETS, float("inf")), buckets, strict=True):
                running += count
                cumulative.append((_bound(bound), running))
            latency.add_metric([route, method], cumulative, total)
        yield requests
        yield latency


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)


class MetricsMiddleware:
    """Counts every HTTP request (outermost, so refusals by the body guards count too)."""

    def __init__(self, app: ASGIApp, stats: HttpStats) -> None:
        self.app, self.stats = app, stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()  # (a held request: its answer comes through here too)
        code = 500  # an exception escaping the app is answered 500 further out
        cell: list[str] = []
        scope[ROUTE_CELL] = cell
        scope[COUNTS_SCOPE_KEY] = self.stats  # (what a renewal on the wire is counted in)

        async def sending(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.stats.observe(cell[0] if cell else UNMATCHED, scope["method"], code,
                               time.perf_counter() - start)


class _Registered(Collector):
    """A callable's metric families as a `prometheus_client` collector."""

    def __init__(self, families: Any) -> None:
        self._families = families

    def collect(self) -> Iterator[Any]:
        yield from self._families()


class MetricsEndpoint:
    """`GET /metrics`. Who may read it: the scrape token (`--metrics-token-file`) or an
    operator of the viewer role (`auth`: the admin token, registered operators, OIDC), as
    `Authorization: Bearer`; nobody needs one when the server has neither (development, as
    the read API). The fleet's figures are computed in a worker thread: never on the event
    loop."""

    def __init__(self, stats: HttpStats, *collectors: Any,
                 tokens: tuple[str | None, ...] = (),
                 auth: OperatorAuth | None = None) -> None:
        self._tokens = tuple(t for t in tokens if t)
        self._auth = auth
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Registered(stats.collect))
        for collector in collectors:
            self._registry.register(_Registered(collector))

    def _authorize(self, request: Request) -> None:
        auth = self._auth
        if not self._tokens and (auth is None or auth.open):
            return
        token = bearer_token(request)
        if token is not None and any(same_secret(token, t) for t in self._tokens):
            return
        caller = auth.authenticate(token) if auth is not None and auth.configured else None
        if caller is not None:
            if not caller.may(Role.VIEWER):
                raise refusal(caller, Role.VIEWER)
            return
        raise ProblemError(401, "a metrics scrape token or an operator credential is "
                           "required", headers={"WWW-Authenticate":
                                                'Bearer realm="margo-gitops"'})

    def render(self) -> bytes:
        return generate_latest(PROCESS) + generate_latest(self._registry)

    async def serve(self, request: Request) -> Response:
        self._authorize(request)
        body = await run_in_threadpool(self.render)
        return Response(body, media_type=TEXT_FORMAT)
