"""A compile's publication, run while the compile that made it finishes.

A compile's branches move before its state is committed and its objects are freed (5-6 s
at a million devices), and the devices need not wait for either: the compiling replica
publishes from the moment the branches move (`Coordinator.stage`), in a thread of its own
(`Background`), storing the pack on a database connection beside the writer's
(`wfm.store.pack_rows.stage_pack` through `Database.write_apart`) before the publication's
transaction names it. The compile's end waits for that publication (`Coordinator.publish`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Background"]

T = TypeVar("T")


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
