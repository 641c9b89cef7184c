"""`map_in_chunks` with `share`: this process and the pool take whichever range is free
(`compiler.parallel._shared_parts`), yet every result comes once, in order, whichever side
is slower, and a consumer that stops early still ends the pool."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, time
    from compiler.parallel import forked_state, map_in_chunks

    parent = os.getpid()
    here = multiprocessing.get_context("fork").Value("i", 0)

    def work(i, slow):
        # The slow side (this process, or the pool) sleeps on each item.
        if (os.getpid() == parent) == (slow == "here"):
            time.sleep(0.002)
        if os.getpid() == parent:
            with here.get_lock():
                here.value += 1
        return (i, i * i)

    for slow in ("here", "pool", "neither"):
        for count, workers in ((1, 2), (7, 2), (300, 2), (301, 3), (64, 4)):
            here.value = 0
            with forked_state(work=lambda i: work(i, slow), pack=lambda r: r):
                got = list(map_in_chunks(count, workers=workers, share=True,
                                         unpack=lambda r: r))
            assert got == [(i, i * i) for i in range(count)], (slow, count, workers)
            assert 0 < here.value <= count
            if slow == "pool" and count >= 300:
                assert here.value > count // workers, (here.value, count, workers)
    with forked_state(work=lambda i: i, pack=lambda r: r):
        results = map_in_chunks(5000, workers=3, share=True, unpack=lambda r: r)
        assert next(results) == 0
        results.close()  # the pool is stopped and joined
    assert not multiprocessing.active_children()
    print("done")
""")


def test_shared_ranges_come_once_in_order_whichever_side_is_slower() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
