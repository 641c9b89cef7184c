"""The device client's data directory lock: one client per directory, and a way for other
tools to see whether one is running.

`margo device run|once` hold an exclusive `flock` on `<dataDir>/.lock` for their whole run
(two clients on one directory would race on the engine and the journal). `margo device
doctor` asks, without creating anything, whether a client holds it (`probe_data_dir`).
Both sides use this module, so the lock's name and semantics live in one place.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOCK_NAME", "BusyError", "LocalClient", "exclusive", "probe_data_dir"]

LOCK_NAME = ".lock"  # in the data directory, held while a client runs


class BusyError(RuntimeError):
    """Another client process already runs with this data directory."""


@contextmanager
def exclusive(data_dir: Path) -> Iterator[None]:
    """Hold the data directory's lock (created when missing) until the block ends;
    `BusyError` when another process holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"another `margo device` process is using {data_dir}") from None
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LocalClient:
    """What this host says about a device client: running True/False, or None when it
    cannot tell; `detail` says how that was found out."""

    running: bool | None
    detail: str

    @classmethod
    def this_process(cls) -> LocalClient:
        """For the device client's own capability provider: the asker is the client."""
        return cls(True, "this process is the device client")


def probe_data_dir(data_dir: Path) -> LocalClient:
    """Whether a device client holds the lock on `data_dir` (as `margo device run|once` does
    for its whole run). Read-only: the folder and lock file are never created. The probe
    takes a shared lock for an instant when the lock is free, so a client starting in that
    very instant would see itself as busy and exit 2; run it again."""
    lock = data_dir / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return LocalClient(False, f"no device client has run with {data_dir}")
    except OSError as exc:
        return LocalClient(None, f"cannot open {lock}: {exc.strerror}")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return LocalClient(True, f"a device client holds {lock}")
        return LocalClient(None, f"cannot test {lock}: {exc.strerror}")
    finally:
        os.close(fd)  # closing also drops the probe's shared lock
    return LocalClient(False, f"no device client is using {data_dir} now")
