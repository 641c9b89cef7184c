"""What a process remembers between compiles of one fleet, each fact under the version of
the file it was read from (`Remembered`).

Why: the fleet server and ``margo compile --watch`` compile again and again in one process,
and a recompile that changes nothing must not read 100,000 rows or refs again. Each fact is
served only while the file still carries the version it was remembered under (a random id
every writer renews, a file's identity on disk), so any change by anyone is read again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Remembered"]

T = TypeVar("T")


class _DeviceRecord(Protocol):
    """What `DeviceRecords` reads of a record (`compiler.state.DeviceRecord`, which imports
    this module)."""

    @property
    def device_id(self) -> str: ...
    @property
    def caps_digest(self) -> str: ...
    @property
    def compiled_at(self) -> float: ...
    @property
    def tree(self) -> str: ...
    @property
    def deployments(self) -> int: ...


_R = TypeVar("_R", bound=_DeviceRecord)


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


@dataclass(frozen=True)
class DeviceRecords(Generic[_R]):
    """The device records of one state file (`compiler.state`), and each device's
    capability digest (what `CompilerState.trusted_digests` gives): what a process keeps of
    them between compiles, under the id the records were read or written with."""

    records: dict[str, _R]
    digests: dict[str, str]
    deployments: int  # of every record, summed

    @classmethod
    def of_rows(cls, rows: list[Any], make: Callable[[Any], _R]) -> DeviceRecords[_R]:
        """From rows of the `devices` table's five columns, each made a record by `make`,
        with C calls only (`compiler.state` gives a `_make` without its Python frame and
        length check): half the cost for 100,000 rows."""
        ids = list(map(itemgetter(0), rows))
        return cls(dict(zip(ids, map(make, rows), strict=True)),
                   dict(zip(ids, map(itemgetter(1), rows), strict=True)),
                   sum(map(itemgetter(4), rows)))

    def changed(self, written: list[_R], deleted: list[str],
                make: Callable[[str, str, float, str, int], _R]) -> DeviceRecords[_R]:
        """These records with `written` stored (as SQLite gives them back: a REAL time, an
        INTEGER count; `make` builds a record) and then `deleted` removed; this one is left
        as it is."""
        records, digests, total = dict(self.records), dict(self.digests), self.deployments
        for record in written:
            replaced = records.get(record.device_id)
            total -= 0 if replaced is None else replaced.deployments
            records[record.device_id] = stored = make(
                record.device_id, record.caps_digest, float(record.compiled_at),
                record.tree, int(record.deployments))
            digests[record.device_id] = record.caps_digest
            total += stored.deployments
        for device_id in deleted:
            removed = records.pop(device_id, None)
            digests.pop(device_id, None)
            total -= 0 if removed is None else removed.deployments
        return DeviceRecords(records, digests, total)
