"""Which route answered a request, for the request metrics.

`MetricsMiddleware` (`wfm.http.metrics_endpoint`) is outermost and counts every request by
the route template that answered it; the router that knows it is innermost. A cell in the
scope carries it out: `RouteMiddleware` fills it as the router's answer leaves, and a held
poll's renewal, which never reaches the router (`wfm.admission.parking`), fills it with the
route that answered the same request before (`answered_route`, then `answered_by`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol

__all__ = ["COUNTS_SCOPE_KEY", "ROUTE_CELL", "UNMATCHED", "RequestCounts", "answered_by",
           "answered_route", "counts_of", "route_of"]

#: The scope key of the cell (a list, shared by every copy of the scope) where the route
#: that answered is left.
ROUTE_CELL = "margo.metrics.route"
#: The label of a request no route answered.
UNMATCHED = "unmatched"
#: The scope key of the request counts `MetricsMiddleware` adds to: a renewal answered
#: below the request stack (`wfm.server.wire`) is counted there by whoever answers it.
COUNTS_SCOPE_KEY = "margo.metrics.counts"


class RequestCounts(Protocol):
    """Where answered requests are counted (`wfm.http.metrics_endpoint.HttpStats`)."""

    def observe(self, route: str, method: str, code: int, seconds: float) -> None: ...


def counts_of(scope: Mapping[str, Any]) -> RequestCounts | None:
    """The request counts this request is counted in, if it is counted."""
    return scope.get(COUNTS_SCOPE_KEY)


def route_of(scope: Mapping[str, Any]) -> str:
    """The route template that answered (`/api/v1/deployments/{deploymentId}/status`),
    with the mount's prefix for mounted apps (`/git` + `/{device}.git/info/refs`), or
    `unmatched`: 404s (their paths are whatever a client sent) and requests refused
    before routing (a body over its limit or budget)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path is None:
        return UNMATCHED
    return str(scope.get("root_path", "")) + str(path)


def answered_by(scope: MutableMapping[str, Any], route: str) -> None:
    """Leave `route` in the request's cell (when the request is counted: it has one)."""
    cell = scope.get(ROUTE_CELL)
    if cell is not None:
        cell.append(route)


def answered_route(scope: Mapping[str, Any]) -> str | None:
    """The route left in the request's cell so far, if any."""
    cell = scope.get(ROUTE_CELL)
    return cell[0] if cell else None
