"""A publication's pack, worked out and stored while the compile that made it finishes.

A compile's branches move before its state is committed (0.6 s at 100,000 devices), and the
pack its publication names takes longer than that to store (1.3-1.7 s for 383 MB through
PostgreSQL). So the compiling replica starts on the pack as soon as the branches move, in
a thread of its own and on a database connection beside the writer's
(`wfm.store.pack_rows.stage_pack` through `Database.write_apart`); the publication then
takes it when it was made from the same moves (`StagedPack.take`), else packs again.

The publication itself starts then too (`Background`): at a million devices the state's
commit and the freeing of the compile's objects take 5-6 s, which the devices need not wait
for (the served copy moves with the publication).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from wfm.store.pack_rows import PackData

__all__ = ["Background", "Staged", "StagedPack"]

log = logging.getLogger("margo.wfm.replicas")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Staged:
    """A pack stored ahead of its publication, and what it was worked out from."""

    moved: Mapping[str, str | None]  # the refs that moved, as the pack was made for them
    restored: int | None  # the lost branches the compile said it restored
    pack: PackData
    index: PackData | None


class StagedPack:
    """`work` run in a thread of its own; its `Staged` result taken once."""

    def __init__(self, work: Callable[[], Staged | None]) -> None:
        self._result: Staged | None = None
        self._thread = threading.Thread(target=self._run, args=(work,),
                                        name="margo-pack-staging", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Staged | None]) -> None:
        try:
            self._result = work()
        except Exception:  # the publication packs and stores it itself
            log.exception("storing the compile's pack ahead of its publication failed")

    def take(self, moved: Mapping[str, str | None], restored: int | None) -> Staged | None:
        """The staged pack, once stored, if it was made for exactly these moves and this
        account of restored branches; None otherwise (or when staging failed)."""
        self._thread.join()
        staged = self._result
        if staged is None or staged.restored != restored or staged.moved != moved:
            return None
        return staged


class Background(Generic[T]):
    """`work` run in a thread of its own; `result` waits for it and returns what it
    returned, or raises what it raised (its caller decides, as if it had run the work)."""

    def __init__(self, work: Callable[[], T], *, name: str) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._value = work()
        except BaseException as exc:  # (re-raised in `result`, on the caller's thread)
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
