"""Serving the device API over (mutual) TLS, with files that can change under a running server.

Three things uvicorn does not do on its own:

- **The client certificate reaches the app.** uvicorn builds the ASGI scope without the peer
  certificate. `TlsHttpProtocol` (passed as `uvicorn.Config(http=...)`) reads the TLS object
  when the connection is made and adds the ASGI TLS extension (`scope["extensions"]["tls"]`,
  `client_cert_chain` as PEM) to every request of that connection, by wrapping its app.
- **Rotation without restart.** The trust bundle and the WFM's own SVID are short-lived by
  design (Margo has no revocation: bundles rotate). An `SSLContext` cannot forget a CA once
  loaded, so instead every handshake starts on one fixed context whose `sni_callback` (which
  OpenSSL calls for every ClientHello, with or without SNI) swaps in the context built from
  the files as they are now; files are re-read only when their stat signature changes, and a
  bad file keeps the last good context (logged), so a botched rotation never opens the door.
- **The Margo TLS profile.** TLS 1.3 only unless 1.2 is enabled as the documented fallback,
  client certificates verified against the bundle (required by default, which refuses a
  client without one in the handshake itself), no session tickets (resumption must not
  outlive an authentication decision), HTTP/1.1 only.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from margo.spiffe import TrustBundleError, certificates_to_pem, load_trust_bundle

__all__ = [
    "CLIENT_CERT_MODES",
    "ServerContexts",
    "TlsHttpProtocol",
    "TlsSettings",
    "TrustStore",
    "peer_certificates",
    "tls_extension",
]

log = logging.getLogger("margo.wfm.tls")

CLIENT_CERT_MODES = ("required", "optional", "none")
# ASGI TLS extension: the protocol version as the TLS wire number.
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


@dataclass(frozen=True)
class TlsSettings:
    """The server's TLS material and client-certificate policy."""

    cert: Path  # the WFM SVID (leaf first, then intermediates)
    key: Path
    trust_bundle: Path | None = None  # anchors for client SVIDs; None: no client certificates
    client_cert: str = "required"  # required | optional | none
    tls12: bool = False


def _signature(*paths: Path | None) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is replaced or rewritten (inode, size, mtime)."""
    out = []
    for path in paths:
        if path is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            out.append((-1, -1, -1))
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class TrustStore:
    """A trust bundle file and its anchors, re-read when the file changes. Loading fails
    loudly at start (an empty or broken bundle is a configuration error); later a broken
    rotation keeps the previous anchors."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._seen = _signature(path)
        self._anchors = load_trust_bundle(path)
        self.generation = 0

    def anchors(self) -> list[x509.Certificate]:
        self.refresh()
        return self._anchors

    def refresh(self) -> bool:
        """Reload if the file changed; True when new anchors were taken."""
        seen = _signature(self.path)
        if seen == self._seen:
            return False
        with self._lock:
            if seen == self._seen:
                return False
            self._seen = seen
            try:
                anchors = load_trust_bundle(self.path)
            except TrustBundleError as exc:
                log.error("trust bundle %s not reloaded, keeping the previous anchors: %s",
                          self.path, exc)
                return False
            self._anchors = anchors
            self.generation += 1
            log.info("trust bundle %s reloaded: %d anchor(s)", self.path, len(anchors))
            return True


class ServerContexts:
    """The server's SSL contexts: one fixed context handed to uvicorn, and the current one
    (rebuilt when the bundle, certificate or key file changes) swapped in per handshake."""

    def __init__(self, settings: TlsSettings):
        if settings.client_cert not in CLIENT_CERT_MODES:
            raise ValueError(f"client_cert must be one of {CLIENT_CERT_MODES}")
        self.settings = settings
        self.trust = (TrustStore(settings.trust_bundle)
                      if settings.trust_bundle is not None and settings.client_cert != "none"
                      else None)
        self._lock = threading.Lock()
        self._key = self._files()
        self._current = self._build()
        self.initial = self._build()
        self.initial.sni_callback = self._on_hello

    def _files(self) -> tuple[Any, ...]:
        return (_signature(self.settings.cert, self.settings.key),
                self.trust.generation if self.trust else None)

    def _build(self) -> ssl.SSLContext:
        settings = self.settings
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = (ssl.TLSVersion.TLSv1_2 if settings.tls12
                                   else ssl.TLSVersion.TLSv1_3)
        context.options |= ssl.OP_NO_TICKET | ssl.OP_NO_RENEGOTIATION
        context.num_tickets = 0
        context.set_alpn_protocols(["http/1.1"])
        context.load_cert_chain(settings.cert, settings.key)
        if self.trust is not None:
            context.load_verify_locations(cadata=certificates_to_pem(self.trust.anchors()))
            context.verify_mode = (ssl.CERT_REQUIRED if settings.client_cert == "required"
                                   else ssl.CERT_OPTIONAL)
        return context

    def current(self) -> ssl.SSLContext:
        if self.trust is not None:
            self.trust.refresh()
        key = self._files()
        if key == self._key:
            return self._current
        with self._lock:
            if key != self._key:
                try:
                    self._current = self._build()
                    log.info("TLS context rebuilt (certificate, key or trust bundle changed)")
                except (OSError, ssl.SSLError) as exc:
                    log.error("TLS material not reloaded, keeping the previous: %s", exc)
                self._key = key
        return self._current

    def _on_hello(self, ssl_object: ssl.SSLObject, server_name: str | None,
                  context: ssl.SSLContext) -> None:
        current = self.current()
        if current is not context:
            ssl_object.context = current

    def uvicorn_factory(self) -> Callable[[Any, Callable[[], ssl.SSLContext]], ssl.SSLContext]:
        """For `uvicorn.Config(ssl_context_factory=...)`."""
        return lambda config, default: self.initial


def tls_extension(transport: Any) -> dict[str, Any] | None:
    """The ASGI TLS extension for a connection, or None on plain TCP. Python before 3.13
    exposes only the peer's leaf certificate; the chain was verified in the handshake."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    verified = getattr(ssl_object, "get_verified_chain", None)  # Python 3.13+: DER list
    if verified is not None:
        chain = [ssl.DER_cert_to_PEM_cert(der) for der in verified()]
    else:
        der = ssl_object.getpeercert(binary_form=True)
        chain = [ssl.DER_cert_to_PEM_cert(der)] if der else []
    return {"server_cert": None, "client_cert_chain": chain, "client_cert_name": None,
            "client_cert_error": None, "tls_version": _TLS_VERSIONS.get(ssl_object.version()),
            "cipher_suite": None}


class _WithTls:
    """The connection's app, with the TLS extension added to each HTTP scope."""

    def __init__(self, app: Any, tls: dict[str, Any]):
        self.app, self.tls = app, tls

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            extensions = dict(scope.get("extensions") or {})
            extensions["tls"] = self.tls
            scope = {**scope, "extensions": extensions}
        await self.app(scope, receive, send)


class TlsHttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, plus the peer certificate in the scope (see module doc)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        extension = tls_extension(transport)
        if extension is not None:
            self.app = _WithTls(self.app, extension)  # type: ignore[has-type]


def peer_certificates(scope: Mapping[str, Any]) -> list[x509.Certificate]:
    """The client certificate chain the TLS layer verified (leaf first); [] without one."""
    tls = (scope.get("extensions") or {}).get("tls") or {}
    chain = tls.get("client_cert_chain") or []
    return [x509.load_pem_x509_certificate(pem.encode("ascii")) for pem in chain]
