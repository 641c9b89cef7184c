"""Who is calling: the caller of every device-API request, from what it proved, never from
what it claims.

Three proofs, in this order:

1. **An X.509-SVID** (rc.3 MIAF). Either the client certificate of this TLS connection (the
   handshake already verified the chain against the trust bundle) or, only when the TCP peer is
   a configured TLS-terminating proxy, the RFC 9440 `Client-Cert` (+ `Client-Cert-Chain`)
   header, whose chain is verified here against the same bundle. From anyone else those
   headers are stripped before the app sees them. The SVID must be a leaf with exactly one
   spiffe URI SAN of the form `spiffe://<our td>/margo/wfm/<our wfm id>/client/<client-id>`
   (else 401), and the client id must pass the accepted-client policy (else a 403 problem).
2. **An RFC 9421 signature** (rc.2) with an onboarded key. `SignatureMiddleware` verifies it
   before routing: first the signature, from the headers alone (it covers `Content-Digest`,
   not the body), then, only for a good signature, the body against that digest. So a
   forged request is refused without its body ever being read; the result travels in the
   ASGI scope.
3. **A bearer token** (Preview Release 1, and how development runs), only when enabled.

The accepted-client policy (digest section 6a): clients registered by the operator
(`margo clients issue|import|add`), plus the ids given with `--accept-clients`, or the whole
`.../client/*` namespace with `*` (for operators who trust their identity service to mint only
legitimate clients). A retired client is refused whatever the policy. Decisions are cached for
`DECISION_TTL` seconds, so a retirement takes effect within that time.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from starlette.requests import Request

from margo.errors import short_repr
from margo.identifiers import CLIENT_ID
from margo.spiffe import (
    SpiffeIdError,
    SvidError,
    check_validity,
    client_id_of,
    svid_spiffe_id,
    verify_svid_chain,
)
from wfm.admission import budgets
from wfm.admission.parking import answering
from wfm.identity.clients import Client, ClientRegistry
from wfm.identity.signatures import SignatureError, check_content_digest, verify_signature
from wfm.identity.tls import TrustStore, peer_certificates
from wfm.problems import RETIRED, ProblemError, problem_response

__all__ = [
    "DECISION_TTL",
    "Identity",
    "IdentitySettings",
    "SignatureMiddleware",
    "parse_client_cert_header",
]

log = logging.getLogger("margo.wfm.identity")

DECISION_TTL = 2.0
MAX_SIGNED_BODY = 1024 * 1024
CLIENT_CERT_HEADERS = (b"client-cert", b"client-cert-chain")
SIGNED_SCOPE_KEY = "margo.signature"
#: Any of these makes a request a signed one (RFC 9421, with its RFC 9530 digest).
_SIGNATURE_HEADERS = frozenset({b"signature-input", b"signature", b"content-digest"})
ONBOARDING_MODES = ("open", "closed")

Asgi = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                 Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class IdentitySettings:
    """How callers may prove who they are (see the module doc)."""

    trust_domain: str | None = None
    wfm_id: str | None = None
    accept_clients: tuple[str, ...] = ()  # ids, or ("*",) for the whole namespace
    trusted_proxies: tuple[str, ...] = ()  # addresses or networks allowed to send Client-Cert
    trust_bundle: Path | None = None  # verifies certificates forwarded by those proxies
    bearer_tokens: bool = True
    signature_window: float = 300.0  # seconds a signed request stays acceptable
    onboarding: str = "open"  # rc.2 onboarding of unknown keys: open | closed

    @property
    def svids(self) -> bool:
        return bool(self.trust_domain and self.wfm_id)

    @property
    def whole_namespace(self) -> bool:
        return "*" in self.accept_clients


def parse_client_cert_header(value: str) -> list[x509.Certificate]:
    """RFC 9440: one or more comma-separated structured-field byte sequences (`:b64:`), each
    a DER certificate. Raises ValueError when malformed."""
    certs = []
    for item in value.split(","):
        item = item.strip()
        if len(item) < 2 or item[0] != ":" or item[-1] != ":":
            raise ValueError("not a structured-field byte sequence")
        try:
            der = base64.b64decode(item[1:-1], validate=True)
        except binascii.Error:
            raise ValueError("not base64") from None
        certs.append(x509.load_der_x509_certificate(der))
    return certs


def _unauthorized(detail: str, challenge: str) -> ProblemError:
    return ProblemError(401, detail, headers={"WWW-Authenticate": f'{challenge} '
                                              'realm="margo-gitops"'})


class Identity:
    """The caller of a request and the accepted-client policy; `open` binds the registry."""

    def __init__(self, settings: IdentitySettings):
        self.settings = settings
        self.clients: ClientRegistry | None = None
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies]
        self._trust = (TrustStore(settings.trust_bundle)
                       if settings.trust_bundle is not None and self._proxies else None)
        self._decisions: dict[str, tuple[float, Client | ProblemError]] = {}
        self._lock = threading.Lock()

    def open(self, clients: ClientRegistry) -> None:
        self.clients = clients

    @property
    def challenge(self) -> str:
        return "Bearer" if self.settings.bearer_tokens else "Signature"

    @staticmethod
    def vouch(request: Request, client: Client) -> Client:
        """`client` is this request's authenticated caller: a body read from now on counts
        against the authenticated device API's budget (`wfm.admission.budgets`), not the anonymous
        one's."""
        budgets.vouch(request.scope)
        return client

    # --- proxies ------------------------------------------------------------------------

    def is_trusted_proxy(self, host: str | None) -> bool:
        if not host or not self._proxies:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self._proxies)

    # --- X.509-SVIDs --------------------------------------------------------------------

    def _presented(self, request: Request) -> tuple[list[x509.Certificate], bool]:
        """(chain, forwarded): the proxy's Client-Cert header when the peer is a trusted
        proxy, else this connection's verified client certificate."""
        host = request.client.host if request.client else None
        # (the proxy test first: no proxy, no header lookup, on every request)
        header = request.headers.get("client-cert") if self.is_trusted_proxy(host) else None
        if header is not None:
            try:
                chain = parse_client_cert_header(header)
                extra = request.headers.get("client-cert-chain")
                if extra:
                    chain += parse_client_cert_header(extra)
            except ValueError as exc:
                raise _unauthorized(f"Client-Cert from the proxy is unreadable: {exc}",
                                    self.challenge) from None
            return chain, True
        return peer_certificates(request.scope), False

    def svid_caller(self, request: Request) -> Client | None:
        """The client an SVID proves, None when no certificate was presented; 401 for an
        unacceptable SVID, 403 when the policy refuses the client."""
        chain, forwarded = self._presented(request)
        if not chain:
            return None
        settings = self.settings
        if not settings.svids:
            raise _unauthorized("client certificates are not accepted by this server (no "
                                "trust domain and WFM id configured)", self.challenge)
        try:
            if forwarded:
                if self._trust is None:
                    raise SvidError("no trust bundle to verify forwarded certificates")
                spiffe = verify_svid_chain(chain[0], chain[1:], self._trust.anchors())
            else:
                check_validity(chain[0])  # the connection may outlive the SVID
                spiffe = svid_spiffe_id(chain[0])
            assert settings.trust_domain and settings.wfm_id
            client_id = client_id_of(spiffe, trust_domain=settings.trust_domain,
                                     wfm=settings.wfm_id)
        except (SvidError, SpiffeIdError) as exc:
            raise _unauthorized(f"the client certificate is not an acceptable SVID: {exc}",
                                self.challenge) from None
        return self.admit(client_id)

    def admit(self, client_id: str) -> Client:
        """The accepted-client policy for an SVID-proven client id (cached briefly)."""
        now = time.monotonic()
        cached = self._decisions.get(client_id)
        decision: Client | ProblemError
        if cached is not None and cached[0] > now:
            decision = cached[1]
        else:
            try:
                decision = self._decide(client_id)
            except ProblemError as exc:
                decision = exc
            with self._lock:
                if len(self._decisions) > 100_000:
                    self._decisions.clear()
                self._decisions[client_id] = (now + DECISION_TTL, decision)
        if isinstance(decision, ProblemError):  # a fresh one: no traceback piles up in the cache
            raise ProblemError(decision.status, decision.detail, margo_type=decision.margo_type,
                               title=decision.title)
        return decision

    def _decide(self, client_id: str) -> Client:
        assert self.clients is not None, "Identity.open() was not called"
        client = self.clients.get(client_id)
        if client is not None and client.retired:
            raise ProblemError(403, f"the client relationship with {client_id!r} has been "
                               "retired", margo_type="not-authorized", title=RETIRED)
        listed = self.settings.whole_namespace or client_id in self.settings.accept_clients
        if client is None and listed and not CLIENT_ID.is_valid(client_id):
            # A certificate names the id; only a bounded one may become a client row (it is
            # a URL segment and a key of everything the client reports).
            raise ProblemError(403, f"client id {short_repr(client_id)} is not accepted: "
                               f"{CLIENT_ID.problem(client_id)}", margo_type="not-authorized")
        if client is None and not listed:
            raise ProblemError(403, f"client {client_id!r} is not in the accepted-client policy "
                               "(register it with `margo clients issue|import`, or list it in "
                               "--accept-clients)", margo_type="not-authorized")
        return client if client is not None else self.clients.ensure(client_id)

    # --- rc.2 signatures ----------------------------------------------------------------

    def signature_caller(self, request: Request) -> Client | None:
        """The client whose onboarded key signed this request (verified by the middleware);
        None when the request carries no signature headers."""
        outcome = request.scope.get(SIGNED_SCOPE_KEY)
        if outcome is None:
            return None
        if isinstance(outcome, SignatureError):
            if outcome.status == 400:
                raise ProblemError(400, outcome.detail, margo_type="invalid-request")
            raise _unauthorized(outcome.detail, "Signature")
        return outcome  # type: ignore[no-any-return]

    def verify_signed(self, scope: dict[str, Any], headers: Any, peer: str | None, *,
                      has_body: bool) -> Client | SignatureError:
        """Verify a signed request's signature (its headers: `has_body` says whether a body
        follows, which must then be covered by Content-Digest): the client, or why not."""
        if self.clients is None:
            return SignatureError(401, "the server is starting")
        clients = self.clients
        found: dict[str, Client] = {}

        def resolve(key_id: str) -> Any | None:
            entry = clients.by_key_id(key_id)
            if entry is None:
                return None
            found["client"] = entry.client
            return load_pem_public_key(entry.public_key.encode())

        try:
            verify_signature(method=scope["method"],
                             url=_target_uri(scope, headers, self, peer), headers=headers,
                             resolve=resolve, window=self.settings.signature_window,
                             has_body=has_body)
        except SignatureError as exc:
            return exc
        return found["client"]


