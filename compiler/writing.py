"""Write a compile: each device's result is accounted as it arrives and its commit streams
to Git (`account_commits`), its records into the state's open transaction a batch at a time;
then, in a plain sequence, the rest of the state's records and the committed devices' new
tips are staged while the pack is finished, every branch moves at once, and the records
are committed (`write_fleet`).

All or nothing: the branches move in one compare-and-swap (`DeviceStore.move_branches`),
and the state is committed only once they have moved, so it never claims a tree that a
failed write did not commit; if the move fails, the staged records are rolled back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from compiler.device_compile import DeviceJob, DeviceWork, work_commit
from compiler.gitstore import DeviceCommit, DeviceStore
from compiler.planning import CompilePlan
from compiler.report import CompileReport, DeviceResult
from compiler.state import (
    CompilerState,
    DeviceRecord,
    IntentRecord,
    PlacementRecord,
    StagedSave,
    StagingSave,
)

__all__ = ["CompileOutcomes", "account_commits", "write_fleet"]

#: What the digest of an intent's record is while a rollout holds some of its devices back:
#: the compile after the rollout ends must see it as changed and move every device on.
_GATED = "rollout"
#: What the digests of a frozen intent's record are replaced with (no intent has them).
_FROZEN = "frozen"


#: Devices whose rows are written into the state at once while the compile streams
#: (`_writing_batches`): about 40 ms of SQLite at a time, often enough to keep memory low.
_BATCH = 1000


@dataclass
class CompileOutcomes:
    """What a compile records in the state, gathered while its commits stream to Git:
    `devices`, `placements`, `dropped` and `trees` since the last batch was written
    (`write_batch`), `forget` and `restarted` for the whole compile."""

    devices: list[DeviceRecord] = field(default_factory=list)
    placements: list[PlacementRecord] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    #: Devices committed with no parent (a branch of their own from nothing).
    restarted: list[str] = field(default_factory=list)
    #: The placement rows of the devices of `devices` that the state holds and must
    #: delete, as (device id, intent): `placements` are only the rows it must write
    #: (`DeviceWork.placements_written`); the others it holds stay as they are.
    dropped: list[tuple[str, str]] = field(default_factory=list)
    #: Device -> (its tip when unchanged, else None until Git says; its files' JSON text,
    #: `compiler.state.files_json`).
    trees: dict[str, tuple[str | None, str]] = field(default_factory=dict)

    def write_batch(self, staging: StagingSave) -> None:
        """Write the devices accounted since the last batch into `staging`, and forget
        them here."""
        staging.write_devices(self.devices, self.placements, self.trees, self.dropped)
        self.devices, self.placements, self.dropped, self.trees = [], [], [], {}


def account_commits(jobs: list[DeviceJob], works: Iterable[DeviceWork], report: CompileReport,
                    outcomes: CompileOutcomes, now: float,
                    ) -> Generator[DeviceCommit, None, None]:
    """The commits of the compiled devices, in device order, accounting every device in
    `report` and `outcomes` as its result arrives (consume it fully before reading them).

    Each device's model is released once its result is here (`Device.release`): nothing
    in this process uses it again, and what the results take then reuses its memory."""
    for job, work in zip(jobs, works, strict=True):
        device_id, outcome = job.device.id, work.outcome
        job.device.release()
        result = DeviceResult(device_id, "unchanged", outcome.changes, outcome.problems,
                              notes=outcome.notes, grace_until=outcome.grace_until)
        report.results.append(result)
        report.errors.extend((device_id, p) for p in outcome.problems)
        if work.failed:  # the device as a whole failed
            result.status, result.changes = "error", []
            report.deployments += work.stored_files
            outcomes.forget.append(device_id)
            continue
        _account(job, work, report, outcomes, now)
        if work.message is None:
            report.unchanged += 1
            continue
        result.status = "committed"
        report.commits += 1
        if work.tip is None:
            outcomes.restarted.append(device_id)
        yield work_commit(device_id, work, now)


def _account(job: DeviceJob, work: DeviceWork, report: CompileReport,
             outcomes: CompileOutcomes, now: float) -> None:
    """What the state records of a device that compiled (committed or not)."""
    device_id, outcome = job.device.id, work.outcome
    assert work.tree is not None
    if outcome.problems:  # compiled in full next time, so they are reported again
        outcomes.forget.append(device_id)
    report.deployments += work.file_count
    for name, base in outcome.moves:
        report.rollout_moves.setdefault(name, {})[device_id] = base
    outcomes.devices.append(DeviceRecord(device_id, job.device.digest, now, work.tree,
                                         work.file_count))
    outcomes.placements.extend(work.placements_written)
    outcomes.dropped.extend((device_id, name) for name in work.placements_dropped)
    outcomes.trees[device_id] = (work.tip if work.message is None else None, work.files_json())


def write_fleet(store: DeviceStore, state: CompilerState, plan: CompilePlan,
                outcomes: CompileOutcomes, commits: Iterator[DeviceCommit],
                on_moved: Callable[[Mapping[str, str]], None] | None = None
                ) -> dict[str, str]:
    """Write the commits and save the state, all or nothing; device id -> new tip.

    Locked from the first commit until the state says what was written (no lock when
    nothing is written): write every object and the devices' records (the devices still
    compiling meanwhile), stage the rest of the records and the trees' new tips while the
    pack is finished, move every branch, tell `on_moved` the new tips (a server serves them
    from then on: a Git-source device sees them from the move itself), commit the records.
    The records are committed even when `on_moved` raises (the branches have moved); its
    exception then propagates.
    """
    first = next(commits, None)
    if first is None:
        _save_without_commits(state, plan, outcomes)
        return {}
    with store.lock():
        staging = state.begin_stage(plan.snapshot)
        staged: list[StagedSave] = []
        try:
            # Every commit is made once the pack has it: the rest is staged while the pack
            # is finished, on this core while its hashing runs on the other.
            pending = store.write_objects(
                _writing_batches(itertools.chain([first], commits), outcomes, staging),
                expected_commits=len(plan.jobs),
                meanwhile=lambda tips: staged.append(_stage(staging, plan, outcomes, tips)))
            if not staged:
                staged.append(_stage(staging, plan, outcomes, pending.new_tips))
            store.move_branches(pending)
        except BaseException:
            if staged and staged[0].pending:
                staged[0].rollback()
            staging.rollback()
            raise
        try:
            if on_moved is not None:
                on_moved(pending.new_tips)
        finally:
            _commit(staged[0])
    return dict(pending.new_tips)


def _save_without_commits(state: CompilerState, plan: CompilePlan,
                          outcomes: CompileOutcomes) -> None:
    """Save the records of a compile that commits nothing (a device with no tip, no
    branch, has no tree recorded)."""
    staging = state.begin_stage(plan.snapshot)
    try:
        staged = _stage(staging, plan, outcomes, {})
    except BaseException:
        staging.rollback()
        raise
    _commit(staged)


def _commit(staged: StagedSave) -> None:
    """Commit the staged records (rolled back if committing fails)."""
    try:
        staged.commit()
    except BaseException:
        if staged.pending:
            staged.rollback()
        raise


def _writing_batches(commits: Iterator[DeviceCommit], outcomes: CompileOutcomes,
                     staging: StagingSave) -> Iterator[DeviceCommit]:
    """The commits, the devices accounted meanwhile written into the state's transaction
    every `_BATCH` devices: while the other devices still compile, not after the last."""
    for commit in commits:
        yield commit
        if len(outcomes.devices) >= _BATCH:
            outcomes.write_batch(staging)


def _stage(staging: StagingSave, plan: CompilePlan, outcomes: CompileOutcomes,
           tips: Mapping[str, str]) -> StagedSave:
    """Write the rest of the compile's records into the state, uncommitted, the trees of
    committed devices at their new `tips` (`StagedSave.record_tips`)."""
    records, gated, frozen = plan.records, plan.gated, plan.context.intents.frozen
    previous = plan.context.previous_intents
    outcomes.write_batch(staging)
    staged = staging.stage(
        intents=[*(dataclasses.replace(r, digest=_GATED) if r.name in gated else r
                   for r in records.values()),
                 *_frozen_records(previous, frozen)],
        forget_intents=[n for n in previous if n not in records and n not in frozen],
        forget_devices=outcomes.forget, restarted=outcomes.restarted)
    staged.record_tips(tips)
    return staged


def _frozen_records(previous: dict[str, IntentRecord], frozen: set[str]) -> list[IntentRecord]:
    """The records of frozen intents, marked so that the intent counts as changed, with
    changed placement, once it is usable again.

    Why: while frozen, its devices keep their files and placement records whatever their
    capabilities do, so those records say nothing about the devices any more; its first
    usable compile must evaluate every device again, not keep or reuse them."""
    return [dataclasses.replace(previous[name], digest=_FROZEN, placement_digest=_FROZEN)
            for name in sorted(frozen) if name in previous]
