"""What a process remembers between compiles of one fleet, each fact under the version of
the file it was read from (`Remembered`).

Why: the fleet server and ``margo compile --watch`` compile again and again in one process,
and a recompile that changes nothing must not read 100,000 rows or refs again. Each fact is
served only while the file still carries the version it was remembered under (a random id
every writer renews, a file's identity on disk), so any change by anyone is read again.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["Remembered"]

T = TypeVar("T")


class Remembered(Generic[T]):
    """One fact of one file at a time (a process compiles one fleet): the value, the
    absolute path of the file and the version of it the value is true of."""

    def __init__(self) -> None:
        self._slot: tuple[Path, Hashable, T] | None = None

    def get(self, path: Path, version: Hashable) -> T | None:
        """The value remembered for this file at this version, if any (None is never a
        version: a file without one has nothing remembered)."""
        if self._slot is None or version is None:
            return None
        where, remembered, value = self._slot
        if remembered == version and where == path.absolute():
            return value
        return None

    def put(self, path: Path, version: Hashable, value: T) -> None:
        """Remember `value` as true of the file at `version` (None: forget)."""
        self._slot = None if version is None else (path.absolute(), version, value)

    def forget(self) -> None:
        self._slot = None
