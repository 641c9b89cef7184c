"""The certificates and keys a loopback Kubernetes control plane needs.

A real API server only serves TLS and only trusts clients whose certificates its client CA
signed, so a test cluster needs the same small PKI as a kubeadm cluster: one CA, the API
server's serving certificate (valid for 127.0.0.1 and the in-cluster names), one client
certificate per component (the Common Name is the user, the Organisation the group:
`system:masters` is the built-in superuser group) and the key pair that signs service
account tokens. Everything is ECDSA P-256 and written with mode 0600 where it is private.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["ClientCert", "Pki", "create_pki", "issue_client_cert"]

_VALID = datetime.timedelta(days=365)
#: Client identities every control plane gets: file stem → (user, groups).
COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("margo-admin", ("system:masters",)),
    "controller-manager": ("system:kube-controller-manager", ()),
    "scheduler": ("system:kube-scheduler", ()),
    # kwok plays every kubelet: it writes node and pod status, which the Node authorizer
    # would only let each node do for itself.
    "kwok": ("kwok-controller", ("system:masters",)),
    # The API server's identity towards real kubelets (logs, exec, port-forward).
    "kubelet-client": ("kube-apiserver-kubelet-client", ()),
}


@dataclass(frozen=True)
class ClientCert:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Paths of everything `create_pki` wrote."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    service_account_key: Path
    service_account_pub: Path
    clients: dict[str, ClientCert]


def _write(path: Path, data: bytes, private: bool) -> Path:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str, organisations: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organisations]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _sign(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool,
          usage: list[x509.ObjectIdentifier] | None = None,
          names: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + _VALID)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, key_encipherment=not ca, key_cert_sign=ca,
                   crl_sign=ca, content_commitment=False, data_encipherment=False,
                   key_agreement=False, encipher_only=False, decipher_only=False),
                   critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def create_pki(folder: Path, *, service_ip: str = "10.0.0.1") -> Pki:
    """Write a fresh PKI into `folder` (created, mode 0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("margo-gitops test cluster CA")
    ca = _sign(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _sign(_name("kube-apiserver"), server_key, ca_name, ca_key, ca=False,
                   usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                   names=[x509.DNSName(n) for n in (
                       "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                       "kubernetes.default.svc.cluster.local")]
                   + [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1",
                                                                          service_ip)])
    clients: dict[str, ClientCert] = {}
    for stem, (user, groups) in COMPONENTS.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _sign(_name(user, groups), key, ca_name, ca_key, ca=False,
                     usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
        clients[stem] = ClientCert(_write(folder / f"{stem}.crt", _pem(cert), False),
                                   _write(folder / f"{stem}.key", _key_pem(key), True))
    account_key = ec.generate_private_key(ec.SECP256R1())
    return Pki(
        ca_cert=_write(folder / "ca.crt", _pem(ca), False),
        ca_key=_write(folder / "ca.key", _key_pem(ca_key), True),
        server_cert=_write(folder / "apiserver.crt", _pem(server), False),
        server_key=_write(folder / "apiserver.key", _key_pem(server_key), True),
        service_account_key=_write(folder / "sa.key", _key_pem(account_key), True),
        service_account_pub=_write(folder / "sa.pub", account_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
            False),
        clients=clients)


def issue_client_cert(pki: Pki, folder: Path, stem: str, user: str,
                      groups: tuple[str, ...] = ()) -> ClientCert:
    """A client certificate signed by the cluster's CA, written to `folder/<stem>.crt` and
    `.key`: a real node's kubelet (`system:node:<name>` in `system:nodes`) and kube-proxy
    (`system:kube-proxy`) each get one when the node starts."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _sign(_name(user, groups), key, ca.subject, ca_key, ca=False,
                 usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    return ClientCert(_write(folder / f"{stem}.crt", _pem(cert), False),
                      _write(folder / f"{stem}.key", _key_pem(key), True))
