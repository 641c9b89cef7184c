"""Run a compile's device jobs: one after another here, or spread over forked worker
processes when there are many (`compiler.parallel`), always yielding results in job order.

Only results cross back from a worker, as plain tuples (`_pack`/`_unpack`): workers inherit
the compile's context, the store and the jobs when they are forked, and read the state's rows
of the devices they compile themselves (`_with_rows`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from compiler.context import CompileContext
from compiler.device_compile import DeviceJob, DeviceWork, compile_job
from compiler.gitstore import DeviceStore
from compiler.messages import Change, warm_up
from compiler.outcome import DeviceOutcome
from compiler.parallel import (
    PARALLEL_TARGETING,
    forked_state,
    map_in_chunks,
    split_in_two,
    worker_count,
)
from compiler.state import CompilerState, PlacementRecord

__all__ = ["Progress", "run_jobs"]

#: Reports progress over an iterable of known length (a progress bar, or nothing).
Progress = Callable[[Iterable[Any], int], Iterable[Any]]

_CHANGE_FIELDS = tuple(f.name for f in dataclasses.fields(Change))


def run_jobs(ctx: CompileContext, store: DeviceStore, state: CompilerState,
             jobs: list[DeviceJob], progress: Progress | None) -> Iterator[DeviceWork]:
    """Compile the devices, in forked worker processes when there are many (`parallel`),
    each with the rows `state` holds of it (`_with_rows`).

    A generator, in job order: each result is available as soon as it is computed, so the
    caller streams commits to Git while the rest of the fleet is still rendering. Close it
    to stop the workers early.
    """
    evaluated = sum(len(ctx.changed) if job.likely_reuse else len(ctx.intents.usable)
                    for job in jobs)
    workers = worker_count(evaluated, len(jobs))
    if workers <= 1:
        jobs = _with_rows(state, jobs)
        for job in (progress(jobs, len(jobs)) if progress else jobs):
            yield compile_job(ctx, store, job)
        return
    every = not all(job.likely_reuse for job in jobs)
    loaded: dict[int, DeviceJob] = {}  # this process's range, with its rows
    # A forked process must not touch SQLite when this one has other threads (the fleet
    # server's): one of them may hold SQLite's own locks at the fork, and the child's first
    # call then waits forever (seen: a server compile of 10,000 devices stuck on a worker
    # in futex_do_wait with no CPU used, bench/fleet.py). The rows are then read here.
    rows_read = threading.active_count() > 1
    if rows_read:
        jobs = _with_rows(state, jobs)

    def load(start: int, end: int) -> None:
        loaded.clear()
        chunk = jobs[start:end]
        loaded.update(enumerate(chunk if rows_read else _with_rows(state, chunk), start))

    with forked_state(work=lambda i: compile_job(ctx, store, loaded.pop(i)), pack=_pack,
                      keyed=lambda names: {n: ctx.targeted_by(n) for n in names}, load=load):
        # Computed once here and inherited by every worker, which would otherwise each
        # compute them all again.
        _precompute_targets(ctx, [n for n in ctx.intents.usable if every or (
            n in ctx.changed and n not in ctx.placed_as_before)],
                            split=len(jobs) >= PARALLEL_TARGETING)
        warm_up()  # what every worker would otherwise load for itself
        # When every device only re-evaluates changed intents (a recompile), a device's
        # work is light next to sending its result across: this process then shares the
        # chunks (measured: 10% off the devices' phase). With every intent to evaluate (a
        # first compile) it only collects and streams, or it would hold the workers up.
        yield from map_in_chunks(len(jobs), workers=workers, share=not every,
                                 unpack=_unpack, progress=progress)


def _with_rows(state: CompilerState, jobs: list[DeviceJob]) -> list[DeviceJob]:
    """The jobs with the rows the state holds of their devices: placements, and the tree
    of those whose last compile may be reused (`DeviceJob.likely_reuse`).

    Read here, by the process that compiles them (`CompilerState` reads with a connection
    of its own in a forked one), a range at a time: the main process had read those of
    every device before forking, alone on the critical path while the other cores idled.
    MEASURED (100,000 devices, one intent's parameter, 9,752 devices, 2 cores, medians of
    13 runs): the planning ends 316 -> 202 ms into the compile, the devices' phase takes
    ~50 ms longer, the compile 2.00 -> 1.91 s."""
    ids = [job.device.id for job in jobs]
    placements = state.placements_of(ids)
    trees = state.tree_texts_of(job.device.id for job in jobs if job.likely_reuse)
    return [DeviceJob(job.device, job.record, job.may_have_branch, job.lost_tip,
                      placements[device_id], trees.get(device_id))
            for job, device_id in zip(jobs, ids, strict=True)]


def _precompute_targets(ctx: CompileContext, names: list[str], *, split: bool) -> None:
    """Fill `ctx.targeted` for `names`; with `split` (inside `forked_state`), a forked
    process works out every other intent meanwhile. The sets are the same either way."""
    todo = [n for n in names if n not in ctx.targeted]
    if not split or len(todo) < 2:
        for name in todo:
            ctx.targeted_by(name)
        return
    ctx.targeted.update(split_in_two(todo))


def _pack(work: DeviceWork) -> tuple[Any, ...]:
    """A `DeviceWork` as plain tuples: it crosses from a worker process in a pickle, and
    pickling ~10 objects per device costs more than rendering some of them.

    The names every device repeats (files, intents, actions, reasons, profiles) are one
    object each in this process (`_one`), so that the pickle of a range's results holds
    each once and the parent unpickles one copy per range instead of one per device: the
    parent holds every result until the branches move (docs/benchmarks.md, issue 35)."""
    o = work.outcome
    return ({} if work.packed else o.files, _named(o.kept) if work.message is not None else {},
            [_placement(p) for p in work.placements_written],
            [tuple(_one(getattr(c, n)) for n in _CHANGE_FIELDS) for c in o.changes],
            o.problems, o.notes, o.grace_until, work.message, work.tree, work.stored_files,
            work.tip, work.on_parent, work.removed,
            None if work.failed else (work.files_json(), work.file_count),
            o.moves, work.branch_lost, work.placements_dropped, work.packed)


#: The worker's one object for each name or tuple of names it sends (`_pack`): the
#: distinct names of a compile's intents, files and reasons (a few thousand at most).
_ONE: dict[Any, Any] = {}


def _one(value: Any) -> Any:
    """The worker's one copy of `value` (a string, or a tuple of strings)."""
    if isinstance(value, (str, tuple)):
        return _ONE.setdefault(value, value)
    return value


