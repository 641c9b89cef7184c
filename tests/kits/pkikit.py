"""A test PKI minted at run time: SPIFFE CAs, X.509-SVIDs and rc.2 device certificates.

The conformance kit's certificates expire on fixed dates; tests that used them would start
failing on a date nobody chose. Everything here is generated fresh with `cryptography`, in the
shapes the kit uses (EC P-256 CA, SVIDs with one spiffe URI SAN and serverAuth+clientAuth),
plus the malformed shapes the refusal tests need (CA-flagged leaves, several URI SANs, wrong
dates). Imported by bare name (`from pkikit import ...`) from tests/wfm and tests/reconciler.
`make_lab` + `running_tls_server` run a real `margo serve` with mutual TLS on loopback.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kits.processkit import free_port, stop, wait_until_ready

__all__ = [
    "Ca",
    "Lab",
    "PrivateKey",
    "Svid",
    "client_context",
    "client_spiffe_id",
    "issue_client_svid",
    "issue_svid",
    "issue_wfm_svid",
    "make_ca",
    "make_key",
    "make_lab",
    "make_self_signed",
    "running_tls_server",
    "tls_client",
    "write_pem",
]

ROOT = Path(__file__).resolve().parents[2]

PrivateKey = Any  # ec / rsa / ed25519 private keys
HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)


def make_key(key_type: str = "ec-p256") -> PrivateKey:
    """`ec-p256` (the mandatory one), `ec-p384`, `rsa-2048`, `rsa-3072` or `ed25519`."""
    if key_type == "ec-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "ec-p384":
        return ec.generate_private_key(ec.SECP384R1())
    if key_type.startswith("rsa-"):
        return rsa.generate_private_key(public_exponent=65537, key_size=int(key_type[4:]))
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(f"unknown key type {key_type!r}")


def _hash_for(key: PrivateKey) -> hashes.HashAlgorithm | None:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return None
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.key_size > 256:
        return hashes.SHA384()
    return hashes.SHA256()


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_pem(path: Path, *items: x509.Certificate | PrivateKey) -> Path:
    """Write certificates and/or keys, in order, as one PEM file; return the path."""
    chunks = [cert_pem(i) if isinstance(i, x509.Certificate) else key_pem(i) for i in items]
    path.write_bytes(b"".join(chunks))
    return path


def _window(not_before: dt.datetime | None,
            not_after: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    return not_before or now - HOUR, not_after or now + DAY


@dataclass
class Ca:
    """A SPIFFE signing authority (root or intermediate) for one trust domain."""

    trust_domain: str
    key: PrivateKey
    cert: x509.Certificate
    parents: list[x509.Certificate] = field(default_factory=list)  # intermediates above, to root

    @property
    def root(self) -> x509.Certificate:
        return self.parents[-1] if self.parents else self.cert

    @property
    def chain(self) -> list[x509.Certificate]:
        """What a leaf issued here sends after itself: this CA and the CAs above it, without
        the root (which the verifier already holds)."""
        return [self.cert, *self.parents][:-1]

    def write(self, path: Path) -> Path:
        """The root certificate as a PEM trust bundle."""
        return write_pem(path, self.root)

    def write_key(self, directory: Path) -> tuple[Path, Path]:
        """`ca.pem` + `ca-key.pem` in a directory, the layout `margo clients issue --ca` reads."""
        directory.mkdir(parents=True, exist_ok=True)
        return write_pem(directory / "ca.pem", self.cert), write_pem(directory / "ca-key.pem",
                                                                     self.key)


def make_ca(trust_domain: str = "margo.test", *, key_type: str = "ec-p256",
            parent: Ca | None = None, not_before: dt.datetime | None = None,
            not_after: dt.datetime | None = None, name: str | None = None) -> Ca:
    """A root CA (or, with `parent`, an intermediate) whose certificate carries the trust
    domain's SPIFFE ID as its URI SAN, as SPIRE-style authorities do."""
    key = make_key(key_type)
    start, end = _window(not_before, not_after or dt.datetime.now(dt.UTC) + 30 * DAY)
    level = "intermediate" if parent else "root"
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "margo-gitops tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME,
                                            name or f"{trust_domain} {level} CA")])
    issuer_name = parent.cert.subject if parent else subject
    signer = parent.key if parent else key
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=False, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.SubjectAlternativeName(
                   [x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]),
                   critical=False))
    if parent is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(parent.key.public_key()),
            critical=False)
    cert = builder.sign(signer, _hash_for(signer))
    parents = [parent.cert, *parent.parents] if parent else []
    return Ca(trust_domain, key, cert, parents)


@dataclass
class Svid:
    """A leaf certificate, its key and the intermediates it presents."""

    key: PrivateKey
    cert: x509.Certificate
    intermediates: list[x509.Certificate]

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """`<stem>-cert.pem` (leaf + intermediates) and `<stem>-key.pem`."""
        directory.mkdir(parents=True, exist_ok=True)
        return (write_pem(directory / f"{stem}-cert.pem", self.cert, *self.intermediates),
                write_pem(directory / f"{stem}-key.pem", self.key))

    @property
    def cert_pem(self) -> bytes:
        return b"".join(cert_pem(c) for c in (self.cert, *self.intermediates))

    @property
    def key_pem(self) -> bytes:
        return key_pem(self.key)


