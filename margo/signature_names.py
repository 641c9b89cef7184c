"""The names of the rc.2 request-signing algorithms (`margo.rfc9421` implements them).

Apart from the implementations because what only names them, the device client's
configuration schema above all, should not load `cryptography` and
`http-message-signatures` (about 9 MiB resident) on a device that never signs.
"""

from __future__ import annotations

__all__ = ["ALGORITHM_NAMES"]

#: Margo rc.2's algorithms, the default of an RSA key (PSS) after its alternative.
ALGORITHM_NAMES = ("ecdsa-p256-sha256", "ecdsa-p384-sha384", "rsa-v1_5-sha256",
                   "rsa-pss-sha256")
