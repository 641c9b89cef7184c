"""Sealed parameter values on the device: kept sealed everywhere, opened only in memory, by
the driver, just before it hands a component's values to its engine.

A sensitive parameter's `value` arrives as an envelope (`margo.sealing`:
`margo-sealed:v1:<key fingerprint>:<mac>:<age ciphertext>`), and stays one in everything the
device keeps or says: the adopted documents, `DesiredComponent.values`, the journal, status
reports, logs. A driver calls `open_values` for the component it is about to apply and gives
the engine `Opened.values`; whatever the engine then says about it passes through
`Opened.redacting`, so no error message carries a plaintext.

Digests compare like with like without opening anything: `digest_form` replaces each
envelope by its mac (the server's keyed digest of the plaintext), so the planner's
`values_digest` changes when a plaintext changes, and not when the server merely seals the
same plaintext again (after this device's key rotated: a new ciphertext, the same mac).
`envelopes` lists the envelopes' exact text, for the runner's retry key: a failure to open
one is retried when the server sends another, not before.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from margo.sealing import PREFIX, SealError, is_sealed, parse_sealed
from reconciler.errors import ApplyError, ErrorCode

__all__ = ["REDACTED", "Opened", "Opener", "digest_form", "envelopes", "open_values"]

#: What stands in a message where a plaintext was.
REDACTED = "<sealed value>"


class Opener(Protocol):
    """What opens envelopes: the device's key (`reconciler.encryption_key.DeviceKey`)."""

    def open_sealed(self, value: str) -> str:
        """The plaintext; `SealError` (or `ValueError` for an unusable key) otherwise."""
        ...


def digest_form(value: Any) -> Any:
    """`value` with every envelope replaced by `margo-sealed:v1:<its mac>` (a malformed one
    is kept whole): equal for equal plaintexts whatever the ciphertext, and unchanged when
    nothing is sealed, so existing digests stay what they were."""
    if isinstance(value, str) and is_sealed(value):
        try:
            return f"{PREFIX}{parse_sealed(value).mac}"
        except SealError:
            return value
    if isinstance(value, Mapping):
        return {key: digest_form(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [digest_form(item) for item in value]
    return value


def envelopes(value: Any) -> list[str]:
    """Every envelope in `value`, in a stable order."""
    if isinstance(value, str):
        return [value] if is_sealed(value) else []
    if isinstance(value, Mapping):
        return [text for key in sorted(value, key=str) for text in envelopes(value[key])]
    if isinstance(value, list | tuple):
        return [text for item in value for text in envelopes(item)]
    return []


def _forms(plaintext: str) -> list[str]:
    """How a plaintext may appear in an engine's message: as it is, JSON-escaped, base64
    (a Kubernetes Secret's data)."""
    forms = {plaintext, json.dumps(plaintext, ensure_ascii=False)[1:-1],
             base64.b64encode(plaintext.encode("utf-8")).decode("ascii")}
    return sorted((form for form in forms if form), key=len, reverse=True)


@dataclass(frozen=True)
class Opened:
    """A component's values with every envelope opened (`values`), the plaintexts (for
    redaction), and where they were: Compose variable names, Helm value paths."""

    values: dict[str, Any]
    secrets: tuple[str, ...] = ()
    paths: frozenset[str] = frozenset()
    #: A random key for digests of the opened values (Helm's read-back), so that no plain
    #: hash of a secret ever reaches a message; None when nothing was sealed.
    digest_key: bytes | None = field(default=None, repr=False)

    def redact(self, text: str) -> str:
        for plaintext in self.secrets:
            for form in _forms(plaintext):
                text = text.replace(form, REDACTED)
        return text

    @contextmanager
    def redacting(self) -> Iterator[None]:
        """Every `ApplyError` raised inside, with the plaintexts taken out of its message
        (and its cause dropped: the engine's own exception may quote them)."""
        try:
            yield
        except ApplyError as exc:
            if not self.secrets:
                raise
            raise ApplyError(exc.code, self.redact(exc.message),
                             retryable=exc.retryable) from None


def _where(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "(the whole value)"


def open_values(values: Mapping[str, Any], key: Opener | None, *, component: str) -> Opened:
    """`values` (Helm values or a Compose environment) with every envelope opened by `key`.
    `ApplyError(SECRET_UNREADABLE)`, not retryable (the same envelope can never open later;
    a new one from the server is a new desired state), naming the component and where the
    value goes, when one cannot be opened or the device has no key."""
    secrets: list[str] = []
    paths: set[str] = set()

    def walk(value: Any, path: tuple[str | int, ...]) -> Any:
        if isinstance(value, str) and is_sealed(value):
            where = _where(path)
            if key is None:
                raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"component {component!r}: "
                                 f"{where} is sealed, and this driver has no key to open it",
                                 retryable=False)
            try:
                plaintext = key.open_sealed(value)
            except SealError as exc:
                raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"component {component!r}: "
                                 f"the sealed value for {where}: {exc}",
                                 retryable=False) from None
            except ValueError as exc:  # the key file itself (EncryptionKeyError)
                raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"component {component!r}: "
                                 f"{exc}") from None
            secrets.append(plaintext)
            paths.add(where)
            return plaintext
        if isinstance(value, Mapping):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        return value

    opened = {str(k): walk(v, (str(k),)) for k, v in values.items()}
    if not secrets:
        return Opened(dict(values))  # nothing sealed: exactly what was given
    return Opened(opened, tuple(sorted(set(secrets), key=len, reverse=True)),
                  frozenset(paths), os.urandom(32))
