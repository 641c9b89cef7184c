"""Keeping Python's cyclic garbage collector out of the compiler's bulk work.

Why: a compile of a large fleet allocates hundreds of thousands of small containers (every
device's capability document, state records, rendered results) that live until it ends
and form no reference cycles (a compile of 2,000 devices leaves under 100 objects in
cycles). Each collection that the allocations trigger walks the young ones, and each full
collection walks every live container: on 10,000 devices that was more than half of a
no-op recompile (0.45-0.5 s, 0.16 s without). So during a pause the collector is off, and
at its end what it allocated is frozen (`gc.freeze`): never walked again, still freed by
reference counting as soon as it is dropped. Forked worker processes inherit the pause; the
collector not touching every inherited object also keeps their memory shared.

A long-running process (the fleet server) calls `release_frozen()` once a compile's
results are dropped, so the few cycles a compile made are collected normally in the end.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collection_paused", "release_frozen"]


@contextmanager
def collection_paused() -> Iterator[None]:
    """Disable automatic collection for the block and freeze what survives it. Nesting is
    fine (only the outermost pause acts); a collector disabled by the caller stays so."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def release_frozen() -> None:
    """Hand everything frozen by pauses back to the collector (it is then walked and, if
    garbage, collected as usual)."""
    gc.unfreeze()
