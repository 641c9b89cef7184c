"""Give the C heap's freed memory back to the operating system after a busy moment.

glibc's malloc keeps what was freed at the top of its main heap (`[heap]` in
/proc/<pid>/smaps) for the next allocation instead of returning it, so one busy moment
stays resident for the rest of a long-lived process, and counts again in the next one's
peak. `malloc_trim(0)` hands that back. Two such processes call it:
* the device client after each cycle (any cycle may parse a large manifest or build a
  large plan): about 5 MiB of a device's steady resident memory (`bench/device_memory.py`);
* whatever compiles, once a compile is over (`compiler.gcpause.release_frozen`: the fleet
  server, `margo compile --watch`, the benchmark): about 105 MiB after a full compile of
  100,000 devices (`bench/compile.py`; docs/benchmarks.md).

Where the C library has no `malloc_trim` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache

__all__ = ["release_freed_memory", "resident_and_available"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        found: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None
    return found


def release_freed_memory() -> bool:
    """Return the heap's free memory to the system; True when any was returned."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def resident_and_available() -> tuple[int, int] | None:
    """This process's resident memory and what the system could still give without
    swapping (Linux's ``MemAvailable``), in bytes; None where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return resident, int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