def _named(files: dict[str, str]) -> dict[str, str]:
    """`files` (name -> blob id) with each name the worker's one copy of it."""
    one = _ONE.setdefault
    return {one(name, name): oid for name, oid in files.items()}


def _placement(row: PlacementRecord) -> tuple[Any, ...]:
    """A placement row as a tuple, its intent and profile the worker's one copy of each."""
    return (row.device_id, _one(row.intent), *row[2:5], _one(row.profile), *row[6:])


def _unpack(packed: tuple[Any, ...]) -> DeviceWork:
    """What the parent process needs of the `DeviceWork` that `_pack` was given: the new
    tree's files cross as the JSON text the state records (`DeviceWork.ids_json`), not as
    `ids`; the outcome's placements stay behind, of which only the rows the state must
    write cross (`placements_written`: a recompile for one intent keeps almost all)."""
    (files, kept, written, changes, problems, notes, grace_until, message, tree,
     stored_files, tip, on_parent, removed, tree_files, moves, branch_lost, dropped,
     commit) = packed
    outcome = DeviceOutcome(files, [], [Change(*c) for c in changes], problems, notes,
                            grace_until, kept, moves=moves)
    ids_json, ids_count = tree_files or (None, 0)
    return DeviceWork(outcome, message, tree, stored_files, tip, on_parent, removed, None,
                      branch_lost, tuple(map(PlacementRecord._make, written)), dropped,
                      ids_json, ids_count, commit)
