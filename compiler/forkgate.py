"""Keep a compile's forks away from libgit2 calls that let other threads run.

pygit2 holds the interpreter lock through libgit2 calls, except around a few: a revision
walk's steps among them (`Walker.__next__`), which the fleet server takes in worker
threads (`wfm.git.upload_gate` walks a device branch for each Git fetch). A thread inside
such a call may hold one of libgit2's process-wide locks (its pack windows have one for the
whole process); a worker forked at that moment inherits the lock held by a thread it does
not have, and its first read of a pack waits for good: the same hang as SQLite's
(`compiler.workers`), from another library.

So each such step runs under `FORK_GATE` (`gated_steps`), and every `os.fork` of the process
takes it first (an at-fork hook, registered when this module is imported): the compile's
workers, and the worker `multiprocessing`'s pool forks later to replace one that died,
which no caller could wrap. A thread holding the gate must therefore never fork. pygit2's
functions made with cffi let other threads run too: `init_repository` is one, so creating
a repository (`init_bare_repository`) takes the gate as well.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pygit2

__all__ = ["FORK_GATE", "gated_steps", "init_bare_repository"]

T = TypeVar("T")

#: Held by a thread inside a libgit2 call that lets other threads run, and while forking.
FORK_GATE = threading.Lock()


def _release_after_fork() -> None:
    FORK_GATE.release()


#: Every fork of this process waits for the gate and holds it through the fork: a compile's
#: workers, those `multiprocessing`'s pool forks later to replace one that died, any other.
#: The child releases its copy (held for a thread it does not have) and can take it itself.
os.register_at_fork(before=FORK_GATE.acquire, after_in_parent=_release_after_fork,
                    after_in_child=_release_after_fork)


def gated_steps(steps: Iterator[T]) -> Iterator[T]:
    """The items of `steps` (e.g. a pygit2 walker), each taken under `FORK_GATE`."""
    while True:
        with FORK_GATE:
            try:
                item = next(steps)
            except StopIteration:
                return
        yield item


def init_bare_repository(path: Path) -> pygit2.Repository:
    """A new bare repository at `path` (`pygit2.init_repository` runs without the
    interpreter lock: cffi), made under `FORK_GATE`."""
    with FORK_GATE:
        return pygit2.init_repository(str(path), bare=True)
