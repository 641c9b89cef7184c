"""Secrets in the fleet source: parameter values encrypted to the fleet key (docs/secrets.md).

An intent gives a secret parameter as `{secret: <age file, ASCII-armored>}`: the output of
`age -a -r <fleet recipient>` or `margo secrets encrypt`, so platform engineers write and
review them with tools they already have. Only the fleet manager's key (an age identity
file kept outside every repository, `FleetKey.load`) opens them, and only while compiling:
`compiler.render` then seals each value to its target device (`margo.sealing`).

`secret_problem` checks an armored value's shape without any key (what `margo validate` and
the pre-receive check can do on a machine that must never hold the fleet key): the armor,
the age header and at least one X25519 recipient stanza. Messages never quote a value.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, TypeGuard

import pyrage

from margo.files import write_atomically

__all__ = ["ARMOR_BEGIN", "ARMOR_END", "SECRET", "FleetKey", "SecretError", "encrypt_secret",
           "is_secret", "new_identity_text", "secret_problem",
           "write_identity_file"]

SECRET: Final = "secret"
ARMOR_BEGIN: Final = "-----BEGIN AGE ENCRYPTED FILE-----"
ARMOR_END: Final = "-----END AGE ENCRYPTED FILE-----"
_AGE_HEADER = b"age-encryption.org/v1\n"
_X25519_STANZA = b"\n-> X25519 "
_MAC_CONTEXT = b"margo-gitops sealed-value mac v1\x00"


class SecretError(Exception):
    """A secret that cannot be used: no fleet key, not for this key, damaged. Never quotes
    the value."""


def is_secret(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether an intent's parameter value is a secret reference (`{secret: ...}`): a
    mapping is never a parameter value otherwise (values are scalars or lists)."""
    return isinstance(value, Mapping) and set(value) == {SECRET}


def secret_problem(value: Any) -> str | None:
    """What is wrong with a secret reference's shape (None: an armored age file with an
    X25519 recipient), found without decrypting."""
    text = value.get(SECRET) if isinstance(value, Mapping) else None
    if not isinstance(text, str):
        return "a secret is the text of an ASCII-armored age file (margo secrets encrypt)"
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) < 3 or lines[0] != ARMOR_BEGIN or lines[-1] != ARMOR_END:
        return (f"a secret is an ASCII-armored age file: {ARMOR_BEGIN} ... {ARMOR_END} "
                "(age -a, or margo secrets encrypt)")
    try:
        data = base64.b64decode("".join(lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        return "the armored age file's body is not base64"
    if not data.startswith(_AGE_HEADER):
        return "not an age file (its header is not age-encryption.org/v1)"
    if _X25519_STANZA not in data.split(b"\n---", 1)[0]:
        return "the age file has no X25519 recipient (encrypt it to the fleet key's recipient)"
    return None


def new_identity_text() -> str:
    """A new age X25519 identity as an identity file's text (age-keygen's layout)."""
    identity = pyrage.x25519.Identity.generate()
    return f"# public key: {identity.to_public()}\n{identity}\n"


def encrypt_secret(plaintext: str, recipients: list[str]) -> str:
    """`plaintext` as an armored age file for the given `age1...` recipients."""
    try:
        targets = [pyrage.x25519.Recipient.from_str(r) for r in recipients]
    except pyrage.RecipientError:
        raise SecretError("not an age X25519 recipient (age1...)") from None
    armored: bytes = pyrage.encrypt(plaintext.encode("utf-8"), targets, armored=True)
    return armored.decode("ascii")


class FleetKey:
    """The fleet manager's age identities: the first is current (secrets are encrypted to
    its recipient, and sealed values carry macs under a key derived from it); any further
    ones are earlier keys kept while a rotation is under way, still able to decrypt."""

    def __init__(self, identities: list[pyrage.x25519.Identity], source: str = "") -> None:
        if not identities:
            raise SecretError(f"{source or 'the fleet key'} holds no age identity")
        self.identities = identities
        self.source = source
        self._mac_key = hashlib.sha256(_MAC_CONTEXT + str(identities[0]).encode()).digest()
        self._opened: dict[str, str] = {}

    @classmethod
    def load(cls, path: Path) -> FleetKey:
        """The identities of an age identity file (`AGE-SECRET-KEY-1...` lines, `#` comments).
        Refuses a file other users can read: it opens every secret of the fleet."""
        mode = path.stat().st_mode
        if mode & 0o077:
            raise SecretError(f"{path}: the fleet key must be readable by its owner only "
                              f"(chmod 600), found mode {oct(mode & 0o777)}")
        return cls.from_text(path.read_text("utf-8"), str(path))

    @classmethod
    def from_text(cls, text: str, source: str = "") -> FleetKey:
        """The identities of an identity file's text (`source` names it in errors)."""
        identities = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                identities.append(pyrage.x25519.Identity.from_str(line))
            except pyrage.IdentityError:
                raise SecretError(f"{source or 'the key'}:{number}: not an age identity "
                                  "(AGE-SECRET-KEY-1...)") from None
        return cls(identities, source)

    @property
    def recipient(self) -> str:
        """The current recipient: what new secrets are encrypted to."""
        return str(self.identities[0].to_public())

    def decrypt(self, armored: str) -> str:
        """A secret's plaintext (memoised for this key's lifetime: one compile)."""
        found = self._opened.get(armored)
        if found is not None:
            return found
        try:
            plaintext = pyrage.decrypt(armored.encode("ascii"), self.identities)
        except (pyrage.DecryptError, UnicodeEncodeError):
            raise SecretError("the secret does not decrypt with the fleet key (encrypted to "
                              "another recipient, or damaged)") from None
        try:
            text = plaintext.decode("utf-8")
        except UnicodeDecodeError:
            raise SecretError("the secret is not UTF-8 text") from None
        self._opened[armored] = text
        return text

    def mac(self, device_id: str, parameter: str, plaintext: str) -> str:
        """A keyed digest of one device's value (`margo.sealing`): equal macs mean the same
        plaintext, and nothing about the plaintext without the fleet key."""
        message = "\x00".join((device_id, parameter, plaintext)).encode("utf-8")
        return hmac.new(self._mac_key, message, hashlib.sha256).hexdigest()[:32]


def write_identity_file(path: Path, text: str) -> None:
    """An identity file, readable by its owner only, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text, mode=0o600)
    os.chmod(path, 0o600)
