"""The server's certificate authority for rc.2 onboarding (`GET /api/v1/onboarding/certificate`).

rc.2 devices download the WFM's root CA certificate before onboarding. On first start the
server creates an EC P-256 CA (ten years) under `<data>/ca/`, the key readable only by the
server's user; later starts reuse it. Replicas on PostgreSQL share one CA, kept in the
database (`ensure_shared_ca`). The identity work (mutual TLS, request signatures)
builds on the same directory.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from margo.files import write_atomically
from wfm.store import identity_rows
from wfm.store.database import Connection, Database

__all__ = ["ensure_ca", "ensure_shared_ca"]


def _new_ca(common_name: str) -> tuple[str, str]:
    """A fresh CA: (certificate PEM, PKCS#8 key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode("ascii")
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii"), key_pem


def ensure_ca(directory: Path, *, common_name: str = "margo-gitops WFM CA") -> str:
    """The CA certificate (PEM), created on first use."""
    certificate = directory / "ca.pem"
    if certificate.exists():
        return certificate.read_text("ascii")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem, key_pem = _new_ca(common_name)
    _write_key(directory / "ca-key.pem", key_pem)
    write_atomically(certificate, pem)
    return pem


def ensure_shared_ca(db: Database, *, common_name: str = "margo-gitops WFM CA") -> str:
    """With replicas: the one CA they all serve, kept in the database; the first replica to
    start creates it (a concurrent second one keeps the first's)."""
    found = db.read(_read_ca)
    if found is not None:
        return found
    pem, key_pem = _new_ca(common_name)
    db.write_sync(lambda conn: identity_rows.offer_ca(conn, _ONBOARDING, pem, key_pem))
    stored = db.read(_read_ca)
    assert stored is not None
    return stored


_ONBOARDING = "onboarding"


def _read_ca(conn: Connection) -> str | None:
    return identity_rows.ca_certificate(conn, _ONBOARDING)


def _write_key(path: Path, key_pem: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key_pem)
