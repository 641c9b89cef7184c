"""A replica's copy of the pack the compiling replica is storing, read while it is stored.

Why: at 100,000 devices the other replica's first manifest came 1.6-2 s after the compiling
one's, most of it reading the published pack back (383 MB: 0.7-0.85 s) and writing it to
disk. The compiling replica stores its pack's parts while it compiles (`wfm.fleet.trickle`,
under a provisional name). A replica that does not hold the compile lease reads those
parts as they are stored, at most once a second from its coordination loop, into a file
beside the repository it serves, each at its offset. The publication's pack records the
provisional name and parts it was named from, so the sync that reads it takes this file
and reads only the other parts (`wfm.store.pack_rows.read_packs`' `prefetched`). Nothing
depends on it: a file that does not match is not used, and a sync without one reads the
whole pack as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from wfm.store import pack_rows
from wfm.store.database import Database

__all__ = ["Prefetch"]

#: The least seconds between two looks for provisional parts.
LOOK_EVERY = 1.0
_PREFIX = "margo-prefetch-"


class Prefetch:
    """The provisional pack of `repo` read into `folder` (a file per provisional name)."""

    def __init__(self, db: Database, repo: str, folder: Path) -> None:
        self.db, self.repo, self.folder = db, repo, folder
        self._lock = threading.Lock()
        self._name: str | None = None
        self._parts = 0
        self._looked = float("-inf")
        for stale in folder.glob(f"{_PREFIX}*"):  # (left by a process that ended)
            stale.unlink(missing_ok=True)

    def look(self) -> None:
        """Read the parts of the newest provisional pack stored since the last look."""
        if time.monotonic() - self._looked < LOOK_EVERY:
            return
        self._looked = time.monotonic()
        newest = self.db.read(lambda c: pack_rows.newest_provisional(c, self.repo))
        with self._lock:
            if newest is None:
                return  # (the file waits for the sync that takes it)
            name, last = newest
            if name != self._name:
                self._forget()
                self._name = name
            while self._parts < last:
                if not self._read(name, self._parts + 1,
                                  min(last, self._parts + pack_rows.PARTS_PER_READ)):
                    self._forget()
                    return

    def clear(self) -> None:
        """Forget what was read (this replica compiles now: no pack of its own is read)."""
        if self._name is not None:
            with self._lock:
                self._forget()

    def held(self) -> pack_rows.Prefetched | None:
        """What is read so far, for a sync (under `claim`)."""
        if self._name is None or not self._parts:
            return None
        return pack_rows.Prefetched(self._name, self._path(self._name), self._parts)

    @contextlib.contextmanager
    def claim(self) -> Iterator[pack_rows.Prefetched | None]:
        """`held` for the length of a sync, which may move the file away; forgotten then."""
        with self._lock:
            held = self.held()
            try:
                yield held
            finally:
                if held is not None and not held.path.exists():
                    self._name, self._parts = None, 0

    def _read(self, name: str, first: int, last: int) -> bool:
        """Parts `first` to `last` into the file; False when they are not all there whole
        (dropped meanwhile, or of another part size)."""
        parts = self.db.read(lambda c: pack_rows.read_provisional(c, self.repo, name, first,
                                                                  last))
        size = pack_rows.PART_BYTES
        if [n for n, _ in parts] != list(range(first, last + 1)) or any(
                len(d) != size for _, d in parts):
            return False
        path = self._path(name)
        with path.open("r+b" if path.exists() else "wb") as out:
            for number, data in parts:
                out.seek(number * size)
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
        self._parts = last
        return True

    def _forget(self) -> None:
        if self._name is not None:
            self._path(self._name).unlink(missing_ok=True)
        self._name, self._parts = None, 0

    def _path(self, name: str) -> Path:
        return self.folder / f"{_PREFIX}{name}.pack"
