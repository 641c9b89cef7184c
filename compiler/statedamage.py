"""When the compiler's state file is damaged, and what is done with it then: it is set aside
for a post-mortem and a new one started (`compiler.state` is a cache; the device branches
are the truth, and the next compile, a full one, rebuilds it)."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

__all__ = ["CHECKED", "is_damage", "is_sound", "set_aside"]

log = logging.getLogger("margo.compiler.state")
#: SQLite's result codes for a file that is not (or no longer) a sound database: CORRUPT,
#: NOTADB. Only these make the state be set aside and rebuilt; a locked file is not damage.
_DAMAGED_CODES = frozenset({11, 26})
#: The state files whose pages this process has checked whole (`PRAGMA quick_check`) since
#: it started: once per file, the later opens of a compile only fail on what they read.
CHECKED: set[Path] = set()


def is_damage(exc: BaseException) -> bool:
    """Whether an SQLite error says the state's file is damaged (so it is to be rebuilt),
    rather than busy or misused. A failed integrity check (`CompilerState`) has no code."""
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.ProgrammingError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return not isinstance(exc, sqlite3.OperationalError)
    return code & 0xFF in _DAMAGED_CODES


def is_sound(path: str | Path) -> bool:
    """Whether the state file passes SQLite's integrity check now (`PRAGMA quick_check`):
    after an error that looks like damage, whether it came from this file at all."""
    try:
        db = sqlite3.connect(Path(path), isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        return db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    except sqlite3.DatabaseError:
        return False
    finally:
        db.close()


def set_aside(path: str | Path, exc: BaseException) -> Path:
    """Move a damaged state file (and its `-wal` and `-shm`, which must not be replayed into
    a new file) to `<name>.corrupt-<UTC time>` beside it, for a post-mortem, and say so:
    the next open starts a new state, and the compile after it is a full one (it commits
    nothing that has not changed). Returns where the file went."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    number = 1
    while aside.exists():  # set aside twice in a second: keep both
        number += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{number}")
    for suffix in ("", "-wal", "-shm"):
        source = path.with_name(path.name + suffix)
        if source.exists():
            os.replace(source, aside.with_name(aside.name + suffix))
    CHECKED.discard(path.absolute())
    log.warning("the compiler state %s is damaged (%s): moved it to %s and starting a new "
                "one; this compile is a full one, rebuilt from the fleet source and the "
                "device branches (delete the moved file when it is no longer wanted)",
                path, exc, aside.name)
    return aside
