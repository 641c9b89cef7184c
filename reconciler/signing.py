"""rc.2 identity: onboarding with the device certificate, then an RFC 9421 signature on every
request, exactly in the conformance kit's profile.

Why this profile and no other: the WFM rebuilds the signature base from what it receives, so
any difference (another label, an `alg` parameter, other components, another key id) is a 401.
What the kit sends, and what `SigningAuth` therefore sends:

    Content-Digest: sha-256=:<base64 sha256(body)>:            (only when there is a body)
    Signature-Input: sig1=("@method" "@target-uri" "@authority" "content-digest");
                     created=<unix seconds>;keyid="<lowercase hex sha256 of the SPKI DER>"
    Signature: sig1=:<base64 signature>:

with `ecdsa-p256-sha256` (IEEE P1363 r||s, 64 bytes), `ecdsa-p384-sha384`, `rsa-v1_5-sha256`
or `rsa-pss-sha256`. The signature base and the structured fields come from the maintained
`http-message-signatures` library, the algorithms and key ids from the profile the server
shares (`margo.rfc9421`).

Onboarding (`POST /api/v1/onboarding`, the certificate as base64 of its PEM, as the kit sends
it) is sent unsigned: the kit's "Onboard Without Signature Succeeds" step makes that the form
every conformant WFM accepts. The returned clientId is stored with the key id and server it
belongs to, so a restart reuses it and a new key or another server onboards again.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from http_message_signatures import HTTPMessageSigner, MappingKeyResolver

from margo import jsonstrict
from margo.files import write_atomically
from margo.rfc9421 import (
    ALGORITHMS,
    ONBOARDING_API_VERSION,
    ONBOARDING_KIND,
    key_id,
    profile_algorithms,
)
from reconciler.identity_errors import OnboardingError, SigningError

__all__ = [
    "COVERED_COMPONENTS",
    "SIGNATURE_LABEL",
    "DeviceKey",
    "OnboardingError",
    "SigningAuth",
    "SigningError",
    "load_device_key",
    "onboard",
    "onboarding_body",
    "sign_request",
]

ONBOARDING_PATH = "/api/v1/onboarding"
SIGNATURE_LABEL = "sig1"
COVERED_COMPONENTS = ("@method", "@target-uri", "@authority")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._~-]{1,200}\Z")  # it becomes a path segment


@dataclass(frozen=True)
class DeviceKey:
    """The rc.2 signing key with the algorithm it signs with and its key id."""

    private_key: Any
    algorithm: str
    key_id: str


def load_device_key(path: Path, algorithm: str | None = None) -> DeviceKey:
    """Read a PEM private key (EC P-256/P-384 or RSA of at least 2048 bits) and choose its
    algorithm; `algorithm` must be one the key can sign with."""
    try:
        private_key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise SigningError(f"cannot read the rc.2 key {path}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    usable = profile_algorithms(private_key)
    if not usable:
        raise SigningError(f"{path}: rc.2 signs with EC P-256, EC P-384 or RSA >= 2048 bits "
                           f"keys; this is a {type(private_key).__name__}")
    if algorithm is not None and algorithm not in usable:
        raise SigningError(f"{path}: this key cannot sign with {algorithm} "
                           f"(it can: {', '.join(usable)})")
    return DeviceKey(private_key, algorithm or usable[0], key_id(private_key.public_key()))


@dataclass
class _Message:
    """The request as the library's signer reads it: method, encoded URL, live headers."""

    method: str
    url: str
    headers: httpx.Headers


def sign_request(request: httpx.Request, key: DeviceKey, *, created: int) -> None:
    """Add Content-Digest (when there is a body), Signature-Input and Signature, replacing
    any earlier ones (a request signed again, e.g. after a redirect, must carry one set)."""
    for name in ("content-digest", "signature-input", "signature"):
        request.headers.pop(name, None)
    body = request.read()
    signer = HTTPMessageSigner(
        signature_algorithm=ALGORITHMS[key.algorithm],
        key_resolver=MappingKeyResolver(public_keys={},
                                        private_keys={key.key_id: key.private_key}))
    signer.sign(_Message(request.method, str(request.url), request.headers),
                key_id=key.key_id, created=dt.datetime.fromtimestamp(created, dt.UTC),
                label=SIGNATURE_LABEL, include_alg=False,
                covered_component_ids=COVERED_COMPONENTS, body=body or None)


