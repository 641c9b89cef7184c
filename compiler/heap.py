"""Give the C heap's free memory back to the system once a compile has ended.

glibc's malloc keeps what a process freed for its next allocations instead of returning
it, so the memory a large compile grew (every device's model, result and record, until
its branches moved) stayed resident for the rest of a long-running process (the fleet
server, ``margo compile --watch``) and counted again in every later compile's peak.
MEASURED (`bench/compile.py --devices 100000`, the process after a full compile):
`malloc_trim(0)` gave back about 105 MiB of it. What is left is Python's own arenas,
which it frees as they empty.

Where the C library has no `malloc_trim` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

__all__ = ["release_freed_memory"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        found: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None
    return found


def release_freed_memory() -> bool:
    """Return the C heap's free memory to the system; True when any was returned."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
