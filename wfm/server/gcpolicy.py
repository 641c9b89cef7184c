"""How the fleet server runs Python's cyclic garbage collector: rarely, and never over
what it built before serving.

Why: a server with thousands of devices each on a connection of its own holds hundreds of
thousands of long-lived containers (connections, cached manifests and credentials, the
last compile's results), and every full collection walks all of them while every request
in flight waits. MEASURED (`bench/serve.py --devices 5000`, 2,000 durable status reports/s,
one connection per device, 2 cores): with the default thresholds (700, 10, 10) full
collections took 40-80 ms each, several per second, and status reports had p99 70-120 ms;
with start-up frozen and thresholds (50,000, 20, 10), p99 5.6 ms (12 ms with 10,000 for
the youngest generation). Reference counting still frees everything at once that is not
in a cycle (nearly everything a request makes); only cycles wait longer, bounded by the
thresholds. What a compile leaves is frozen again after each compile
(`wfm.fleet.compiles`, `compiler.gcpause.freeze_survivors`).
"""

from __future__ import annotations

import gc

from compiler.gcpause import freeze_survivors

__all__ = ["SERVING_THRESHOLDS", "tune_for_serving"]

#: `gc.set_threshold` while serving: young collections every 50,000 net new containers,
#: the middle one every 20 of those, a full one every 10 middle ones at most (and only
#: when a quarter of the unfrozen long-lived objects are new, CPython's own rule).
SERVING_THRESHOLDS = (50_000, 20, 10)


def tune_for_serving() -> None:
    """Once the server has started, before it takes requests."""
    gc.set_threshold(*SERVING_THRESHOLDS)
    freeze_survivors()