def issue_svid(ca: Ca, spiffe_id: str | None, *, not_before: dt.datetime | None = None,
               not_after: dt.datetime | None = None, ca_flag: bool = False,
               extra_uris: Sequence[str] = (), key_type: str = "ec-p256",
               key_cert_sign: bool = False, dns_names: Sequence[str] = (),
               ip_addresses: Sequence[str] = (), common_name: str | None = None) -> Svid:
    """An X.509-SVID for `spiffe_id` (None: no URI SAN at all) signed by `ca`. The keyword
    arguments produce the malformed shapes: `ca_flag` (cA=true), `extra_uris` (several URI
    SANs), `key_cert_sign`, dates outside now."""
    key = make_key(key_type)
    start, end = _window(not_before, not_after)
    names: list[x509.GeneralName] = []
    if spiffe_id is not None:
        names.append(x509.UniformResourceIdentifier(spiffe_id))
    names += [x509.UniformResourceIdentifier(u) for u in extra_uris]
    names += [x509.DNSName(d) for d in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "margo-gitops tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME,
                                            common_name or (spiffe_id or "no-uri")[-64:])])
    signing = key_cert_sign or ca_flag
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=ca_flag, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, content_commitment=False,
                   key_encipherment=isinstance(key, rsa.RSAPrivateKey), data_encipherment=False,
                   key_agreement=False, key_cert_sign=signing, crl_sign=False,
                   encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca.key.public_key()), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca.key, _hash_for(ca.key))
    return Svid(key, cert, ca.chain)


def client_spiffe_id(trust_domain: str, wfm_id: str, client_id: str) -> str:
    return f"spiffe://{trust_domain}/margo/wfm/{wfm_id}/client/{client_id}"


def issue_client_svid(ca: Ca, wfm_id: str, client_id: str, **kwargs: Any) -> Svid:
    """A device client's SVID in the CA's trust domain."""
    return issue_svid(ca, client_spiffe_id(ca.trust_domain, wfm_id, client_id), **kwargs)


def issue_wfm_svid(ca: Ca, wfm_id: str, *, dns_names: Sequence[str] = ("localhost",),
                   ip_addresses: Sequence[str] = ("127.0.0.1",), **kwargs: Any) -> Svid:
    """The WFM's server SVID `spiffe://<td>/margo/wfm/<wfm-id>`. It also names localhost and
    127.0.0.1 so plain TLS clients that check host names can talk to a test server; SVID
    verifiers ignore DNS/IP SANs."""
    return issue_svid(ca, f"spiffe://{ca.trust_domain}/margo/wfm/{wfm_id}",
                      dns_names=dns_names, ip_addresses=ip_addresses, **kwargs)


def make_self_signed(key_type: str = "ec-p256", *, common_name: str = "device",
                     not_before: dt.datetime | None = None,
                     not_after: dt.datetime | None = None) -> tuple[PrivateKey, x509.Certificate]:
    """An rc.2 device identity: a self-signed certificate, as the kit's `openssl req -x509`
    makes one (EC P-256 by default)."""
    key = make_key(key_type)
    start, end = _window(not_before, not_after)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Margo"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, _hash_for(key)))
    return key, cert


# --- serving and calling with this PKI -------------------------------------------------------


@dataclass
class Lab:
    """A trust domain with a WFM SVID and files on disk: what `margo serve --tls-cert` needs."""

    directory: Path
    ca: Ca
    wfm_id: str
    wfm: Svid
    bundle: Path
    wfm_cert: Path
    wfm_key: Path

    @property
    def trust_domain(self) -> str:
        return self.ca.trust_domain

    def client(self, client_id: str, stem: str | None = None, *, ca: Ca | None = None,
               wfm_id: str | None = None, **kwargs: Any) -> tuple[Path, Path]:
        """Issue a client SVID (by default a good one) and write it; return (cert, key)."""
        svid = issue_client_svid(ca or self.ca, wfm_id or self.wfm_id, client_id, **kwargs)
        return svid.write(self.directory, stem or f"client-{client_id}")

    def serve_args(self, *extra: str) -> list[str]:
        return ["--tls-cert", str(self.wfm_cert), "--tls-key", str(self.wfm_key),
                "--trust-bundle", str(self.bundle), *extra]


def make_lab(directory: Path, trust_domain: str = "factory.test", wfm_id: str = "wfm-1") -> Lab:
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(trust_domain)
    wfm = issue_wfm_svid(ca, wfm_id)
    cert, key = wfm.write(directory, "wfm")
    return Lab(directory, ca, wfm_id, wfm, ca.write(directory / "bundle.pem"), cert, key)


def client_context(cert: Path | None, key: Path | None, bundle: Path) -> ssl.SSLContext:
    """What a device uses: trust the bundle for the server, present its SVID (if any)."""
    context = ssl.create_default_context(cafile=str(bundle))
    if cert is not None and key is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def tls_client(base: str, cert: Path | None, key: Path | None, bundle: Path,
               **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=base, verify=client_context(cert, key, bundle), timeout=10,
                        **kwargs)


@contextmanager
def running_tls_server(data: Path, lab: Lab, *extra: str,
                       ready: tuple[Path, Path] | None = None) -> Iterator[str]:
    """Start `margo serve` with the lab's TLS material (plus `extra` options); yield its
    https base URL; stop it (SIGTERM) afterwards. Readiness is probed with `ready` (a client
    SVID) or, without one, with a bare TLS client (for servers not requiring certificates)."""
    port = free_port()
    log_path = data.parent / f"server-{port}.log"
    data.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "margo_cli.main", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--data", str(data), "--log-level", "warning", *lab.serve_args(*extra)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"https://127.0.0.1:{port}"
    cert, key = ready if ready else (None, None)
    try:
        with tls_client(base, cert, key, lab.bundle) as http:
            wait_until_ready(process, lambda: http.get("/healthz", timeout=1)
                             .status_code == 200, "server", log_path)
        yield base
    finally:
        stop(process)
        log.close()
