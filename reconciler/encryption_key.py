"""The device's own encryption key: the age X25519 identity that opens the parameter values
the fleet server sealed to this device (`margo.sealing`, docs/device.md "Sealed values").

Where it lives (both files mode 0600; the `keys` folder 0700):

    <dataDir>/keys/encryption.age            the current identity (`identity.encryptionKey`
                                             in the configuration puts it elsewhere)
    <dataDir>/keys/encryption.age.previous   the identity before the last rotation

Each file is an age identity file as `age-keygen` writes it: comment lines (`# public key:
age1...`) and the `AGE-SECRET-KEY-1...` line. The client creates the current one on its first
start (`DeviceKey.open`), written atomically with its final mode, and reports its recipient
in every capability report (`x-margo-gitops-extensions.encryptionKey`).

Rotation (`rotate_key`, `margo device rotate-key`): the current identity becomes the previous
one and a new one is written. Values still sealed to the previous key keep opening (the
envelope names the key it was sealed to: `DeviceKey.open_sealed` picks the identity by that
fingerprint) until the server, having received the new key in the next capability report,
seals them again. A second rotation drops the first key: rotate again only after the server
re-sealed. A running client re-reads both files when they change, so a rotation beside it
takes effect at its next cycle without a restart.

A key file that is missing (after the first start), not a regular file, readable by others
or not an age X25519 identity is an `EncryptionKeyError` naming the file, never quoting it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pyrage

from margo.files import write_atomically
from margo.sealing import open_sealed, parse_sealed, recipient_fingerprint
from reconciler.registry_credentials import secret_file_problem

__all__ = ["KEY_FILE", "PREVIOUS_SUFFIX", "DeviceKey", "EncryptionKeyError",
           "default_key_path", "previous_path", "rotate_key"]

#: The key's place in the data directory when the configuration names none.
KEY_FILE = Path("keys") / "encryption.age"
#: Appended to the key file's name for the identity before the last rotation.
PREVIOUS_SUFFIX = ".previous"

_Stamp = tuple[int, int, int] | None


class EncryptionKeyError(ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


def default_key_path(data_dir: Path) -> Path:
    return Path(data_dir) / KEY_FILE


def previous_path(path: Path) -> Path:
    """Where the identity before the last rotation of the key at `path` is kept."""
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def _stamp(path: Path) -> _Stamp:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EncryptionKeyError(f"{path}: cannot read the encryption key: "
                                 f"{exc.strerror or exc}") from None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _read_identity(path: Path) -> pyrage.x25519.Identity:
    problem = secret_file_problem(path)
    if problem is not None:
        raise EncryptionKeyError(f"the device's encryption key: {problem}")
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not ASCII text"
        raise EncryptionKeyError(f"{path}: cannot read the encryption key: {reason}") from None
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    if len(lines) == 1 and lines[0].startswith("AGE-SECRET-KEY-1"):
        try:
            return pyrage.x25519.Identity.from_str(lines[0])
        except pyrage.IdentityError:
            pass
    raise EncryptionKeyError(f"{path} is damaged: it must hold one age X25519 identity "
                             "(an AGE-SECRET-KEY-1... line). Restore it from a backup, or "
                             "move it away and restart the client to make a new key (values "
                             "sealed to the old one then fail until the server re-seals them)")


def _write_identity(path: Path, identity: pyrage.x25519.Identity) -> None:
    """Write `identity` as an age identity file, mode 0600, in a folder made 0700."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    text = f"# public key: {identity.to_public()}\n{identity}\n"
    write_atomically(path, text, mode=0o600)


class DeviceKey:
    """The device's current identity and, after a rotation, the previous one; both files
    are read again whenever they change (a rotation beside a running client)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.previous_path = previous_path(self.path)
        self._lock = threading.Lock()
        self._stamps: tuple[_Stamp, _Stamp] | None = None
        self._identities: tuple[pyrage.x25519.Identity, ...] = ()

    @classmethod
    def open(cls, path: Path, *, create: bool = True) -> DeviceKey:
        """The key at `path`, generated there first when it does not exist and `create`
        (the client's first start). `EncryptionKeyError` when it cannot be used."""
        key = cls(path)
        if create and _stamp(key.path) is None:
            _write_identity(key.path, pyrage.x25519.Identity.generate())
        key.recipient()  # read now: a damaged file stops the start, naming itself
        return key

    @classmethod
    def existing(cls, path: Path) -> DeviceKey | None:
        """The key at `path` if there is one (tools that must not create it)."""
        return cls.open(path, create=False) if _stamp(Path(path)) is not None else None

    def _current(self) -> tuple[pyrage.x25519.Identity, ...]:
        """(current, [previous]) as the files hold them now."""
        with self._lock:
            stamps = (_stamp(self.path), _stamp(self.previous_path))
            if stamps != self._stamps or not self._identities:
                if stamps[0] is None:
                    raise EncryptionKeyError(f"{self.path}: the device's encryption key is "
                                             "missing")
                identities = [_read_identity(self.path)]
                if stamps[1] is not None:
                    identities.append(_read_identity(self.previous_path))
                self._identities, self._stamps = tuple(identities), stamps
            return self._identities

    def recipient(self) -> str:
        """The `age1...` recipient the server seals to (the current identity's)."""
        return str(self._current()[0].to_public())

    def previous_recipient(self) -> str | None:
        identities = self._current()
        return str(identities[1].to_public()) if len(identities) > 1 else None

    def open_sealed(self, value: str) -> str:
        """The plaintext of an envelope, opened with the identity it was sealed to (the
        current or the previous one). `margo.sealing.SealError` when it cannot be."""
        identities = self._current()
        sealed = parse_sealed(value)
        identity = next((i for i in identities
                         if recipient_fingerprint(str(i.to_public())) == sealed.fingerprint),
                        identities[0])
        return open_sealed(value, identity)


def rotate_key(path: Path) -> tuple[str | None, str]:
    """Make a new identity at `path`, keeping the current one as the previous (dropping any
    older). Returns (the old recipient or None when there was no key, the new recipient)."""
    path = Path(path)
    old: str | None = None
    if _stamp(path) is not None:
        current = _read_identity(path)
        old = str(current.to_public())
        _write_identity(previous_path(path), current)
    fresh = pyrage.x25519.Identity.generate()
    _write_identity(path, fresh)
    return old, str(fresh.to_public())
