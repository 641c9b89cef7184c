"""Secrets as callers present them: compared in constant time, read from HTTP basic.

Every door of the server that takes a secret (device tokens, the operator token, the
metrics scrape token, the hosted source's push password) compares and parses it here, so
none of them can be made to crash (500) or to leak timing by what a caller sends. It
depends on nothing else of the server, so the metrics endpoint can check its token without
reaching the client registry (and through it the database).
"""

from __future__ import annotations

import base64
import hmac

__all__ = ["parse_basic", "same_secret"]


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality of two texts, whatever characters a caller sent: compared as
    UTF-8 bytes, because `hmac.compare_digest` raises TypeError for a `str` holding anything
    but ASCII, and a credential must be refused (401), never crash the request (500)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def parse_basic(header: str) -> tuple[str, str] | None:
    """(user, password) of an HTTP basic Authorization header, or None."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None
