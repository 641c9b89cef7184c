"""rc.2 request signing as the conformance kit's steps ask for it: the RFC 9421 signature of
`reconciler.signing`, and the kit's negative-case knobs (`skip_signing`,
`skip_content_digest`, a step's own Content-Digest, `tamper_signature`) that make a WFM
refuse the request. `conformance.runner` calls `apply_rc2_signing` on every signed step.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from http_message_signatures import (
    HTTPMessageSignaturesException,
    HTTPMessageSigner,
    MappingKeyResolver,
)

from margo.rfc9421 import ALGORITHMS
from reconciler.signing import COVERED_COMPONENTS, SIGNATURE_LABEL, DeviceKey, sign_request

__all__ = ["apply_rc2_signing"]


@dataclass
class _Message:
    """A request as the signature library reads it."""

    method: str
    url: str
    headers: httpx.Headers


def _now() -> int:
    return int(time.time())


def _content_digest(body: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode("ascii") + ":"


def _sign_without_digest(request: httpx.Request, key: DeviceKey) -> None:
    """Sign only "@method" "@target-uri" "@authority", as the kit does for a request that
    carries no Content-Digest: sign a bodiless twin, copy its signature headers."""
    twin = httpx.Request(request.method, request.url)
    sign_request(twin, key, created=_now())
    request.headers.pop("content-digest", None)
    for name in ("signature-input", "signature"):
        request.headers[name] = twin.headers[name]


def _sign_with_given_digest(request: httpx.Request, key: DeviceKey, digest: str) -> None:
    """A step that sets its own Content-Digest (a deliberately wrong one) gets it covered
    as sent, not replaced by the correct one `sign_request` would compute. A value too
    malformed for the signature library to cover is sent uncovered."""
    signer = HTTPMessageSigner(
        signature_algorithm=ALGORITHMS[key.algorithm],
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={key.key_id:
                                                                      key.private_key}))
    request.headers["content-digest"] = digest
    try:
        signer.sign(_Message(request.method, str(request.url), request.headers),
                    key_id=key.key_id, created=dt.datetime.fromtimestamp(_now(), dt.UTC),
                    label=SIGNATURE_LABEL, include_alg=False, use_existing_digest=True,
                    covered_component_ids=(*COVERED_COMPONENTS, "content-digest"))
    except HTTPMessageSignaturesException:
        _sign_without_digest(request, key)
        request.headers["content-digest"] = digest


def _tamper(request: httpx.Request) -> None:
    """Flip one character in the middle of the signature bytes: well-formed headers whose
    signature does not verify (the kit's `tamper_signature`)."""
    value = request.headers.get("signature", "")
    head, sep, rest = value.partition(":")
    encoded, sep2, tail = rest.partition(":")
    if not (sep and sep2 and encoded):
        return
    middle = len(encoded) // 2
    flipped = "B" if encoded[middle] == "A" else "A"
    encoded = encoded[:middle] + flipped + encoded[middle + 1:]
    request.headers["signature"] = f"{head}:{encoded}:{tail}"


def apply_rc2_signing(request: httpx.Request, step: Mapping[str, Any], key: DeviceKey,
                      given_digest: str | None) -> None:
    """Sign `request` as step `step` asks: RFC 9421 with the device key, or deliberately not
    (`skip_signing`), without a Content-Digest (`skip_content_digest`), over the digest the
    step gives (`given_digest`, wrong on purpose), or with a broken signature
    (`tamper_signature`)."""
    has_body = bool(request.content)
    if step.get("skip_signing"):  # unsigned, but (like the kit) with the body's digest
        if has_body and not step.get("skip_content_digest") and given_digest is None:
            request.headers["content-digest"] = _content_digest(request.content)
        return
    if step.get("skip_content_digest") or not has_body or given_digest == "":
        _sign_without_digest(request, key)
        if given_digest == "" and has_body and not step.get("skip_content_digest"):
            request.headers["content-digest"] = ""
    elif given_digest is not None:
        _sign_with_given_digest(request, key, given_digest)
    else:
        sign_request(request, key, created=_now())
    if step.get("tamper_signature"):
        _tamper(request)
