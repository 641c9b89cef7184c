"""Spreading a compile over forked worker processes.

Rendering is pure Python and the fleet server's machines have more than one core, so large
compiles fork workers that inherit everything the parent computed (the source, the
snapshot, the targeting sets) instead of receiving it in a pickle. Only results cross back,
as plain tuples (`pack`/`unpack`, which the caller defines for its own result type).

`forked_state(...)` publishes what workers inherit for the duration of a block; inside it,
`map_in_chunks` yields every item's result in order (as soon as each is ready, so the
caller can stream them on), and `split_in_two` computes half of a keyed job in one forked
process while the caller computes the other half. Outside such a block nothing is forked.
Items are worked out in ranges, and what a range's items read (`load`) is read by the
process that works them out, not by the caller for every item before forking.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import multiprocessing.pool
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import compiler.forkgate  # noqa: F401  (its at-fork hook gates the pool's forks)
from margo.heap import resident_and_available

__all__ = ["FORK_MEMORY_SHARE", "PARALLEL_DEVICES", "PARALLEL_TARGETING", "PARALLEL_THRESHOLD",
           "affordable_workers", "forked_state", "map_in_chunks", "split_in_two",
           "worker_count"]

log = logging.getLogger("margo.compiler.parallel")

R = TypeVar("R")
Progress = Callable[[Iterable[Any], int], Iterable[Any]]

#: Compiles that evaluate at least this many (device, intent) pairs, or commit to at least
#: this many devices (each costs a commit message, a tree and a few digests, ~0.2 ms), are
#: spread over worker processes; below both, starting workers (~20 ms) costs more than it
#: saves.
PARALLEL_THRESHOLD = 10_000
PARALLEL_DEVICES = 500
#: Fleets of at least this many devices to compile work out which devices each intent targets
#: in two processes (about 15 ms per intent per 1,000 devices).
PARALLEL_TARGETING = 2_000

#: What forked workers inherit: the per-item work, its packer, the keyed half-job, and
#: what is read for a range of items before working them out.
_INHERITED: dict[str, Callable[..., Any]] = {}


def worker_count(evaluations: int, devices: int) -> int:
    """How many processes a compile of this size should use (`MARGO_COMPILE_WORKERS`
    overrides; 1 where `fork` is not available)."""
    configured = os.environ.get("MARGO_COMPILE_WORKERS")
    if configured:
        return max(1, int(configured))
    if ((evaluations < PARALLEL_THRESHOLD and devices < PARALLEL_DEVICES)
            or "fork" not in multiprocessing.get_all_start_methods()):
        return 1
    wanted = min(os.cpu_count() or 1, 4)
    memory = resident_and_available()
    workers = affordable_workers(wanted, memory)
    if workers < wanted and memory is not None:
        log.warning("compiling %d devices in %s rather than %d forked workers: each could "
                    "come to hold a copy of this process's %.1f GB, and the system has %.1f "
                    "GB available (MARGO_COMPILE_WORKERS decides instead)", devices,
                    "this process" if workers == 1 else f"{workers} workers", wanted,
                    memory[0] / 1e9, memory[1] / 1e9)
    return workers


#: The share of the system's available memory that forked workers may be counted on to take.
FORK_MEMORY_SHARE = 0.7


def affordable_workers(wanted: int, memory: tuple[int, int] | None) -> int:
    """`wanted`, or fewer when the memory available (`memory`: this process's resident
    bytes and the system's available ones) could not hold a copy of this process per
    worker; 1 is "compile here, forking nothing". Why a copy: a forked worker's private
    memory grows toward the parent's resident set as it reads the inherited objects
    (reference counts are writes to their pages). MEASURED: a fleet server's first
    compile of 1,000,000 devices forked 2 workers at 7 GB resident; they and Git held 18 GB
    eight minutes later and the 24 GiB machine ran out, where compiling in the server
    alone peaks at 13.1 GB (docs/benchmarks.md)."""
    if memory is None or wanted <= 1:
        return wanted
    resident, available = memory
    fits = int(available * FORK_MEMORY_SHARE // max(resident, 1))
    return min(wanted, max(1, fits))


@contextmanager
def forked_state(*, work: Callable[[int], Any], pack: Callable[[Any], Any],
                 keyed: Callable[[list[str]], dict[str, Any]] | None = None,
                 load: Callable[[int, int], None] | None = None) -> Iterator[None]:
    """Publish `work(index)`, `pack(result)`, `keyed(names)` and `load(start, end)` to the
    workers forked inside the block. `map_in_chunks` calls `load(start, end)` in the
    process about to work out items start..end-1, before the first of them."""
    _INHERITED.update(work=work, pack=pack, keyed=keyed or (lambda names: {}),
                      load=load or (lambda start, end: None))
    try:
        yield
    finally:
        _INHERITED.clear()


#: In a worker: its pool's "stop" event (set when the consumer stopped early or failed).
_stopping: Any = None


def _run_range(bounds: tuple[int, int]) -> list[Any]:
    if _stopping is not None and _stopping.is_set():
        return []  # nobody reads it: the pool drains its queue and ends (`_pool`)
    work, pack = _INHERITED["work"], _INHERITED["pack"]
    _INHERITED["load"](*bounds)
    return [pack(work(i)) for i in range(*bounds)]


def _run_keyed(names: list[str]) -> dict[str, Any]:
    if _stopping is not None and _stopping.is_set():
        return {}
    computed: dict[str, Any] = _INHERITED["keyed"](names)
    return computed


#: The signals that end a worker (what stopping the server sends its process group).
_ENDING = frozenset({signal.SIGTERM, signal.SIGINT})


def _worker_start(stopping: Any) -> None:
    """A forked worker's start: remember its pool's stop event, then `_worker_signals`."""
    global _stopping
    _stopping = stopping
    _worker_signals()


def _worker_signals() -> None:
    """A forked worker takes the default action on SIGTERM and SIGINT. It would otherwise
    inherit the parent's Python handlers (the fleet server's web server installs ones that
    only set a flag), and a SIGTERM (the pool's terminate, which this module no longer
    uses, or the server's process group being stopped) sent to an idle worker waiting on
    the task queue would never end it: a compile once hung forever joining the pool.
    Workers are forked with both blocked (`_pool`), so one that arrived before this ran is
    still pending, and ends the worker when they are unblocked here."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _ENDING)


@contextmanager
def _pool(processes: int) -> Iterator[multiprocessing.pool.Pool]:
    """A fork pool that is closed and joined (each worker exits by itself) when the block
    ends, normally or not.

    When the block raises (a consumer that stops at its first result, an error) the pool is
    not terminated: its stop event is set, so the tasks still queued return at once
    without working, and the pool is closed and joined as usual. Why: `Pool.terminate`
    first takes the task queue's read lock (`_help_stuff_finish`), which an idle worker
    holds while it waits for a task, and it never comes: MEASURED (CPython 3.11, six of
    these in parallel on 2 cores), 2 in 240 such terminates hung for good, which would
    leave a compile (and its lock) hanging in the server.

    The pool is made with SIGTERM and SIGINT blocked in this thread (a thread's mask is its
    own: the process still takes them): its workers, and those its maintenance thread forks
    later, start with them blocked until `_worker_signals` has set the default action, so a
    SIGTERM (the server being stopped, `killpg`) ends a worker rather than reaching the
    parent's flag-only handler it would otherwise inherit."""
    context = multiprocessing.get_context("fork")
    stopping = context.Event()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
    try:
        # (Each fork waits for no other thread to be inside libgit2: `compiler.forkgate`.)
        pool = context.Pool(processes, initializer=_worker_start, initargs=(stopping,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _widen_results_pipe(pool)
    try:
        yield pool
    except BaseException:
        stopping.set()
        raise
    finally:
        pool.close()
        pool.join()


#: What the pipe carrying the workers' results holds (Linux's default limit for an
#: unprivileged process; the default is 64 KiB).
_RESULTS_PIPE_SIZE = 1 << 20


def _widen_results_pipe(pool: multiprocessing.pool.Pool) -> None:
    """Give the pipe the pool's workers send their results through `_RESULTS_PIPE_SIZE`
    bytes where the system allows (Linux); elsewhere it keeps its size: only speed
    depends on it.

    Why: this process reads the results in a thread of the pool, which needs the
    interpreter lock for every read, and gets it only when the thread computing (this
    process shares the chunks, `_shared_parts`) lets it go, every 5 ms. A chunk's results
    (a few hundred KB) then went through a 64 KiB pipe in as many waits, the worker
    blocked writing all the while. MEASURED (100,000 devices, one intent's parameter,
    9,752 devices): the worker sat blocked in that write about as long as it computed."""
    setter = getattr(fcntl, "F_SETPIPE_SZ", None)
    reader = getattr(getattr(pool, "_outqueue", None), "_reader", None)
    if setter is None or reader is None:
        return
    with contextlib.suppress(OSError, ValueError):
        fcntl.fcntl(reader.fileno(), setter, _RESULTS_PIPE_SIZE)


def split_in_two(names: list[str]) -> dict[str, Any]:
    """`keyed(names)`, half of the names computed in a forked process meanwhile."""
    keyed = _INHERITED["keyed"]
    if len(names) < 2:
        computed: dict[str, Any] = keyed(names)
        return computed
    with _pool(1) as pool:
        pending = pool.apply_async(_run_keyed, (names[1::2],))
        mine = keyed(names[0::2])
        return {**mine, **pending.get()}


def map_in_chunks(count: int, *, workers: int, share: bool, unpack: Callable[[Any], R],
                  progress: Progress | None = None) -> Iterator[R]:
    """`work(i)` for every i in `range(count)`, in order, over `workers` processes.

    Small chunks: the first result arrives sooner, and no worker is left alone on a big
    last chunk while the others idle. With `share`, this process computes chunks itself
    instead of only collecting (`_shared_parts`: right when each item is light next to
    sending its result across; wrong when items are heavy, where collecting and streaming
    keeps the workers fed)."""
    step = max(1, count // (workers * 32))
    ranges = [(start, min(start + step, count)) for start in range(0, count, step)]
    with _pool(workers - 1 if share else workers) as pool:
        if share:
            parts: Iterator[Iterable[R]] = _shared_parts(pool, workers - 1, ranges, unpack)
        else:
            parts = (map(unpack, part) for part in pool.imap(_run_range, ranges))
        for part in (progress(parts, len(ranges)) if progress else parts):
            yield from part


#: Ranges each pool process has queued (`_shared_parts`): one it works on, one waiting,
#: so that it never idles while this process is busy.
_QUEUED = 2


def _shared_parts(pool: multiprocessing.pool.Pool, processes: int,
                  ranges: list[tuple[int, int]], unpack: Callable[[Any], R],
                  ) -> Iterator[Iterable[R]]:
    """Each range's results, in order, computed by the pool or by this process, whichever
    is free: the pool is handed the ranges in order, `_QUEUED` per process not yet done;
    this process computes the range due next when nobody has taken it, and while the pool
    still works on it, the next range nobody has taken (kept until its turn).

    Why not a fixed share (this process every `workers`-th range, as before): which side
    is faster varies (this process also streams every result to Git, the pool's process
    shares a core with Git and with whatever else runs there), and with a fixed half the
    faster one waits for the slower at every range it is due. MEASURED (100,000 devices,
    one intent's parameter, 9,752 devices, on 2 busy cores): this process took 41-58 % of
    the devices, varying from run to run."""
    work, load = _INHERITED["work"], _INHERITED["load"]
    pending: dict[int, multiprocessing.pool.AsyncResult[list[Any]]] = {}
    mine: dict[int, list[R]] = {}
    taken = 0  # ranges before this one are pending, in `mine`, or yielded

    def hand_out() -> None:
        nonlocal taken
        busy = sum(not result.ready() for result in pending.values())
        while taken < len(ranges) and busy < processes * _QUEUED:
            pending[taken] = pool.apply_async(_run_range, (ranges[taken],))
            taken, busy = taken + 1, busy + 1

    def compute(index: int) -> None:
        load(*ranges[index])
        mine[index] = [work(i) for i in range(*ranges[index])]

    for due in range(len(ranges)):
        while due not in mine:
            if taken == due:  # nobody has it: the pool gets the next ones, this one is ours
                taken += 1
                hand_out()
                compute(due)
            elif pending[due].ready() or taken == len(ranges):
                hand_out()  # (before the consumer's turn: the pool works meanwhile)
                yield map(unpack, pending.pop(due).get())
                break
            else:
                compute(taken)
                taken += 1
                hand_out()
        else:
            hand_out()
            yield mine.pop(due)
