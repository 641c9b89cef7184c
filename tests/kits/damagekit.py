"""Real damage to real files, for the tests of what the server does with damaged state."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def damage_table(path: Path, table: str) -> None:
    """Garbage over the root page of one table of an SQLite file (the other pages intact):
    what a bad sector leaves, found by `PRAGMA quick_check` and by the first read."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                        (table,)).fetchone()[0]
    conn.close()
    with path.open("r+b") as file:
        file.seek(page_size * (root - 1))
        file.write(b"\xff" * 16 + os.urandom(page_size - 16))
