"""Forked compile workers end when their pool is done, even when the parent process has a
SIGTERM handler that only sets a flag (as the fleet server's web server does): the
10,000-device benchmark hung for good in the pool's join before workers reset it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import signal
    from compiler.parallel import forked_state, map_in_chunks, split_in_two

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))  # uvicorn's kind
    with forked_state(work=lambda i: i * i, pack=lambda r: r,
                      keyed=lambda names: {n: len(n) for n in names}):
        for _ in range(20):
            assert list(map_in_chunks(200, workers=3, share=False, unpack=lambda r: r)) == \\
                [i * i for i in range(200)]
            assert split_in_two(["a", "bb", "ccc"]) == {"a": 1, "bb": 2, "ccc": 3}
            chunks = map_in_chunks(200, workers=3, share=True, unpack=lambda r: r)
            next(chunks)
            chunks.close()  # a consumer that stops early: the pool is stopped
    print("done")
""")


def test_workers_end_with_their_pool_under_a_flag_only_sigterm_handler() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"


STOPPED_EARLY = textwrap.dedent("""
    import multiprocessing, time
    from compiler.parallel import forked_state, map_in_chunks

    done = multiprocessing.get_context("fork").Value("i", 0)

    def work(i):
        with done.get_lock():
            done.value += 1
        time.sleep(0.005)
        return i

    with forked_state(work=work, pack=lambda r: r):
        chunks = map_in_chunks(2000, workers=3, share=False, unpack=lambda r: r)
        assert next(chunks) == 0
        chunks.close()  # the consumer stops at its first result
        print(done.value, len(multiprocessing.active_children()))
""")


def test_a_consumer_that_stops_early_ends_the_pool_without_the_queued_work() -> None:
    """The pool is stopped, not terminated (`Pool.terminate` can wait for ever on the task
    queue's lock that an idle worker holds: 2 hangs in 240 runs of the test above): the
    tasks still queued return without working, and every worker has exited when `close`
    returns."""
    run = subprocess.run([sys.executable, "-c", STOPPED_EARLY], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    worked, alive = map(int, run.stdout.split())
    assert alive == 0
    assert worked < 2000 // 2  # the chunks in flight at the stop, not the whole queue
