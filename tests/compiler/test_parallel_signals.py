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
            chunks.close()  # a consumer that stops early: the pool is terminated
    print("done")
""")


def test_workers_end_with_their_pool_under_a_flag_only_sigterm_handler() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
