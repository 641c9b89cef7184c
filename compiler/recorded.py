"""What the compiler's state says a device's branch holds, read-only, for the server's
readers: asked only when a branch is missing, to tell lost state from no state yet."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from compiler.state import FORGOTTEN_KEY, STATE_FILE_NAME

__all__ = ["recorded_branch"]


def recorded_branch(repos_dir: str | Path, device_id: str) -> str | None:
    """What the compiler's state (``<repos_dir>/compiler-state.sqlite``) says the device's
    branch holds: the commit it left the branch at, ``"unknown commit"`` when only a
    compiled tree with deployments is recorded, or None when it records no branch (no such
    file, a device not compiled yet).

    Why: a device without a branch normally has no desired state yet, but one the compiler
    did give a branch has LOST its state (e.g. ``packed-refs`` deleted); serving that as
    "no deployments" would make the device uninstall everything. Read-only, for the server's
    readers, asked only when a branch is missing: a state that cannot be read says nothing.
    """
    path = Path(repos_dir) / STATE_FILE_NAME
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return None
    try:
        marked = db.execute("SELECT value FROM meta WHERE key=?", (FORGOTTEN_KEY,)).fetchone()
        if marked is not None and device_id in json.loads(marked[0]):
            return None  # deleted on purpose: whatever is recorded is not its state
        row = db.execute("SELECT tip FROM device_trees WHERE device_id=?",
                         (device_id,)).fetchone()
        if row is not None:
            return str(row[0])
        row = db.execute("SELECT deployments FROM devices WHERE device_id=?",
                         (device_id,)).fetchone()
        return "unknown commit" if row is not None and row[0] else None
    except sqlite3.Error:
        return None
    finally:
        db.close()
