"""httpx's exceptions as the sources' `SourceError`, in one place: the REST source and the Git
source's own ref reads (`reconciler.sources.git_refs`) tell the runner the same thing for the
same failure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from reconciler.errors import ErrorCode
from reconciler.sources import SourceError

__all__ = ["translated"]


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Inside: an httpx failure becomes a `SourceError` naming `what` it was for
    (`UNREACHABLE`: no answer; `BAD_RESPONSE`: an answer that cannot be read)."""
    try:
        yield
    except httpx.TransportError as exc:
        raise SourceError(ErrorCode.UNREACHABLE, f"{what}: {type(exc).__name__}: {exc}") \
            from None
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise SourceError(ErrorCode.BAD_RESPONSE, f"{what}: {type(exc).__name__}: {exc}") \
            from None
