"""One fleet server per data directory: a lock that a crash releases.

Two `margo serve` processes on one `--data` directory would each compile into the same Git
repository and database and cache what they serve, and then answer devices differently
(after a push to one, the other kept serving the old `manifestVersion`). So a server holds
an exclusive `flock` on `<data>/serve.lock` for as long as it runs: the kernel drops it when
the process ends, however it ends, so a crashed server never blocks its successor. The file
says who holds it (pid, host, start time, listening address, and once the server opened its
database whether it is on SQLite or a PostgreSQL replica) for the error the second server
prints. Operator commands (`margo clients ...`) do not take it: they share the database with
a running server by design. Several servers on one store is what `--database
postgresql://...` is for (docs/operations.md); each replica still has its own `--data`
directory (its served repository, compile directory, caches), and this lock keeps a second
replica off it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["DataDirBusy", "DataDirLock"]

LOCK_FILE = "serve.lock"


class DataDirBusy(RuntimeError):
    """Another server holds the data directory; the message names it."""


class DataDirLock:
    """Held from `acquire()` until `release()` (or the end of the process)."""

    def __init__(self, data: Path) -> None:
        self.path = Path(data) / LOCK_FILE
        self._fd: int | None = None
        self._owner: dict[str, Any] = {}

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, listening: str | None = None) -> None:
        """Take the lock or raise `DataDirBusy` naming the server that has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(fd)
            os.close(fd)
            raise DataDirBusy(_busy(self.path.parent, owner)) from None
        self._fd = fd
        self._owner = {
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        self.record(listening=listening)

    def record(self, **details: str | None) -> None:
        """Add to what the lock file says about its holder (the server adds `store`,
        sqlite or postgresql, once it knows its database): a second server's error says
        what holds the directory."""
        if self._fd is None:
            return
        self._owner.update({k: v for k, v in details.items() if v})
        data = (json.dumps(self._owner) + "\n").encode()
        os.pwrite(self._fd, data, 0)  # then cut: a reader never finds the file empty
        os.ftruncate(self._fd, len(data))

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read(fd: int) -> dict[str, Any]:
    try:
        found = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _busy(data: Path, owner: dict[str, Any]) -> str:
    """The second server's error: who holds `data`, and what to do instead. Replicas on
    PostgreSQL share the database, never a data directory."""
    held = f"{data} is in use by another margo serve ({_describe(owner)})"
    if owner.get("store") == "postgresql":
        return (f"{held}: every replica needs its own --data directory (its served "
                "repository, compile directory and caches are its own; replicas share only "
                "the database). Give this one another --data, or stop that one first")
    if owner.get("store") == "sqlite":
        return (f"{held}: two servers on one SQLite data directory would serve different "
                "manifests. Stop it first, or run replicas on one PostgreSQL database "
                "(--database postgresql://..., see docs/operations.md), each with its own "
                "--data directory")
    return (f"{held}: every margo serve needs a --data directory of its own (replicas on "
            "PostgreSQL too: they share the database, never a data directory). Stop it "
            "first, or give this one another --data; see docs/operations.md")


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "it is starting"
    parts = [f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}",
             f"started {owner.get('started', '?')}"]
    if owner.get("listening"):
        parts.append(f"listening on {owner['listening']}")
    store = owner.get("store")
    if store in ("sqlite", "postgresql"):
        parts.append("a PostgreSQL replica" if store == "postgresql"
                     else "on its SQLite database")
    return ", ".join(parts)
