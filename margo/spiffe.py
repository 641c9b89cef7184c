"""SPIFFE IDs, X.509-SVIDs and trust bundles as the Margo identity profile (rc.3 MIAF) uses them.

Both ends of the device API need the same rules, so they live here, below the server and the
device client: a client SVID names `spiffe://<td>/margo/wfm/<wfm-id>/client/<client-id>`, the
WFM's names `spiffe://<td>/margo/wfm/<wfm-id>`, and either side must refuse anything that is
not exactly that shape. IDs are compared exactly and case-sensitively, so parsing never
normalises: a text that would need normalising is refused instead.

The TLS stack verifies signatures and chains; what it cannot know is the SVID profile (exactly
one `spiffe` URI SAN, a leaf that is not a CA), which `svid_spiffe_id` checks. Trust bundles
come as PEM files or in the SPIFFE JWK-set format (`keys[].x5c`), and an empty anchor set is
an error, never "trust nothing silently" or, worse, "trust anything".
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification

__all__ = [
    "SpiffeId",
    "SpiffeIdError",
    "SvidError",
    "TrustBundleError",
    "certificates_to_pem",
    "check_validity",
    "client_id",
    "client_id_of",
    "load_trust_bundle",
    "parse_spiffe_id",
    "parse_trust_bundle",
    "svid_spiffe_id",
    "verify_svid_chain",
    "wfm_id",
]

SCHEME = "spiffe://"
# RFC 3986 unreserved characters: what SPIFFE allows in a path segment.
_SEGMENT = re.compile(r"^[A-Za-z0-9._~-]+\Z")
# Trust domains: lowercase letters, digits, dot, dash, underscore (SPIFFE-ID section 2.1).
_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]+\Z")
MAX_ID_LENGTH = 2048


class SpiffeIdError(ValueError):
    """A text that is not a well-formed SPIFFE ID (or not the Margo shape asked for)."""


class SvidError(ValueError):
    """A certificate that is not an acceptable X.509-SVID; `reason` says which rule failed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TrustBundleError(ValueError):
    """A trust bundle that cannot be used: unreadable, malformed or without anchors."""


@dataclass(frozen=True, slots=True)
class SpiffeId:
    """`spiffe://<trust_domain><path>`; `path` starts with `/` (or is empty for the domain)."""

    trust_domain: str
    path: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.trust_domain}{self.path}"

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.split("/")[1:]) if self.path else ()


def _check_segment(segment: str, what: str) -> str:
    if not _SEGMENT.match(segment) or segment in (".", ".."):
        raise SpiffeIdError(f"{what} {segment!r} is not a non-empty RFC 3986 unreserved "
                            "segment (and not '.' or '..')")
    return segment


def _check_trust_domain(trust_domain: str) -> str:
    if not _TRUST_DOMAIN.match(trust_domain):
        raise SpiffeIdError(f"trust domain {trust_domain!r} must be lowercase letters, digits, "
                            "'.', '-' or '_'")
    return trust_domain


def parse_spiffe_id(text: str) -> SpiffeId:
    """Parse strictly: no normalisation, no percent-encoding, no query or fragment, because
    two spellings of one ID would let a caller look like someone else under exact matching."""
    if len(text) > MAX_ID_LENGTH:
        raise SpiffeIdError("SPIFFE ID is longer than 2048 characters")
    if not text.startswith(SCHEME):
        raise SpiffeIdError(f"{text!r} does not start with {SCHEME}")
    rest = text[len(SCHEME):]
    trust_domain, slash, path = rest.partition("/")
    _check_trust_domain(trust_domain)
    if not slash:
        return SpiffeId(trust_domain, "")
    for segment in path.split("/"):
        _check_segment(segment, "path segment")
    return SpiffeId(trust_domain, "/" + path)


def _wfm_path(trust_domain: str, wfm: str) -> str:
    _check_trust_domain(trust_domain)
    return f"/margo/wfm/{_check_segment(wfm, 'wfm id')}"


def wfm_id(trust_domain: str, wfm_id: str) -> SpiffeId:
    """The WFM's own SPIFFE ID: `spiffe://<td>/margo/wfm/<wfm-id>`."""
    return SpiffeId(trust_domain, _wfm_path(trust_domain, wfm_id))


def client_id(trust_domain: str, wfm_id: str, client_id: str) -> SpiffeId:
    """A device client's SPIFFE ID: `spiffe://<td>/margo/wfm/<wfm-id>/client/<client-id>`."""
    base = _wfm_path(trust_domain, wfm_id)
    return SpiffeId(trust_domain, f"{base}/client/{_check_segment(client_id, 'client id')}")


def client_id_of(spiffe: SpiffeId, *, trust_domain: str, wfm: str) -> str:
    """The client id in a client SPIFFE ID, which must name this WFM in this trust domain
    exactly; anything else (another domain, another WFM, another shape) is refused."""
    if spiffe.trust_domain != trust_domain:
        raise SpiffeIdError(f"trust domain {spiffe.trust_domain!r} is not {trust_domain!r}")
    segments = spiffe.segments
    if len(segments) != 5 or segments[:2] != ("margo", "wfm") or segments[3] != "client":
        raise SpiffeIdError(f"{spiffe} is not a Margo client ID "
                            "(spiffe://<td>/margo/wfm/<wfm-id>/client/<client-id>)")
    if segments[2] != wfm:
        raise SpiffeIdError(f"{spiffe} names WFM {segments[2]!r}, not {wfm!r}")
    return segments[4]


