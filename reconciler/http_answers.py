"""Reading a server's error answers, as every HTTP client of the device does: the RFC 9457
problem body (when there is one) and `Retry-After`.

The REST source and the status and capability reporters talk to the same server, so they
read its refusals the same way: one parser for each, here.
"""

from __future__ import annotations

import email.utils
import math
from typing import Any

import httpx

from margo import jsonstrict

__all__ = ["MAX_RETRY_AFTER_SECONDS", "parse_retry_after", "problem_of"]

MAX_RETRY_AFTER_SECONDS = 24 * 3600.0  # a bogus Retry-After must not park work for years


def problem_of(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of an error answer (a problem document), or {} when the body is not
    one."""
    if "json" not in response.headers.get("content-type", ""):
        return {}
    try:
        body = jsonstrict.loads(response.content)
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


def parse_retry_after(value: str | None, now: float) -> float | None:
    """`Retry-After` as seconds from `now`: delta-seconds or an HTTP-date (RFC 9110 10.2.3);
    None if absent or unreadable. Never negative, at most a day."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)
