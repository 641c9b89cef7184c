"""The device client's transport identity: rc.3 mutual TLS with its X.509-SVID, and the exact
check of the WFM's SPIFFE ID before a single request byte leaves the device.

Why a network backend: Python's `ssl` has no verification callback, so the TLS stack can
validate the WFM's chain against the trust bundle (`check_hostname` off: SVIDs identify by
their URI SAN, not by DNS names) but cannot compare the SPIFFE ID. The comparison therefore
runs in `start_tls` of an httpcore network stream, right after the handshake and before httpcore
writes the request: a server with any other SPIFFE ID (another trust domain, another WFM, a
client SVID posing as the WFM) gets its connection closed and the caller an
`httpx.ConnectError`, having received nothing but the TLS handshake.

Why a reloading transport: SVIDs are short-lived and trust bundles rotate; the operator (or an
agent such as SPIRE's) replaces the files and the client must use them without a restart.
`IdentityTransport` compares the files' stat stamps before every request and rebuilds its
SSLContext and connection pool when they changed. A half-written rotation (a certificate that
does not match its key yet) keeps the previous material and is tried again on the next request;
at start-up the same problem is an `IdentityError`, because a client that cannot present its
identity must not start as if it could.

The same transport also carries the rc.2 profile's server-only TLS (`ServerTrust`): a trust
bundle for the server's certificate with ordinary host name checking, reloaded the same way.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpcore
import httpx
from cryptography import x509

from margo.spiffe import (
    SpiffeId,
    SpiffeIdError,
    SvidError,
    TrustBundleError,
    certificates_to_pem,
    check_validity,
    load_trust_bundle,
    parse_spiffe_id,
    svid_spiffe_id,
)
from reconciler.identity_errors import IdentityError

__all__ = [
    "IdentityError",
    "IdentityTransport",
    "ServerTrust",
    "SpiffeCheckingBackend",
    "SvidMaterial",
    "TlsSetup",
    "expected_wfm_id",
]

log = logging.getLogger("margo.device.identity")

# A rotated file set is read at most this often while it stays broken (a half-written rotation
# would otherwise be re-read, and logged, on every request).
RETRY_BROKEN_SECONDS = 5.0


@dataclass(frozen=True)
class TlsSetup:
    """What one generation of identity files gives: the SSLContext to connect with and, for
    mTLS, the SPIFFE ID the server must present (`expected_peer`) and our own."""

    ssl_context: ssl.SSLContext
    expected_peer: SpiffeId | None = None
    own_id: SpiffeId | None = None
    client_id: str | None = None
    not_after: dt.datetime | None = None


class TlsMaterial(Protocol):
    """Files that define a `TlsSetup`; `load` reads them again."""

    def files(self) -> tuple[Path, ...]: ...

    def load(self) -> TlsSetup: ...


def expected_wfm_id(own: SpiffeId, *, trust_domain: str | None = None,
                    wfm_id: str | None = None) -> tuple[SpiffeId, str | None]:
    """The WFM SPIFFE ID this client accepts, and our client id: `spiffe://<td>/margo/wfm/<id>`
    with the trust domain and WFM id taken from our own client SVID
    (`spiffe://<td>/margo/wfm/<id>/client/<client-id>`) unless configured explicitly."""
    segments = own.segments
    is_client = (len(segments) == 5 and segments[:2] == ("margo", "wfm")
                 and segments[3] == "client")
    if not is_client and (trust_domain is None or wfm_id is None):
        raise IdentityError(f"our SVID {own} is not a Margo client ID "
                            "(spiffe://<td>/margo/wfm/<wfm-id>/client/<client-id>); configure "
                            "identity.trustDomain and identity.wfmId to name the WFM")
    domain = trust_domain if trust_domain is not None else own.trust_domain
    wfm = wfm_id if wfm_id is not None else segments[2]
    try:
        expected = parse_spiffe_id(f"spiffe://{domain}/margo/wfm/{wfm}")
    except SpiffeIdError as exc:
        raise IdentityError(f"cannot form the WFM's SPIFFE ID: {exc}") from None
    return expected, segments[4] if is_client else None


def _context(*, tls12: bool) -> ssl.SSLContext:
    """A client context: TLS 1.3 only unless TLS 1.2 is allowed (RFC 9325: 1.2 shows the
    SPIFFE IDs in clear text, so it is the non-default fallback)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2 if tls12 else ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _anchors(path: Path) -> str:
    try:
        return certificates_to_pem(load_trust_bundle(path))
    except TrustBundleError as exc:
        raise IdentityError(str(exc)) from None


