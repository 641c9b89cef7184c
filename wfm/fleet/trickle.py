"""The compile's pack, stored in the database while the compile writes it.

Why: the compiling replica's first manifest waits for the publication, which names a pack
that must be in the database first. Stored after the branches moved, that took 1.3-1.7 s
of the 3.1-3.3 s from the move to the first manifest at 100,000 devices (383 MB), and
about ten times that at a million. The compile's pack writer (`compiler.packwriter`)
appends objects to one temporary file and changes nothing it wrote but the object count
in the header (bytes 8 to 12), set at the end before the checksum is appended. So each
part past the first (`pack_rows.PART_BYTES`) is final once the file has grown past it:
`PackTrickle` follows the file from another thread and stores such parts under a
provisional name as they fill (`pack_rows.store_pack_parts`, on a connection beside the
writer's). Once the branches moved, the staging (`wfm.fleet.staging`) stores what is left
(the first part, the last, the index) and names them all in one transaction
(`pack_rows.stage_pack`'s `trickled`), when the compile's pack is the one published and is
that file (its inode): otherwise the provisional parts are dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path

from compiler.packwriter import TEMP_PREFIX
from wfm.store import pack_rows
from wfm.store.database import Database

__all__ = ["PackTrickle"]

log = logging.getLogger("margo.wfm.replicas")

#: Seconds between looks at the file while the compile writes it.
LOOK_EVERY = 0.25
#: Parts stored per transaction (64 MiB held at most).
PARTS_PER_READ = pack_rows.PARTS_PER_READ


class PackTrickle:
    """Follows the first pack `compiler.packwriter` starts in `pack_dir` after this is
    made, storing its final parts in `db` under a provisional name until `finish`."""

    def __init__(self, db: Database, repo: str, pack_dir: Path, *,
                 every: float | None = None) -> None:
        self.db, self.repo, self.pack_dir = db, repo, pack_dir
        self.every = LOOK_EVERY if every is None else every
        #: Sorts by when it was made (`pack_rows.newest_provisional`).
        self.name = f"{pack_rows.PROVISIONAL}{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"
        self._present = self._temporary_packs()
        self._fd: int | None = None
        self._inode: int | None = None
        self._parts = 0  # parts 1.._parts are stored
        self._failed = False
        self._finished = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="margo-pack-trickle",
                                        daemon=True)
        self._thread.start()

    def finish(self, pack_file: Path | None) -> pack_rows.Trickled | None:
        """Stop following; the parts stored, when `pack_file` (the pack about to be stored,
        None: not the compile's) is the file they came from, else None and they are
        dropped. Once: a later call returns None and drops nothing (the parts handed over
        are the caller's to name; a staging that fails to leaves them to the publication,
        which drops unnamed parts when it discards a staging)."""
        if self._finished:
            return None
        self._finished = True
        self._stop.set()
        self._thread.join()
        try:
            same = (pack_file is not None and self._inode is not None
                    and os.stat(pack_file).st_ino == self._inode)
        except OSError:
            same = False
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if same and self._parts and not self._failed:
            return pack_rows.Trickled(self.name, self._parts)
        self.drop()
        return None

    def drop(self) -> None:
        """Delete whatever was stored under the provisional name."""
        if self._parts:
            self._parts = 0
            try:
                self.db.write_apart(lambda c: pack_rows.drop_parts(c, self.repo, self.name))
            except Exception:  # left for the next compaction (`drop_unnamed_parts`)
                log.exception("dropping a pack's provisional parts failed")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._look()
            except Exception:  # the staging stores the whole pack, as without this
                log.exception("storing a pack's parts while it is written failed")
                self._failed = True
                return

    def _look(self) -> None:
        """Store the parts filled since the last look, `PARTS_PER_READ` at a time."""
        if self._fd is None and not self._open():
            return
        assert self._fd is not None
        fd, size = self._fd, pack_rows.PART_BYTES
        filled = os.fstat(fd).st_size // size  # parts 0..filled-1 are whole
        while filled - 1 > self._parts and not self._stop.is_set():
            numbers = range(self._parts + 1, min(filled, self._parts + 1 + PARTS_PER_READ))
            parts: list[tuple[int, int, pack_rows.PackData]] = [
                (pack_rows.PACK_FILE, n, os.pread(fd, size, n * size)) for n in numbers]
            self._store(parts)
            self._parts = numbers[-1]

    def _store(self, parts: list[tuple[int, int, pack_rows.PackData]]) -> None:
        self.db.write_apart(lambda c: pack_rows.store_pack_parts(c, self.repo, self.name,
                                                                 parts))

    def _open(self) -> bool:
        """Open the compile's pack once it is there: the first temporary pack not present
        when this started."""
        for path in sorted(self._temporary_packs() - self._present):
            try:
                self._fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # (finished meanwhile: too late to follow)
                continue
            self._inode = os.fstat(self._fd).st_ino
            return True
        return False

    def _temporary_packs(self) -> frozenset[Path]:
        try:
            return frozenset(self.pack_dir.glob(f"{TEMP_PREFIX}*.pack"))
        except OSError:
            return frozenset()