class SigningAuth(httpx.Auth):
    """Signs every request of an httpx client with the device key (see the module
    docstring). The key is read once: a new rc.2 key means a new onboarding, a new clientId
    and new paths, which is a restart."""

    requires_request_body = True

    def __init__(self, key: DeviceKey, *, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self._clock = clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        sign_request(request, self.key, created=int(self._clock()))
        yield request


# --- onboarding --------------------------------------------------------------------------------


def _certificate(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise SigningError(f"cannot read the rc.2 certificate {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise SigningError(f"{path} is not a PEM certificate: {exc}") from None


def onboarding_body(certificate: x509.Certificate) -> dict[str, str]:
    """The OnboardingRequest: the certificate as base64 of its PEM text, as the kit sends."""
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    return {"apiVersion": ONBOARDING_API_VERSION, "kind": ONBOARDING_KIND,
            "certificate": base64.b64encode(pem).decode("ascii")}


def _stored_client_id(state_file: Path, *, key: DeviceKey, server: str) -> str | None:
    """The clientId onboarded earlier with this key at this server, if any."""
    try:
        doc = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise OnboardingError(f"{state_file} is unreadable ({exc}); remove it to onboard "
                              "again", retryable=False) from None
    if not isinstance(doc, dict) or doc.get("keyId") != key.key_id \
            or doc.get("server") != server:
        return None
    client = doc.get("clientId")
    return client if isinstance(client, str) and _CLIENT_ID.match(client) else None


def _detail(response: httpx.Response) -> str:
    """What the server said: the problem's detail/title, Symphony's `Error`, or the reason."""
    try:
        doc = jsonstrict.loads(response.content)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        for field in ("detail", "title", "error", "Error"):
            if isinstance(doc.get(field), str) and doc[field]:
                return str(doc[field])
    return response.reason_phrase


def onboard(client: httpx.Client, *, certificate: Path, key: DeviceKey,
            state_file: Path) -> str:
    """The clientId for this device key at `client`'s server: the stored one, or a new one
    from `POST /api/v1/onboarding` (stored durably before it is returned). Raises
    `SigningError` for unusable local material and `OnboardingError` otherwise."""
    server = str(client.base_url).rstrip("/")
    stored = _stored_client_id(state_file, key=key, server=server)
    if stored is not None:
        return stored
    cert = _certificate(certificate)
    if key_id(cert.public_key()) != key.key_id:
        raise SigningError(f"{certificate} does not hold the public key of the rc.2 signing "
                           "key: the server would verify our signatures with the wrong key")
    try:
        # auth=None: unsigned (see the module docstring), whatever the client's default is.
        response = client.post(ONBOARDING_PATH, json=onboarding_body(cert),
                               auth=None)  # type: ignore[arg-type]  # httpx accepts None
    except httpx.HTTPError as exc:
        raise OnboardingError(f"onboarding: {type(exc).__name__}: {exc}") from None
    if response.status_code == 400:
        raise OnboardingError(f"onboarding refused our certificate as invalid: "
                              f"{_detail(response)}", status=400, retryable=False)
    if response.status_code == 403:
        raise OnboardingError(f"onboarding rejected our certificate ({_detail(response)}); an "
                              "operator may approve it", status=403)
    if response.status_code not in (200, 201):
        raise OnboardingError(f"onboarding: HTTP {response.status_code}: {_detail(response)}",
                              status=response.status_code)
    try:
        client_id = jsonstrict.loads(response.content).get("clientId")
    except (ValueError, AttributeError, RecursionError):
        client_id = None
    if not isinstance(client_id, str) or not _CLIENT_ID.match(client_id):
        raise OnboardingError(f"onboarding answered {response.status_code} without a usable "
                              f"clientId: {response.text[:200]!r}", status=response.status_code)
    write_atomically(state_file, json.dumps({"clientId": client_id, "keyId": key.key_id,
                                              "server": server}, indent=2) + "\n")
    return client_id