def _uri_sans(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def svid_spiffe_id(cert: x509.Certificate) -> SpiffeId:
    """The SPIFFE ID of a leaf X.509-SVID, after the profile rules a TLS library does not
    check: exactly one URI SAN with the spiffe scheme, not a CA, no certificate signing."""
    uris = _uri_sans(cert)
    if len(uris) != 1:
        raise SvidError(f"an SVID has exactly one URI SAN; this certificate has {len(uris)}")
    if not uris[0].startswith(SCHEME):
        raise SvidError(f"URI SAN {uris[0]!r} is not a spiffe:// ID")
    try:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        basic = None
    if basic is not None and basic.ca:
        raise SvidError("a leaf SVID must not be a CA (basicConstraints cA=true)")
    usage: x509.KeyUsage | None
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and (usage.key_cert_sign or usage.crl_sign):
        raise SvidError("a leaf SVID must not have keyCertSign or cRLSign key usage")
    try:
        return parse_spiffe_id(uris[0])
    except SpiffeIdError as exc:
        raise SvidError(str(exc)) from None


def check_validity(cert: x509.Certificate, now: dt.datetime | None = None) -> None:
    """Refuse a certificate outside its validity period (expired or not yet valid)."""
    now = now or dt.datetime.now(dt.UTC)
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    if now < cert.not_valid_before_utc:
        raise SvidError(f"certificate is not valid before {cert.not_valid_before_utc:{stamp}}")
    if now > cert.not_valid_after_utc:
        raise SvidError(f"certificate expired at {cert.not_valid_after_utc:{stamp}}")


def verify_svid_chain(leaf: x509.Certificate, intermediates: Sequence[x509.Certificate],
                      anchors: Sequence[x509.Certificate],
                      now: dt.datetime | None = None) -> SpiffeId:
    """Verify an SVID chain in Python, for when no TLS stack did it (a certificate forwarded
    by a TLS-terminating proxy): chain to an anchor, validity, then the SVID profile. The
    leaf policy is permissive because SVIDs carry no DNS names; the CA policy is WebPKI's."""
    if not anchors:
        raise SvidError("no trust anchors")
    now = now or dt.datetime.now(dt.UTC)
    check_validity(leaf, now)
    spiffe = svid_spiffe_id(leaf)
    verifier = (verification.PolicyBuilder()
                .store(verification.Store(list(anchors)))
                .time(now.replace(tzinfo=None))
                .extension_policies(ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
                                    ee_policy=verification.ExtensionPolicy.permit_all())
                .build_client_verifier())
    try:
        verifier.verify(leaf, list(intermediates))
    except verification.VerificationError as exc:
        raise SvidError(f"certificate chain does not verify against the trust bundle: {exc}"
                        ) from None
    return spiffe


def _bundle_from_jwks(doc: dict[str, Any]) -> list[x509.Certificate]:
    keys = doc.get("keys")
    if not isinstance(keys, list):
        raise TrustBundleError("a SPIFFE bundle has a 'keys' list")
    anchors = []
    for key in keys:
        # jwt-svid keys (and anything else) are ignored: only X.509 authorities anchor SVIDs.
        if not isinstance(key, dict) or key.get("use") != "x509-svid":
            continue
        chain = key.get("x5c")
        if not isinstance(chain, list) or len(chain) != 1 or not isinstance(chain[0], str):
            raise TrustBundleError("an x509-svid key carries exactly one x5c certificate")
        try:
            anchors.append(x509.load_der_x509_certificate(base64.b64decode(chain[0],
                                                                           validate=True)))
        except (ValueError, binascii.Error) as exc:
            raise TrustBundleError(f"an x5c entry is not a base64 DER certificate: {exc}"
                                   ) from None
    return anchors


def parse_trust_bundle(data: bytes) -> list[x509.Certificate]:
    """The anchors in a trust bundle given as PEM certificates or as a SPIFFE JWK set."""
    text = data.lstrip()
    if text.startswith(b"{"):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise TrustBundleError(f"trust bundle is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise TrustBundleError("a SPIFFE bundle is a JSON object")
        anchors = _bundle_from_jwks(doc)
    else:
        try:
            anchors = x509.load_pem_x509_certificates(data) if b"-----BEGIN" in data else []
        except ValueError as exc:
            raise TrustBundleError(f"trust bundle has an unreadable certificate: {exc}"
                                   ) from None
    if not anchors:
        raise TrustBundleError("trust bundle holds no X.509 anchors")
    return anchors


def load_trust_bundle(path: str | Path) -> list[x509.Certificate]:
    """Read a trust bundle file (PEM or SPIFFE JWK set); an empty anchor set is an error."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TrustBundleError(f"cannot read trust bundle {path}: {exc}") from None
    return parse_trust_bundle(data)


def certificates_to_pem(certs: Sequence[x509.Certificate]) -> str:
    """PEM text of certificates, e.g. to hand a parsed bundle to `ssl` as cadata."""
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode("ascii") for c in certs)