@dataclass(frozen=True)
class SvidMaterial:
    """rc.3: our SVID (leaf + intermediates) and key, and the trust bundle the WFM's SVID must
    chain to. A new context per load replaces the anchors (never merges them), as the
    identity profile requires of a rotated bundle."""

    cert: Path
    key: Path
    trust_bundle: Path
    trust_domain: str | None = None
    wfm_id: str | None = None
    tls12: bool = False

    def files(self) -> tuple[Path, ...]:
        return (self.cert, self.key, self.trust_bundle)

    def load(self) -> TlsSetup:
        leaf = self._leaf()
        try:
            own = svid_spiffe_id(leaf)
            check_validity(leaf)
        except SvidError as exc:
            raise IdentityError(f"{self.cert}: not a usable client SVID: {exc}") from None
        expected, client = expected_wfm_id(own, trust_domain=self.trust_domain,
                                           wfm_id=self.wfm_id)
        context = _context(tls12=self.tls12)
        # SVIDs carry no DNS names: the SPIFFE ID is checked by SpiffeCheckingBackend instead.
        context.check_hostname = False
        context.load_verify_locations(cadata=_anchors(self.trust_bundle))
        try:
            context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise IdentityError(f"{self.cert} / {self.key}: cannot use this certificate and "
                                f"key together: {exc}") from None
        return TlsSetup(context, expected_peer=expected, own_id=own, client_id=client,
                        not_after=leaf.not_valid_after_utc)

    def _leaf(self) -> x509.Certificate:
        try:
            chain = x509.load_pem_x509_certificates(self.cert.read_bytes())
        except OSError as exc:
            raise IdentityError(f"cannot read the SVID {self.cert}: {exc.strerror}") from None
        except ValueError as exc:
            raise IdentityError(f"{self.cert} holds no readable PEM certificate: {exc}") from None
        return chain[0]


@dataclass(frozen=True)
class ServerTrust:
    """Server-only TLS (rc.2, or development over https): the server's certificate is checked
    against `trust_bundle` (the system's CAs when None) and its host name, as any HTTPS
    client does."""

    trust_bundle: Path | None = None
    tls12: bool = True

    def files(self) -> tuple[Path, ...]:
        return () if self.trust_bundle is None else (self.trust_bundle,)

    def load(self) -> TlsSetup:
        context = _context(tls12=self.tls12)
        context.check_hostname = True
        if self.trust_bundle is None:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        else:
            context.load_verify_locations(cadata=_anchors(self.trust_bundle))
        return TlsSetup(context)


# --- the SPIFFE ID check, between handshake and request ---------------------------------------


class _CheckedStream(httpcore.NetworkStream):
    """A TCP stream whose TLS upgrade is accepted only for the expected SPIFFE ID."""

    def __init__(self, inner: httpcore.NetworkStream, expected: SpiffeId) -> None:
        self._inner = inner
        self._expected = expected

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        tls = self._inner.start_tls(ssl_context, server_hostname, timeout)
        try:
            peer = _peer_spiffe_id(tls)
        except SvidError as exc:
            tls.close()
            raise httpcore.ConnectError(f"refused the server: its certificate is not an "
                                        f"X.509-SVID: {exc.reason}") from None
        if peer != self._expected:
            tls.close()
            raise httpcore.ConnectError(f"refused the server: it presented {peer}, expected "
                                        f"exactly {self._expected}")
        return tls


