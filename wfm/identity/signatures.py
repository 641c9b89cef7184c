"""rc.2 request authentication: RFC 9530 `Content-Digest` and RFC 9421 message signatures.

An rc.2 device onboards a certificate, then signs every request with its key. The server finds
the key by the signature's `keyid` (lowercase hex SHA-256 of the SPKI DER, as the conformance
kit computes it), rebuilds the signature base and verifies it. The base and the structured
header parsing come from the maintained `http-message-signatures` library, the algorithms and
key ids from the profile the device shares (`margo.rfc9421`); this module only adds the
server's side on top:

- the algorithm follows from the onboarded key (the kit sends no `alg`): EC P-256 is
  `ecdsa-p256-sha256`, P-384 `ecdsa-p384-sha384`, RSA either `rsa-v1_5-sha256` or
  `rsa-pss-sha256` (both allowed by the specification; an `alg` parameter, when sent, picks);
- `@method` and `@target-uri` must be covered, and `content-digest` whenever there is a body;
- `created` must be inside a configurable window and not in the future, so a captured request
  cannot be replayed later;
- a missing or wrong `Content-Digest` is a 400 (the body is what is wrong), every signature
  failure a 401.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from http_message_signatures import (
    HTTPMessageVerifier,
    HTTPSignatureAlgorithm,
    HTTPSignatureKeyResolver,
    InvalidSignature,
)
from http_message_signatures.digests import ContentDigest
from http_message_signatures.exceptions import HTTPMessageSignaturesException

from margo.rfc9421 import (
    ALGORITHMS,
    ONBOARDING_API_VERSION,
    ONBOARDING_KIND,
    key_id,
    profile_algorithms,
)

__all__ = [
    "OnboardingError",
    "OnboardingKey",
    "SignatureError",
    "algorithms_for",
    "check_content_digest",
    "onboarding_key",
    "parse_certificate",
    "public_key_pem",
    "verify_request",
    "verify_signature",
]

REQUIRED_COMPONENTS = ("@method", "@target-uri")


class SignatureError(Exception):
    """A request that fails rc.2 authentication; `status` is 400 (digest) or 401."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def public_key_pem(public_key: Any) -> str:
    pem: bytes = public_key.public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem.decode()


def algorithms_for(public_key: Any) -> list[type[HTTPSignatureAlgorithm]]:
    """The algorithms an onboarded key may sign with; empty when rc.2 allows none (Ed25519,
    other curves, RSA below 2048 bits)."""
    return [ALGORITHMS[name] for name in profile_algorithms(public_key)]


@dataclass(frozen=True)
class _Message:
    """The request as the library reads it: method, absolute URL, header items."""

    method: str
    url: str
    headers: Any


class _Keys(HTTPSignatureKeyResolver):
    def __init__(self, resolve: Callable[[str], Any | None]):
        self._resolve = resolve

    def resolve_public_key(self, key_id: str) -> Any | None:
        return self._resolve(key_id)

    def resolve_private_key(self, key_id: str) -> Any:
        raise NotImplementedError("the server never signs")


def check_content_digest(headers: Any, body: bytes) -> None:
    """400 unless a request with a body carries a Content-Digest that matches it."""
    value = headers.get("content-digest")
    if value is None:
        if body:
            raise SignatureError(400, "a request with a body must carry Content-Digest "
                                 "(sha-256=:<base64>:)")
        return
    try:
        ContentDigest.verify(value, body)
    except (InvalidSignature, HTTPMessageSignaturesException) as exc:
        raise SignatureError(400, f"Content-Digest: {exc}") from None


def _verifier(algorithm: type[HTTPSignatureAlgorithm], keys: _Keys,
              skew: dt.timedelta) -> HTTPMessageVerifier:
    verifier = HTTPMessageVerifier(signature_algorithm=algorithm, key_resolver=keys)
    verifier.max_clock_skew = skew
    return verifier


def verify_request(*, method: str, url: str, headers: Any, body: bytes,
                   resolve: Callable[[str], Any | None], window: float,
                   skew: float = 5.0) -> str:
    """Verify a signed rc.2 request and its body; return the key id it was signed with.

    `resolve` maps a key id to the onboarded public key (None: unknown key). `headers` needs
    `get`, `in`, `[]` and `items()` with every field line (Starlette's `Headers` does)."""
    check_content_digest(headers, body)
    return verify_signature(method=method, url=url, headers=headers, resolve=resolve,
                            window=window, has_body=bool(body), skew=skew)


