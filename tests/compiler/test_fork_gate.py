"""A compile forks its workers only while no other thread is inside a libgit2 call that
lets threads run (`compiler.forkgate`): a child forked then would inherit libgit2's
process-wide locks held by a thread it does not have, and wait for good on its first pack
read. Real pygit2 walks of a real repository, real forked workers."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
import time
from pathlib import Path

import pygit2

from compiler.forkgate import FORK_GATE, gated_steps
from compiler.parallel import forked_state, map_in_chunks


def _repository(path: Path, commits: int) -> pygit2.Repository:
    subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    stream = "".join(
        f"commit refs/heads/main\ncommitter a <a@example.com> {1_700_000_000 + i} +0000\n"
        f"data 2\nc{i % 10}\n\n" for i in range(commits))  # (each on the last)
    subprocess.run(["git", "--git-dir", str(path), "fast-import", "--quiet"],
                   input=stream.encode(), check=True)
    return pygit2.Repository(str(path))


def test_each_step_of_a_gated_walk_holds_the_gate(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "r.git", 5)
    held: list[bool] = []

    def steps() -> object:
        for commit in repo.walk(repo.references["refs/heads/main"].target):
            held.append(FORK_GATE.locked())
            yield commit

    walked = []
    for commit in gated_steps(iter(steps())):  # type: ignore[call-overload]
        walked.append(commit)
        held.append(FORK_GATE.locked())
    assert len(walked) == 5
    assert held == [True, False] * 5


def test_workers_are_not_forked_while_a_walk_step_runs() -> None:
    results: list[int] = []

    def compile_in_workers() -> None:
        with forked_state(work=lambda i: i * 2, pack=lambda r: r):
            results.extend(map_in_chunks(4, workers=2, share=False, unpack=lambda r: r))

    with FORK_GATE:  # as a thread inside a walk step holds it
        worker = threading.Thread(target=compile_in_workers)
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive() and not multiprocessing.active_children()
    worker.join(timeout=60)
    assert not worker.is_alive() and results == [0, 2, 4, 6]


def _exit_at_once() -> None:
    pass


def test_every_fork_waits_for_the_gate_whoever_makes_it() -> None:
    """No caller can wrap the fork `multiprocessing`'s pool makes from its own thread to
    replace a worker that died (`Process.start`, as here): the at-fork hook gates it. (The
    pool itself is not used: a worker killed while idle takes the task queue's lock with it,
    and the pool then hangs whatever the gate does.)"""
    started: list[int] = []

    def start_a_process() -> None:
        process = multiprocessing.get_context("fork").Process(target=_exit_at_once)
        process.start()
        started.append(process.pid or 0)
        process.join(timeout=30)

    with FORK_GATE:  # as a thread inside a walk step holds it
        thread = threading.Thread(target=start_a_process)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not started
    thread.join(timeout=60)
    assert not thread.is_alive() and started


def test_a_forked_child_can_take_the_gate_itself() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0 if FORK_GATE.acquire(timeout=10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not FORK_GATE.locked()  # the parent's is free again too
