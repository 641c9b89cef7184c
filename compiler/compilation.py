"""Compile a fleet: source x capability snapshot → one commit per changed device branch.

One pipeline, read top to bottom in `compile_fleet`:

1. plan the compile (`compiler.planning`): resolve the intents, find what changed since the
   last compile, and list the devices that must be compiled, with their records; the
   others are accounted as unchanged without rendering anything;
2. compile each device (`compiler.device_compile`, run by `compiler.workers` here or in
   forked processes, each reading the state's rows of the devices it compiles): a pure
   function of the compile's context (`compiler.context`), the device's job (its record
   and rows) and its branch, deciding each intent once (`compiler.decisions`) and
   what needs room in one capacity round (`compiler.holding`);
3. write (`compiler.writing`): each device's result is accounted as it arrives and its
   commit streams to Git while later devices still compile; then the state's records are
   staged, every branch moves at once, and the records are committed.

Failure containment, so that nothing already committed is lost:
* a broken intent file, or an intent whose application is broken or missing, is *frozen*:
  every device keeps that intent's current file as it is;
* an intent whose rendering fails on a device (bad parameter value, failing expression,
  immutable change) keeps its file there (or gets none), and its problems are reported;
  the device's other intents are placed, updated and removed as usual;
* a broken capability document leaves its device untouched; devices absent from the
  snapshot are left untouched too (absence is not evidence of anything);
* a device whose id can name no branch (`compiler.gitstore.branch_problem`) is an error of
  its own: the other devices are compiled and committed as if it were not there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from compiler.context import resolve_intents
from compiler.gcpause import collection_paused
from compiler.gitstore import DeviceCommit, DeviceStore
from compiler.planning import plan_compile
from compiler.report import CompileReport, DeviceResult
from compiler.rollout import RolloutPlan
from compiler.secrets import FleetKey
from compiler.snapshot import Snapshot
from compiler.source import FleetSource
from compiler.state import CompilerState
from compiler.workers import Progress, run_jobs
from compiler.writing import CompileOutcomes, account_commits, write_fleet

__all__ = ["CompileReport", "DeviceResult", "compile_fleet", "resolve_intents"]


@collection_paused()
def compile_fleet(source: FleetSource, snapshot: Snapshot, store: DeviceStore,
                  state: CompilerState, *, now: float | None = None, dry_run: bool = False,
                  progress: Progress | None = None,
                  on_dry_commit: Callable[[DeviceCommit], None] | None = None,
                  rollouts: Mapping[str, RolloutPlan] | None = None,
                  fleet_key: FleetKey | None = None,
                  on_moved: Callable[[CompileReport], None] | None = None) -> CompileReport:
    """Compile every device of the snapshot; commit (unless `dry_run`) and report.
    `on_dry_commit` sees each commit a dry run would have made (`margo plan --diff`).
    `rollouts`: the fleet server's plan for each intent under a staged rollout.
    `fleet_key` opens the intents' secrets (`compiler.secrets`); without it an intent
    that gives one is an error on every device it places.

    Commits stream to Git while later devices still render (`DeviceStore.write_objects`).
    The state is written before the branches move but committed only once they have moved,
    so it never claims a tree that a failed write did not commit.

    `on_moved` is given the report (commits included) as soon as every branch has moved,
    before the state's commit and before the compile's objects are freed (at a million
    devices each takes seconds): a server serves the new state from that moment, when a
    Git-source device can already fetch it. Not called when no branch moves.
    """
    plan = plan_compile(source, snapshot, store, state,
                        now=time.time() if now is None else now, rollouts=rollouts or {},
                        fleet_key=fleet_key, pack_commits=not dry_run)
    report, outcomes = plan.report, CompileOutcomes()
    works = run_jobs(plan.context, store, state, plan.jobs, progress)
    commits = account_commits(plan.jobs, works, report, outcomes, plan.context.now)
    try:
        if dry_run:
            for commit in commits:
                if on_dry_commit is not None:
                    on_dry_commit(commit)
            return report
        tips = write_fleet(store, state, plan, outcomes, commits,
                           on_moved=None if on_moved is None else
                           lambda moved: on_moved(_with_commits(report, moved)))
    finally:
        commits.close()  # stops worker processes if the write failed half-way
    return _with_commits(report, tips)


def _with_commits(report: CompileReport, tips: Mapping[str, str]) -> CompileReport:
    """The report, each committed device's result naming its new commit."""
    for result in report.results:
        result.commit = tips.get(result.device_id, result.commit)
    return report
