"""The server's collector policy (`wfm.server.gcpolicy`), checked in a process of its own (it
changes process-wide state). What it buys is measured by `bench/serve.py`, not here."""

from __future__ import annotations

import json
import subprocess
import sys

from kits.serverkit import ROOT

from wfm.server.gcpolicy import SERVING_THRESHOLDS

_PROBE = """
import gc, json
from compiler.gcpause import collection_paused, release_frozen, freeze_survivors
from wfm.server.gcpolicy import tune_for_serving
built = [{"device": i} for i in range(1000)]  # what start-up built
tune_for_serving()
after_start = gc.get_freeze_count()
young = [{"request": i} for i in range(10)]
with collection_paused():  # a compile
    results = [[i] for i in range(5000)]
release_frozen()
del results
freeze_survivors()
print(json.dumps({"thresholds": gc.get_threshold(), "frozen_at_start": after_start,
                  "frozen_after_compile": gc.get_freeze_count(), "enabled": gc.isenabled()}))
"""


def test_serving_freezes_what_start_up_and_each_compile_leave() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)
    seen = json.loads(done.stdout)
    assert tuple(seen["thresholds"]) == SERVING_THRESHOLDS
    assert seen["enabled"]
    assert seen["frozen_at_start"] > 1000  # the start-up objects (and the modules') frozen
    # What the compile dropped is gone, what survived it (the request's objects) is frozen.
    assert seen["frozen_at_start"] <= seen["frozen_after_compile"] < seen["frozen_at_start"] + 1000
