"""Keep a compile's forks away from libgit2 calls that let other threads run.

pygit2 holds the interpreter lock through libgit2 calls, except around a few: a revision
walk's steps among them (`Walker.__next__`), which the fleet server takes in worker
threads (`wfm.git.upload_gate` walks a device branch for each Git fetch). A thread inside
such a call may hold one of libgit2's process-wide locks (its pack windows have one for the
whole process); a worker forked at that moment inherits the lock held by a thread it does
not have, and its first read of a pack waits for good: the same hang as SQLite's
(`compiler.workers`), from another library.

So each such step runs under `FORK_GATE` (`gated_steps`), and a compile forks its workers
only while holding it (`compiler.parallel`). Forks whose children never call
libgit2 (the snapshot's validator, targeting's half) need not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["FORK_GATE", "gated_steps"]

T = TypeVar("T")

#: Held by a thread inside a libgit2 call that lets other threads run, and while forking.
FORK_GATE = threading.Lock()


def gated_steps(steps: Iterator[T]) -> Iterator[T]:
    """The items of `steps` (e.g. a pygit2 walker), each taken under `FORK_GATE`."""
    while True:
        with FORK_GATE:
            try:
                item = next(steps)
            except StopIteration:
                return
        yield item
