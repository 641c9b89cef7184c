"""Content digests in the Margo grammar: `sha256:<64 lower-case hex>` over exact bytes.

The Exact Bytes Rule: hash what was (or will be) sent, after removing any HTTP
Content-Encoding, never a re-serialization. Unsupported algorithms are errors, because a
client MUST treat a manifest naming one as invalid.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

__all__ = ["DigestError", "data_digest", "digest_of", "parse_digest", "sorted_json",
           "verify_digest"]

_GRAMMAR = re.compile(r"^([a-z0-9_-]+):([0-9a-f]+)\Z")
_SUPPORTED = {"sha256": 64}


class DigestError(ValueError):
    """A digest string is malformed, uses an unsupported algorithm, or does not match."""


def digest_of(data: bytes) -> str:
    """`sha256:<hex>` of exactly these bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sorted_json(doc: Any) -> str:
    """JSON data's sorted-key compact serialization (what `data_digest` is over), for a
    caller that stores the text as well as its digest and serializes once."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def data_digest(doc: Any) -> str:
    """`sha256:` of JSON data's sorted-key compact serialization: equal exactly when the
    content is equal. An internal identity (change detection, caches), not a wire digest:
    wire digests are always over the bytes sent (`digest_of`)."""
    return digest_of(sorted_json(doc).encode("utf-8"))


def parse_digest(text: str) -> tuple[str, str]:
    """Split and check a digest; raise `DigestError` saying what is wrong."""
    match = _GRAMMAR.match(text) if isinstance(text, str) else None
    if not match:
        raise DigestError(f"expected a digest like 'sha256:<64 lower-case hex>', found {text!r}")
    algorithm, encoded = match.groups()
    if algorithm not in _SUPPORTED:
        raise DigestError(f"unsupported digest algorithm {algorithm!r} (supported: sha256)")
    if len(encoded) != _SUPPORTED[algorithm]:
        raise DigestError(f"{algorithm} digests have {_SUPPORTED[algorithm]} hex digits, "
                          f"found {len(encoded)}")
    return algorithm, encoded


def verify_digest(data: bytes, expected: str) -> None:
    """Raise `DigestError` unless `data` hashes to `expected` (constant-time compare)."""
    parse_digest(expected)
    actual = digest_of(data)
    if not hmac.compare_digest(actual, expected):
        raise DigestError(f"digest mismatch: expected {expected}, computed {actual}")
