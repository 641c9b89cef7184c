"""What the device API reads from a request before anything is stored: the body as a
strict JSON object, identifiers checked against their family, headers straight from the
ASGI scope, and which generation of the API the path belongs to.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from margo import jsonstrict
from margo.errors import short_repr
from margo.identifiers import IdentifierFamily
from margo.kinds import Shape
from wfm.problems import ProblemError

__all__ = ["MAX_BODY", "check_identifier", "generation", "header", "json_body"]

MAX_BODY = 1024 * 1024


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, parsed strictly (`margo.jsonstrict`): what is stored must
    serialize again, so NaN or 1e999 is a 400 now rather than a 500 on every read. The size
    check is a second line: `wfm.admission.bodylimit` stops a larger body while it streams,
    before it is buffered here."""
    body = await request.body()
    if len(body) > MAX_BODY:
        raise ProblemError(413, f"request bodies are limited to {MAX_BODY} bytes")
    try:
        doc = jsonstrict.loads(body)  # NaN, 1e999, duplicate keys: refused here
    except jsonstrict.JsonRefused as exc:
        raise ProblemError(400, f"the request body is not valid JSON: {exc}",
                           margo_type="invalid-request") from None
    if not isinstance(doc, dict):
        raise ProblemError(400, "the request body must be a JSON object",
                           margo_type="invalid-request")
    return doc


def check_identifier(family: IdentifierFamily, value: object, field: str) -> str:
    """`value` if it is a valid name of `family`; otherwise a 422 naming `field` (a path
    parameter such as ``deviceId``, or a body field), before anything is stored: an id the
    store, Git or a device's clone cannot hold must never get as far as a compile. 422, as
    for every other id the schema's pattern refuses, wherever the id was written."""
    problem = family.problem(value)
    if problem is None:
        assert isinstance(value, str)
        return value
    raise ProblemError(422, f"{field} {short_repr(value)}: {problem}",
                       margo_type="semantic-error",
                       errors=[{"field": field, "message": problem}])


def header(request: Request, name: bytes) -> str | None:
    """One request header (`name` lowercase, as ASGI servers give names), read straight
    from the scope: the per-request calls skip building Starlette's `Headers`."""
    for key, value in request.scope["headers"]:
        if key == name:
            value_text: str = value.decode("latin-1")
            return value_text
    return None


def generation(request: Request) -> str:
    """The API generation a request's path belongs to (`margo.kinds.Shape`)."""
    path = request.scope["path"]  # (not `request.url`: building it costs more than the rest)
    if path.startswith("/device/"):
        return Shape.OCT_2024
    return Shape.RC2 if path.startswith("/api/v1/clients/") else Shape.RC3