def _peer_spiffe_id(tls: httpcore.NetworkStream) -> SpiffeId:
    sock = tls.get_extra_info("socket")
    der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
    if not der:
        raise SvidError("no peer certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise SvidError(f"unreadable peer certificate: {exc}") from None
    return svid_spiffe_id(cert)


class SpiffeCheckingBackend(httpcore.NetworkBackend):
    """httpcore's synchronous backend, with `_CheckedStream` around every TCP connection."""

    def __init__(self, expected: SpiffeId,
                 backend: httpcore.NetworkBackend | None = None) -> None:
        self.expected = expected
        self._backend = backend or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _CheckedStream(stream, self.expected)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("Unix sockets are not used for the WFM connection")

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _SetupTransport(httpx.HTTPTransport):
    """httpx's own transport (its request mapping, streaming and exception translation) over a
    pool built for one `TlsSetup`. httpx does not take a network backend, so the pool it
    builds is replaced by an identical one that has ours."""

    def __init__(self, setup: TlsSetup, limits: httpx.Limits) -> None:
        super().__init__(verify=setup.ssl_context, limits=limits, trust_env=False)
        backend = (SpiffeCheckingBackend(setup.expected_peer)
                   if setup.expected_peer is not None else None)
        self._pool = httpcore.ConnectionPool(
            ssl_context=setup.ssl_context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=backend)


def _stamp(paths: Iterable[Path]) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is rewritten or replaced (mtime, size, inode)."""
    stamps = []
    for path in paths:
        info = os.stat(path)
        stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
    return tuple(stamps)


class IdentityTransport(httpx.BaseTransport):
    """An httpx transport that connects with the identity in `material`'s files and follows
    their rotation (see the module docstring). Raises `IdentityError` from the constructor
    when the files are unusable; later problems keep the last good setup."""

    def __init__(self, material: TlsMaterial, *, limits: httpx.Limits | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.material = material
        self._limits = limits or httpx.Limits()
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        try:
            stamp = _stamp(material.files())
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {exc.filename}: {exc.strerror}"
                                ) from None
        self._setup = material.load()
        self._stamp = stamp
        self._inner = _SetupTransport(self._setup, self._limits)
        self._broken: tuple[Any, float] | None = None  # (stamp, when) of a failed reload
        self.reloads = 0

    @property
    def setup(self) -> TlsSetup:
        """The identity in use now (after picking up any rotation)."""
        with self._lock:
            self._refresh()
            return self._setup

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self._refresh()
            inner = self._inner
        return inner.handle_request(request)

    def close(self) -> None:
        with self._lock:
            self._inner.close()

    def _refresh(self) -> None:
        """Rebuild from the files when they changed; keep the last good setup otherwise."""
        try:
            stamp = _stamp(self.material.files())
        except OSError as exc:  # a file is being replaced right now: try again next time
            log.warning("identity file %s unreadable (%s); keeping the current identity",
                        exc.filename, exc.strerror)
            return
        if stamp == self._stamp:
            return
        if self._broken is not None and self._broken[0] == stamp and \
                self._clock() - self._broken[1] < RETRY_BROKEN_SECONDS:
            return
        try:
            setup = self.material.load()
        except IdentityError as exc:
            log.warning("rotated identity files are not usable yet (%s); keeping the current "
                        "identity", exc)
            self._broken = (stamp, self._clock())
            return
        old = self._inner
        self._setup, self._stamp, self._broken = setup, stamp, None
        self._inner = _SetupTransport(setup, self._limits)
        self.reloads += 1
        # Connections of the old generation authenticated with the old identity: close them,
        # so nothing keeps talking under a rotated-away SVID or a removed trust anchor.
        old.close()
        log.info("identity reloaded%s", f" ({setup.own_id})" if setup.own_id else "")
