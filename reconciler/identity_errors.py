"""Why a device's identity cannot be used: rc.3 identity material (`reconciler.identity`),
an rc.2 signing key (`reconciler.signing`) and rc.2 onboarding.

Apart from the modules that raise them so that `margo device run`, which turns each into a
usage error, catches them without loading `cryptography` and the signing library on a
device that uses neither (a bearer-token device: docs/device.md, "What a device loads").
"""

from __future__ import annotations

__all__ = ["IdentityError", "OnboardingError", "SigningError"]


class IdentityError(Exception):
    """The identity material cannot be used: a missing or unreadable file, a certificate that
    is not a client SVID, a key that does not match, an empty trust bundle."""


class SigningError(Exception):
    """The rc.2 key or certificate cannot be used (unreadable, unsupported type, mismatch)."""


class OnboardingError(Exception):
    """Onboarding did not give a clientId. `status` is the HTTP status (None: no answer);
    `retryable` is False when the same request cannot succeed later (an unreadable
    certificate), True when it may (no connection; a rejection an operator can lift)."""

    def __init__(self, message: str, *, status: int | None = None,
                 retryable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
