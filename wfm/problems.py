"""RFC 9457 problem details with the Margo problem types: the server's only error shape.

Handlers raise `ProblemError`; one exception handler renders it as
`application/problem+json`. Margo conditions use the registered Margo type URIs,
everything else `about:blank` with the HTTP reason phrase as title (digest section 6c).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from margo.errors import Problem

__all__ = ["MARGO_PROBLEM_BASE", "ProblemError", "problem_response", "semantic_error"]

MARGO_PROBLEM_BASE = "https://docs.margo.org/specification/problem-types#"
PROBLEM_JSON = "application/problem+json"

#: Margo problem names and their titles.
MARGO_TYPES = {
    "invalid-request": "Invalid Request",
    "semantic-error": "Semantic Error",
    "not-authorized": "Not Authorized",
    "gateway-not-found": "Gateway Not Found",
    "device-not-found": "Device Not Found",
    "invalid-bundle": "Invalid Bundle",
    "deployment-not-found": "Deployment Not Found",
    "server-cannot-generate-response": "Server Cannot Generate Response",
}


#: The title the spec suggests for a retired client's 403 (digest section 6a).
RETIRED = "Client Relationship Retired"


class ProblemError(Exception):
    """An error that becomes a problem+json response."""

    def __init__(self, status: int, detail: str, *, margo_type: str | None = None,
                 errors: Sequence[dict[str, str]] = (), retry_after: int | None = None,
                 headers: dict[str, str] | None = None, title: str | None = None):
        super().__init__(detail)
        self.status, self.detail, self.margo_type = status, detail, margo_type
        self.title = title  # overrides the type's standard title (e.g. a retired client)
        self.errors, self.retry_after = list(errors), retry_after
        self.headers = dict(headers or {})


def semantic_error(problems: Sequence[Problem], *, status: int = 422) -> ProblemError:
    """A 422 (or 400) listing every located problem of a rejected document."""
    errors = [{"field": p.json_path, "message": p.message} for p in problems]
    detail = "; ".join(f"{p.json_path}: {p.message}" for p in problems[:5])
    if len(problems) > 5:
        detail += f" (and {len(problems) - 5} more)"
    kind = "semantic-error" if status == 422 else "invalid-request"
    return ProblemError(status, detail, margo_type=kind, errors=errors)


def problem_response(error: ProblemError, *, instance: str | None = None) -> Response:
    body: dict[str, Any]
    if error.margo_type:
        body = {"type": MARGO_PROBLEM_BASE + error.margo_type,
                "title": error.title or MARGO_TYPES[error.margo_type]}
    else:
        body = {"type": "about:blank", "title": HTTPStatus(error.status).phrase}
    body["status"] = error.status
    body["detail"] = error.detail
    if instance:
        body["instance"] = instance
    retryable = error.status in (429, 500, 503)
    body["retryable"] = retryable
    body["backoffStrategy"] = "exponential" if retryable else "none"
    headers = dict(error.headers)
    if error.retry_after is not None or error.status in (429, 503):
        seconds = error.retry_after if error.retry_after is not None else 5
        body["retryAfterSeconds"] = seconds
        headers["Retry-After"] = str(seconds)
    if error.errors:
        body["errors"] = error.errors
    return Response(json.dumps(body, ensure_ascii=False), status_code=error.status,
                    media_type=PROBLEM_JSON, headers=headers)
