"""Credentials for private registries: charts, Compose packages and container images.

The device configuration names, per registry host (`host[:port]`), a user name and a file
holding the password (`registries:` in docs/device.md). Secrets are never inline, and a
password file that others can read is refused when the configuration is loaded, like an
SSH private key: a device's credentials must not leak to another account on the machine.

A password is read from its file at each use (rotation needs no restart) and never kept
in a `repr`, a log line, a status report or an error message: errors name the registry and
the file, never the value. Where an engine needs credentials in a file (Helm's registry
client, the Docker CLI's `config.json`), `private_docker_config` writes one with mode
0600 in a fresh 0700 directory and removes it when the block ends.

Credentials the fleet grants to one deployment (`reconciler.registry_grants`) come next to
these, as opened `(user, password)` pairs, for that deployment's pulls only. The device's
own configuration wins for a host it names (`with_granted`): its owner decides which
account the device uses there, and a grant cannot replace it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from margo.identifiers import REGISTRY_HOST

__all__ = ["REGISTRY_HOST", "Pairs", "RegistryCredential", "as_pairs", "docker_config_text",
           "private_docker_config", "secret_file_problem", "with_granted"]

#: `{host: (user, password)}`: credentials in memory, as the OCI client takes them.
Pairs = Mapping[str, tuple[str, str]]

_HOST = re.compile(REGISTRY_HOST)


def secret_file_problem(path: Path) -> str | None:
    """Why `path` cannot hold a secret (missing, not a regular file, readable or writable
    by group or others), or None when it can."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if info.st_mode & 0o077:
        return (f"{path} is accessible to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                "a secret file must be mode 0600 or 0400 (chmod 600 it)")
    return None


@dataclass(frozen=True)
class RegistryCredential:
    """User name and password file for one registry host."""

    registry: str
    username: str
    password_file: Path

    def __post_init__(self) -> None:
        if not _HOST.match(self.registry):
            raise ValueError(f"{self.registry!r} is not a registry host[:port]")

    def password(self) -> str:
        """The password, read now (a trailing newline is not part of it). `OSError` names
        the file, not its content."""
        problem = secret_file_problem(self.password_file)
        if problem is not None:
            raise PermissionError(f"credentials for {self.registry}: {problem}")
        return self.password_file.read_text(encoding="utf-8").rstrip("\r\n")

    def pair(self) -> tuple[str, str]:
        return self.username, self.password()

    def __repr__(self) -> str:  # never the secret
        return f"RegistryCredential(registry={self.registry!r}, username={self.username!r})"


def as_pairs(credentials: Iterable[RegistryCredential]) -> dict[str, tuple[str, str]]:
    """`{host: (user, password)}`, read now, for clients that take them in memory."""
    return {c.registry: c.pair() for c in credentials}


def with_granted(local: Pairs, granted: Pairs | None) -> dict[str, tuple[str, str]]:
    """The credentials a deployment's pulls use: the device's own (`local`) and the ones
    granted to the deployment, the device's own winning for every host it names."""
    return {**(granted or {}), **local}


def docker_config_text(credentials: Iterable[RegistryCredential],
                       granted: Pairs | None = None) -> str:
    """A Docker CLI `config.json` holding these credentials and, for the hosts they do not
    name, the `granted` ones (also what Helm's registry client reads)."""
    auths = {}
    for host, (user, password) in sorted(with_granted(as_pairs(credentials), granted).items()):
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        auths[host] = {"auth": token}
    return json.dumps({"auths": auths}, indent=2, sort_keys=True) + "\n"


@contextlib.contextmanager
def private_docker_config(credentials: Iterable[RegistryCredential], *,
                          granted: Pairs | None = None, parent: Path | None = None,
                          extra: Mapping[str, Path] | None = None,
                          prefix: str = "margo-docker-config-") -> Iterator[Path]:
    """A fresh directory (0700) with `config.json` (0600) for these credentials (and the
    `granted` ones, `docker_config_text`), removed afterwards; `extra` adds symlinks in it
    (`cli-plugins` → the CLI plugins folder)."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        folder.chmod(0o700)
        target = folder / "config.json"
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(docker_config_text(credentials, granted))
        for name, link in (extra or {}).items():
            (folder / name).symlink_to(link)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
