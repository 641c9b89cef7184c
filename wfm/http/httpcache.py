"""HTTP caching and content negotiation for the device API (`wfm.http`): which media types
an `Accept` header allows, `If-None-Match` against an ETag, and the answer for a document
addressed by its digest (immutable: cached by the device for a year, 304 when it has it).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["IMMUTABLE", "accepts", "etag_matches", "immutable"]

IMMUTABLE = "private, max-age=31536000, immutable"


def accepts(header: str | None, media_type: str) -> bool:
    """Content negotiation: no Accept means the default format; otherwise some listed
    range with q > 0 must cover the media type."""
    if header is None or not header.strip():
        return True
    kind = media_type.split("/")[0]
    for item in header.split(","):
        parts = [p.strip() for p in item.split(";")]
        range_ = parts[0].lower()
        quality = 1.0
        for param in parts[1:]:
            if param.lower().startswith("q="):
                try:
                    quality = float(param[2:])
                except ValueError:
                    quality = 0.0
        if quality <= 0:
            continue
        if range_ in (media_type, "*/*", f"{kind}/*"):
            return True
    return False


def etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    candidates = [c.strip() for c in header.split(",")]
    return "*" in candidates or any(c.removeprefix("W/") == etag for c in candidates)


def immutable(request: Request, data: bytes, media_type: str, digest: str) -> Response:
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Vary": "Accept-Encoding"}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=media_type, headers=headers)
