"""Sealed parameter values: a secret encrypted to one device's own key, in the one string the
ApplicationDeployment schemas allow for a parameter value (docs/secrets.md).

Why a string envelope: every generation's ApplicationDeployment schema closes a parameter to
`value` and `targets`, so the sealed value travels as the value itself:

    margo-sealed:v1:<recipient fingerprint>:<mac>:<age ciphertext, base64 without padding>

* the ciphertext is an age file (age-encryption.org/v1, X25519 recipient stanza, through
  pyrage, the maintained binding of the rage implementation) encrypted to the device's
  recipient: only the device's identity file opens it;
* the recipient fingerprint (first 16 hex digits of SHA-256 of the `age1...` text) says
  which device key it was sealed to, so the compiler re-seals after a device key rotation
  and the device can tell "sealed to another key" from "damaged";
* the mac is a keyed digest of (device, parameter, plaintext) under a key derived from the
  fleet key. The compiler compares it to decide whether the plaintext changed, and keeps
  the previous ciphertext when it did not (age encryption is randomised: re-sealing every
  compile would change every device's bytes). Without the fleet key it says nothing about
  the plaintext, unlike a plain hash of a low-entropy password.

A device advertises its recipient in its capability report under
`x-margo-gitops-extensions.encryptionKey` (`device_recipient` reads it). Errors never quote
a value: `SealError` messages name the parameter and what failed, nothing else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import pyrage

__all__ = [
    "ENCRYPTION_KEY",
    "EXTENSION",
    "KEY_TYPE",
    "PREFIX",
    "SealError",
    "Sealed",
    "device_recipient",
    "is_sealed",
    "key_report",
    "open_sealed",
    "parse_sealed",
    "recipient_fingerprint",
    "seal",
    "valid_recipient",
]

PREFIX: Final = "margo-sealed:v1:"
EXTENSION: Final = "x-margo-gitops-extensions"
ENCRYPTION_KEY: Final = "encryptionKey"
KEY_TYPE: Final = "age-x25519"
_RECIPIENT = re.compile(r"age1[02-9ac-hj-np-z]{58}")
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_MAC = re.compile(r"[0-9a-f]{32}")


class SealError(Exception):
    """A sealed value that cannot be read: malformed, sealed to another key, or damaged."""


@dataclass(frozen=True, slots=True)
class Sealed:
    """The parts of one envelope."""

    fingerprint: str
    mac: str
    ciphertext: bytes

    def text(self) -> str:
        body = base64.b64encode(self.ciphertext).decode("ascii").rstrip("=")
        return f"{PREFIX}{self.fingerprint}:{self.mac}:{body}"


def is_sealed(value: Any) -> TypeGuard[str]:
    """Whether a parameter value is an envelope (what a device must open before use)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def valid_recipient(text: Any) -> bool:
    """Whether `text` is an age X25519 recipient (`age1` + 58 bech32 characters)."""
    return isinstance(text, str) and _RECIPIENT.fullmatch(text) is not None


def recipient_fingerprint(recipient: str) -> str:
    return hashlib.sha256(recipient.encode("ascii")).hexdigest()[:16]


def parse_sealed(value: str) -> Sealed:
    """The envelope's parts; `SealError` when it is not one."""
    if not is_sealed(value):
        raise SealError("not a sealed value")
    parts = value[len(PREFIX):].split(":")
    if len(parts) != 3 or not _FINGERPRINT.fullmatch(parts[0]) or not _MAC.fullmatch(parts[1]):
        raise SealError("malformed sealed value (expected margo-sealed:v1:<key>:<mac>:<data>)")
    body = parts[2]
    try:
        ciphertext = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise SealError("malformed sealed value (its data is not base64)") from None
    return Sealed(parts[0], parts[1], ciphertext)


def seal(plaintext: str, recipient: str, *, mac: str) -> str:
    """`plaintext` encrypted to `recipient`, as an envelope carrying `mac`."""
    if not valid_recipient(recipient):
        raise SealError("not an age X25519 recipient")
    try:
        target = pyrage.x25519.Recipient.from_str(recipient)
    except pyrage.RecipientError:
        raise SealError("not an age X25519 recipient") from None
    ciphertext = pyrage.encrypt(plaintext.encode("utf-8"), [target])
    return Sealed(recipient_fingerprint(recipient), mac, ciphertext).text()


def open_sealed(value: str, identity: pyrage.x25519.Identity) -> str:
    """The plaintext of an envelope sealed to `identity`. `SealError` (never quoting the
    value) when it is malformed, sealed to another key, damaged or not UTF-8 text."""
    sealed = parse_sealed(value)
    mine = recipient_fingerprint(str(identity.to_public()))
    if sealed.fingerprint != mine:
        raise SealError(f"sealed to another device key ({sealed.fingerprint}, this device's "
                        f"key is {mine}): the server has not seen this key yet")
    try:
        plaintext = pyrage.decrypt(sealed.ciphertext, [identity])
    except pyrage.DecryptError:
        raise SealError("the sealed value does not decrypt with this device's key "
                        "(damaged or tampered with)") from None
    try:
        return plaintext.decode("utf-8")
    except UnicodeDecodeError:
        raise SealError("the sealed value is not UTF-8 text") from None


def key_report(recipient: str) -> dict[str, Any]:
    """What a device adds to its capability report's extension to receive sealed values."""
    return {ENCRYPTION_KEY: {"type": KEY_TYPE, "recipient": recipient}}


def device_recipient(extensions: Mapping[str, Any]) -> str | None:
    """The recipient a device reported (its capabilities' root extensions), or None when it
    reported none or something that is not an age X25519 recipient."""
    ours = extensions.get(EXTENSION)
    if not isinstance(ours, Mapping):
        return None
    key = ours.get(ENCRYPTION_KEY)
    if not isinstance(key, Mapping) or key.get("type") != KEY_TYPE:
        return None
    recipient = key.get("recipient")
    return recipient if valid_recipient(recipient) else None