def _target_uri(scope: dict[str, Any], headers: Any, identity: Identity,
                peer: str | None) -> str:
    """The absolute URI the client addressed, as `@target-uri` covers it: scheme (from a
    trusted proxy's X-Forwarded-Proto when there is one), Host, raw path and query."""
    scheme = scope.get("scheme", "http")
    forwarded = headers.get("x-forwarded-proto")
    if forwarded and identity.is_trusted_proxy(peer):
        scheme = forwarded.split(",")[0].strip()
    host = headers.get("host") or "{}:{}".format(*scope.get("server") or ("localhost", 80))
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string") or b""
    return f"{scheme}://{host}{path}" + (f"?{query.decode('latin-1')}" if query else "")


class SignatureMiddleware:
    """Before routing: strip RFC 9440 headers that did not come from a trusted proxy, and
    verify rc.2 signatures (buffering the body, then replaying it to the app)."""

    def __init__(self, app: Asgi, identity: Identity):
        self.app, self.identity = app, identity

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        peer = scope["client"][0] if scope.get("client") else None
        raw: list[tuple[bytes, bytes]] = scope.get("headers") or []  # read, never changed
        signed = forwarded = False
        for name, _ in raw:  # one pass: this runs on every request
            lowered = name.lower()
            signed = signed or lowered in _SIGNATURE_HEADERS
            forwarded = forwarded or lowered in CLIENT_CERT_HEADERS
        if forwarded and not self.identity.is_trusted_proxy(peer):
            scope = {**scope, "headers": [(k, v) for k, v in raw
                                          if k.lower() not in CLIENT_CERT_HEADERS]}
        if not signed or answering(scope):  # (a parked request was checked on its way in)
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        outcome = self.identity.verify_signed(scope, request.headers, peer,
                                              has_body=_has_body(raw))
        if not isinstance(outcome, SignatureError):
            budgets.vouch(scope)  # its body is an authenticated device's
            body, receive = await _buffer(receive)
            if body is None:
                response = problem_response(ProblemError(
                    413, f"request bodies are limited to {MAX_SIGNED_BODY} bytes"))
                await response(scope, receive, send)
                return
            try:
                check_content_digest(request.headers, body)
            except SignatureError as exc:
                outcome = exc
        elif outcome.status == 401:  # the body is never read: the handler refuses unread
            log.info("signature refused on %s %s: %s", scope["method"], scope["path"],
                     outcome.detail)
        await self.app({**scope, SIGNED_SCOPE_KEY: outcome}, receive, send)


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request announces a body (a Content-Length above 0, or chunked)."""
    for name, value in headers:
        name = name.lower()
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
        if name == b"transfer-encoding":
            return True
    return False


async def _buffer(receive: Any) -> tuple[bytes | None, Any]:
    """Read the whole body (None past the limit) and a receive that replays it first."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_SIGNED_BODY:
            return None, receive
        chunks.append(chunk)
        more = message.get("more_body", False)
    body = b"".join(chunks)
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return dict(await receive())

    return body, replay
