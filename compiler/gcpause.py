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
results are dropped, so the few cycles a compile made are collected (and the C heap's free
memory is returned, `margo.heap`), then
`freeze_survivors()`, so what is left (its caches, the server's own start-up) is not walked
by every full collection that request traffic triggers.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from margo.heap import release_freed_memory

__all__ = ["collection_paused", "freeze_survivors", "release_frozen"]


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
    garbage, collected as usual), and the C heap's free memory back to the system
    (`margo.heap`): what callers do once a compile is over."""
    gc.unfreeze()
    release_freed_memory()


def freeze_survivors() -> None:
    """Collect what is garbage now, then freeze everything that survives. For a
    long-running process at a quiet point (a server once started, after each compile):
    what it has built so far (modules, schemas, caches, the last compile's results) is
    never walked again by the collections its requests trigger. MEASURED (`bench/serve.py
    --devices 5000`, one connection per device): the server's full collections walked
    ~240,000 long-lived containers, 40-80 ms each, several per second under load, and each
    one stalled every request in flight."""
    gc.collect()
    gc.freeze()
