"""Git lock files whose owner is gone: recognised and removed, never one a live writer holds.
The same for the unfinished packs of our own pack writer (`compiler.packwriter`).

Git takes a lock on a file by creating `<file>.lock` exclusively, writes the new content
into it and renames it over the file. A process killed in between (SIGKILL, a power cut)
leaves the `.lock` behind, and every later writer then fails: a `packed-refs.lock` left by a
killed compile stopped every compile on that server for good (issue 29). Git itself never
removes a lock it did not take; its advice is "remove the file manually".

A lock is stale when nobody can still be writing it:
- no process on this machine has it open (every writer holds the file open from creating
  it until just before the rename; read from `/proc/<pid>/fd`), and
- it is older than `GRACE` seconds (covering the moment between a writer closing the file
  and renaming it, and Git's own one-second wait for a held `packed-refs.lock`).
Where `/proc` cannot be read, only a lock older than `BLIND_GRACE` counts as stale.

The callers hold their own lock while they recover (the compile `flock` of
`compiler.gitstore.DeviceStore`, a replica's repository lock), so no writer of ours starts
meanwhile; a stock `git` the operator runs by hand is the writer the checks above protect.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from compiler.packwriter import TEMP_PREFIX

__all__ = ["BLIND_GRACE", "GRACE", "is_stale", "lock_files", "recover_stale_locks"]

#: Seconds a lock nobody holds open must have existed before it is taken as stale.
GRACE = 5.0
#: The same where open files cannot be listed (no `/proc`): far longer than any Git write.
BLIND_GRACE = 600.0
_SUFFIX = ".lock"
#: Lock files of our own that are `flock`ed, not created exclusively: never stale by
#: existing (the kernel releases them with their process).
_FLOCKED = frozenset({"margo-compile.lock"})
log = logging.getLogger("margo.compiler.stalelocks")


def lock_files(git_dir: Path) -> Iterator[Path]:
    """Git's `.lock` files of a repository: beside its top-level files (`packed-refs`,
    `HEAD`, `config`, `shallow`, ...) and among its loose refs; and the files of a pack
    our writer has not finished (`objects/pack/tmp_pack_margo_*`: its writer holds the
    pack open until it publishes it)."""
    try:
        top = list(os.scandir(git_dir))
    except FileNotFoundError:
        return
    for entry in top:
        if entry.name.endswith(_SUFFIX) and entry.name not in _FLOCKED and entry.is_file():
            yield Path(entry.path)
    for directory, _, files in os.walk(git_dir / "refs"):
        for name in files:
            if name.endswith(_SUFFIX):
                yield Path(directory) / name
    yield from (git_dir / "objects" / "pack").glob(f"{TEMP_PREFIX}*")


def _open_files() -> set[str] | None:
    """Every file some process on this machine has open (resolved paths), or None when
    `/proc` cannot tell."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    found: set[str] = set()
    readable = False
    for pid in pids:
        directory = f"/proc/{pid}/fd"
        try:
            descriptors = os.listdir(directory)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        readable = True
        for fd in descriptors:
            try:
                found.add(os.readlink(f"{directory}/{fd}"))
            except OSError:
                continue
    return found if readable else None


def is_stale(lock: Path, *, now: float | None = None, open_files: set[str] | None = None,
             grace: float = GRACE) -> bool:
    """Whether `lock` is left by a writer that is gone (see the module docstring)."""
    now = time.time() if now is None else now
    try:
        age = now - lock.stat().st_mtime
    except FileNotFoundError:
        return False  # its writer finished meanwhile
    if open_files is None:
        return age > BLIND_GRACE
    return age > grace and str(lock.resolve()) not in open_files


def recover_stale_locks(git_dir: str | os.PathLike[str], *, grace: float = GRACE,
                        candidates: Iterable[Path] | None = None) -> list[Path]:
    """Remove the stale lock files of a repository (`lock_files`, or `candidates`); the
    ones removed, each logged as a warning. Costs one directory listing when there is none
    (the usual case): open files are only listed when a lock file exists."""
    found = list(lock_files(Path(git_dir)) if candidates is None else candidates)
    if not found:
        return []
    open_files = _open_files()
    removed = []
    now = time.time()
    for lock in found:
        if not is_stale(lock, now=now, open_files=open_files, grace=grace):
            continue
        try:
            age = now - lock.stat().st_mtime
            lock.unlink()
        except FileNotFoundError:
            continue
        log.warning("removed %s: a stale lock (%.0f s old, held open by no process) left by "
                    "a writer that was killed or crashed", lock, age)
        removed.append(lock)
    return removed
