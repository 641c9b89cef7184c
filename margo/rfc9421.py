"""The rc.2 request-signing profile both sides share: RFC 9421 message signatures with the
algorithms Margo rc.2 lists, the key id the conformance kit computes, and the onboarding
document's type.

The device signs (`reconciler.signing`) and the fleet server verifies (`wfm.signatures`);
if the two disagreed on an algorithm's parameters or on the key id, every request would be
a 401. So the profile is defined once, here, as `margo.spiffe` defines identities once:

- algorithms: `ecdsa-p256-sha256`, `ecdsa-p384-sha384`, `rsa-v1_5-sha256` and
  `rsa-pss-sha256`, which Margo rc.2 lists but RFC 9421's registry (and so the
  `http-message-signatures` library) does not: it is added as the library's documented
  extension point, signing with a salt of the digest's length and verifying any salt;
- which of them a key may use (`profile_algorithms`): P-256 and P-384 keys their ECDSA
  algorithm, RSA keys of at least 2048 bits either RSA algorithm (PSS first, the default);
- the key id: lowercase hex SHA-256 of the public key's SubjectPublicKeyInfo DER.
"""

from __future__ import annotations

import hashlib
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from http_message_signatures import HTTPSignatureAlgorithm, algorithms

from margo.signature_names import ALGORITHM_NAMES

__all__ = ["ALGORITHMS", "ONBOARDING_API_VERSION", "ONBOARDING_KIND", "RSA_PSS_SHA256",
           "key_id", "profile_algorithms"]

ONBOARDING_API_VERSION = "onboarding.margo.org/v1alpha1"
ONBOARDING_KIND = "OnboardingRequest"


class RSA_PSS_SHA256(algorithms.RSA_PSS_SHA512):
    """RSASSA-PSS with SHA-256: MGF1-SHA-256; signs with a salt of the digest length (32
    bytes), verifies any salt length (another implementation may choose its own)."""

    algorithm_id = "rsa-pss-sha256"

    def __init__(self, public_key: Any = None, private_key: Any = None,
                 password: bytes | None = None) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            public_key=public_key, private_key=private_key, password=password)
        self.padding = padding.PSS(mgf=padding.MGF1(hashes.SHA256()),
                                   salt_length=padding.PSS.DIGEST_LENGTH)
        self.hash_algorithm = hashes.SHA256()

    def verify(self, signature: bytes, message: bytes) -> None:
        self.public_key.verify(signature=signature, data=message, algorithm=self.hash_algorithm,
                               padding=padding.PSS(mgf=padding.MGF1(hashes.SHA256()),
                                                   salt_length=padding.PSS.AUTO))


#: Each of `ALGORITHM_NAMES` (the names, light to import) with its implementation.
ALGORITHMS: dict[str, type[HTTPSignatureAlgorithm]] = dict(zip(ALGORITHM_NAMES, (
    algorithms.ECDSA_P256_SHA256, algorithms.ECDSA_P384_SHA384, algorithms.RSA_V1_5_SHA256,
    RSA_PSS_SHA256), strict=True))


def key_id(public_key: Any) -> str:
    """The kit's key id: lowercase hex SHA-256 of the public key's SubjectPublicKeyInfo DER."""
    der = public_key.public_bytes(serialization.Encoding.DER,
                                  serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def profile_algorithms(key: Any) -> tuple[str, ...]:
    """The profile's algorithms a key (private or public) may sign with, the default
    first; empty when rc.2 allows none (Ed25519, other curves, RSA below 2048 bits)."""
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return {"secp256r1": ("ecdsa-p256-sha256",),
                "secp384r1": ("ecdsa-p384-sha384",)}.get(key.curve.name, ())
    if isinstance(key, rsa.RSAPrivateKey | rsa.RSAPublicKey) and key.key_size >= 2048:
        return ("rsa-pss-sha256", "rsa-v1_5-sha256")
    return ()
