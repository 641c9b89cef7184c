"""Replacing a file so that readers, and a crash at any instant, see the old content or
the new one, never half of either.

Every writer of state or configuration (the device's rendered manifests, Compose files and
rc.2 client record, the server's CA certificate, an installed trust bundle) goes through
`write_atomically`: a temporary file in the same folder, created with its final mode (a
secret is never readable by others, not even for an instant), written, flushed and
fsynced, renamed over the target, and the folder fsynced so the rename itself survives a
power loss. A failure removes the temporary file and propagates.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["move_atomically", "write_atomically"]


def write_atomically(path: Path, data: bytes | str, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` (text is written as UTF-8), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_folder(path.parent)


def move_atomically(source: Path, target: Path) -> None:
    """Rename `source` (written and fsynced by the caller, on the same file system) over
    `target`, and fsync the folder so the rename survives a power loss: a file too large
    to write again (a replica's pack read from the database)."""
    os.replace(source, target)
    _sync_folder(Path(target).parent)


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