def verify_signature(*, method: str, url: str, headers: Any,
                     resolve: Callable[[str], Any | None], window: float, has_body: bool,
                     skew: float = 5.0) -> str:
    """Verify a signed rc.2 request from its headers alone; return the key id.

    The signature covers the `Content-Digest` header, not the body, so the server can tell
    a forged request before it reads (and holds) a byte of the body; `check_content_digest`
    then checks the body against the signed digest. A request that has a body (`has_body`)
    must carry Content-Digest (400) and its signature must cover it (401)."""
    if has_body and headers.get("content-digest") is None:
        raise SignatureError(400, "a request with a body must carry Content-Digest "
                             "(sha-256=:<base64>:)")
    if "signature-input" not in headers or "signature" not in headers:
        raise SignatureError(401, "the request is not signed (Signature-Input and Signature "
                             "are required)")
    kid, alg = _params(headers["signature-input"])
    if kid is None:
        raise SignatureError(401, "Signature-Input must carry one signature with a keyid")
    key = resolve(kid)
    if key is None:
        raise SignatureError(401, f"no onboarded key has the keyid {kid!r}")
    candidates = [a for a in algorithms_for(key) if alg is None or a.algorithm_id == alg]
    if not candidates:
        raise SignatureError(401, f"the key {kid!r} cannot sign with {alg or 'rc.2 algorithms'}")
    message = _Message(method.upper(), url, headers)
    required = [*REQUIRED_COMPONENTS, *(["content-digest"] if has_body else [])]
    keys = _Keys(lambda wanted: key if wanted == kid else None)
    failure = ""
    for algorithm in candidates:
        try:
            _verifier(algorithm, keys, dt.timedelta(seconds=skew)).verify(
                message, max_age=dt.timedelta(seconds=window), require_components=required)
        except (InvalidSignature, HTTPMessageSignaturesException) as exc:
            failure = str(exc) or type(exc).__name__
            continue
        return kid
    raise SignatureError(401, f"signature verification failed: {failure}")


def _params(signature_input: str) -> tuple[str | None, str | None]:
    """keyid and alg of the (single) signature, read with the library's own parser."""
    try:
        parsed = HTTPMessageVerifier._parse_signature_dictionary(signature_input)
    except Exception:  # malformed: verify() reports it with its own message
        return None, None
    for node in parsed.values():
        params = getattr(node, "params", {})
        kid, alg = params.get("keyid"), params.get("alg")
        return (kid if isinstance(kid, str) else None, alg if isinstance(alg, str) else None)
    return None, None


class OnboardingError(Exception):
    """An onboarding request refused: `status` 400 (unreadable) or 403 (not acceptable)."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class OnboardingKey:
    """What onboarding stores for a device: its key (by key id) and certificate."""

    key_id: str
    public_key_pem: str
    certificate_pem: str


def parse_certificate(text: str | bytes) -> x509.Certificate:
    """A device certificate as devices send it: base64 of the PEM (the conformance kit),
    PEM text, or base64 of the DER. ValueError when none of these."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    data = data.strip()
    if b"-----BEGIN CERTIFICATE-----" in data:
        return x509.load_pem_x509_certificate(data)
    try:
        decoded = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
    if b"-----BEGIN CERTIFICATE-----" in decoded:
        return x509.load_pem_x509_certificate(decoded)
    return x509.load_der_x509_certificate(decoded)


def onboarding_key(doc: dict[str, Any], now: dt.datetime | None = None) -> OnboardingKey:
    """The key an `OnboardingRequest` onboards. 400 for a malformed request or certificate,
    403 for a certificate outside its validity period or with a key rc.2 cannot sign with.
    Self-signed CA-flagged certificates are accepted: `openssl req -x509`, which the kit
    uses, marks them cA=true."""
    for field, expected in (("apiVersion", ONBOARDING_API_VERSION), ("kind", ONBOARDING_KIND)):
        if field in doc and doc[field] != expected:
            raise OnboardingError(400, f"{field} must be {expected!r}")
    certificate = doc.get("certificate")
    if not isinstance(certificate, str) or not certificate.strip():
        raise OnboardingError(400, "certificate (base64 of the PEM) is required")
    try:
        cert = parse_certificate(certificate)
    except ValueError as exc:
        raise OnboardingError(400, f"certificate is not a readable X.509 certificate: {exc}"
                              ) from None
    now = now or dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise OnboardingError(403, "the certificate is outside its validity period")
    public_key = cert.public_key()
    if not algorithms_for(public_key):
        raise OnboardingError(403, "the certificate's key cannot sign with an rc.2 algorithm "
                              "(EC P-256, EC P-384 or RSA of at least 2048 bits)")
    return OnboardingKey(key_id(public_key), public_key_pem(public_key),
                         cert.public_bytes(serialization.Encoding.PEM).decode("ascii"))
