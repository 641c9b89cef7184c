"""The device client's one error vocabulary: every failure it reports has a short, stable
code, a message for people and whether retrying without a change can help.

    DeviceError (code, message, retryable)
    ├── ApplyError             a step failed: drivers, chart cache, OCI client, packages
    │   └── UnsafePackageError   a Compose package refused before extraction
    │                            (reconciler.compose_package)
    └── SourceError            fetching desired state failed (+ retry_after)
        └── IntegrityError       what was fetched must not be used (digest mismatch,
                                 manifestVersion rollback, invalid document)

Codes are `ErrorCode` members, a `StrEnum`: a member *is* its string, so status reports,
logs and comparisons with literals see the same text. A source also reports `HTTP_<status>`
for servers that answer with an error, which is the one code made at run time.

This module sits at the bottom of `reconciler/` and imports nothing from it, so the OCI
client, the chart cache and the package checks need not import the drivers.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ApplyError", "DeviceError", "ErrorCode", "IntegrityError", "SourceError"]


class ErrorCode(StrEnum):
    # The engine (Helm, Docker) and the steps it runs.
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"
    INSTALL_FAILED = "INSTALL_FAILED"
    UPGRADE_FAILED = "UPGRADE_FAILED"
    UNINSTALL_FAILED = "UNINSTALL_FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    DRIFTED = "DRIFTED"
    INVALID_STEP = "INVALID_STEP"
    UNSUPPORTED_TYPE = "UNSUPPORTED_TYPE"
    RENDER_FAILED = "RENDER_FAILED"
    #: The engine's own view, read back after a step, is not what the step applied
    #: (`reconciler.drivers.readback`).
    READBACK_MISMATCH = "READBACK_MISMATCH"
    # Packages: charts and Compose archives from OCI registries.
    PULL_FAILED = "PULL_FAILED"
    PUSH_FAILED = "PUSH_FAILED"
    DIGEST_MISMATCH = "DIGEST_MISMATCH"
    UNSUPPORTED_DIGEST = "UNSUPPORTED_DIGEST"
    INVALID_PACKAGE = "INVALID_PACKAGE"
    UNSAFE_PACKAGE = "UNSAFE_PACKAGE"
    TOO_LARGE = "TOO_LARGE"
    UNSUPPORTED_REPOSITORY = "UNSUPPORTED_REPOSITORY"
    INVALID_REVISION = "INVALID_REVISION"
    CHART_INVALID = "CHART_INVALID"
    # Desired state: the REST manifest and the device's Git repository.
    UNREACHABLE = "UNREACHABLE"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    NOT_FOUND = "NOT_FOUND"
    NO_BRANCH = "NO_BRANCH"
    GIT_ERROR = "GIT_ERROR"
    ROLLBACK = "ROLLBACK"
    INVALID_MANIFEST = "INVALID_MANIFEST"
    INVALID_BUNDLE = "INVALID_BUNDLE"
    INVALID_DOCUMENT = "INVALID_DOCUMENT"
    BAD_RESPONSE = "BAD_RESPONSE"
    # Sealed parameter values (reconciler.sealed_values): malformed, tampered with, sealed to
    # a key this device does not hold, or no key to open them with. The message names the
    # component and where the value goes, never the value.
    SECRET_UNREADABLE = "SECRET_UNREADABLE"
    # The render driver would write opened sealed values inside the device's data directory
    # (its outputDir defaults there), which must never hold a secret in clear.
    SECRET_EXPOSED = "SECRET_EXPOSED"


class DeviceError(Exception):
    """A failure with a code (an `ErrorCode`, or `HTTP_<status>` from a source), a message
    for people, and whether the next cycle should try again without the desired state
    changing (a registry outage: yes; a chart that rejects its values: no)."""

    def __init__(self, code: str, message: str, *, retryable: bool = True) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class ApplyError(DeviceError):
    """A step failed; `code` is reported as the component's `error.code` and `message` is
    the engine's own explanation."""


class SourceError(DeviceError):
    """Fetching desired state failed; `retry_after` is the server's `Retry-After` in
    seconds, when it sent one."""

    def __init__(self, code: str, message: str, *, retryable: bool = True,
                 retry_after: float | None = None) -> None:
        super().__init__(code, message, retryable=retryable)
        self.retry_after = retry_after


class IntegrityError(SourceError):
    """The server sent something that must not be used: a digest mismatch, a manifestVersion
    rollback, an unsupported digest algorithm, an invalid document. The whole update is
    discarded and the previous state kept; it is logged as a security event."""
