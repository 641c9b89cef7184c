"""The server's certificate authority for rc.2 onboarding (`GET /api/v1/onboarding/certificate`).

rc.2 devices download the WFM's root CA certificate before onboarding. On first start the
server creates an EC P-256 CA (ten years) under `<data>/ca/`, the key readable only by the
server's user; later starts reuse it. The identity work (mutual TLS, request signatures)
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

__all__ = ["ensure_ca"]


def ensure_ca(directory: Path, *, common_name: str = "margo-gitops WFM CA") -> str:
    """The CA certificate (PEM), created on first use."""
    certificate = directory / "ca.pem"
    if certificate.exists():
        return certificate.read_text("ascii")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    key_path = directory / "ca-key.pem"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pem = cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
    write_atomically(certificate, pem)
    return pem
