"""Plan a compile: which intents changed since the last one, which devices must be
compiled, and what each of them needs of its branch (`plan_compile`); the state's rows of
each device are read by whoever compiles it (`compiler.workers`).

A device whose capabilities did not change and that no changed intent targets (now or
before), places (before) or keeps in a grace period is not compiled at all: it is
accounted as unchanged here, so a no-op recompile of 10,000 devices only hashes their
capability documents. A device whose id can name no branch is reported as an error of
its own and left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import filterfalse
from operator import attrgetter

from compiler.branchset import branch_components
from compiler.context import COMPILER_VERSION, CompileContext, ResolvedIntents, resolve_intents
from compiler.device_compile import DeviceJob
from compiler.gitformat import all_plain_device_ids
from compiler.gitstore import DeviceStore, branch_problem, device_ref
from compiler.placement import ProfileConstraints
from compiler.render import RenderCache
from compiler.report import CompileReport, DeviceResult
from compiler.rollout import RolloutPlan, assign_waves
from compiler.secrets import FleetKey
from compiler.snapshot import Device, LazyDevices, Snapshot, SnapshotMemo
from compiler.source import FleetSource
from compiler.state import CompilerState, DeviceRecord, IntentRecord
from compiler.targeting import TargetIndex
from margo.errors import Problem, short_repr

__all__ = ["CompilePlan", "plan_compile"]

#: Above this many devices unknown to the state, list all branches once rather than looking
#: each device's branch up (a lookup that finds nothing costs about as much as a listed ref).
_LIST_BRANCHES_ABOVE = 1_000


@dataclass
class CompilePlan:
    """What a compile does, decided before any device compiles."""

    context: CompileContext
    jobs: list[DeviceJob]  # the devices to compile, in device order
    report: CompileReport  # started: the devices left as they are, the fleet's errors
    #: The record of every usable intent as it is now, and the intents whose rollout
    #: holds some devices back (their records are saved as changed, `compiler.writing`).
    records: dict[str, IntentRecord]
    gated: dict[str, RolloutPlan]
    snapshot: SnapshotMemo | None


def plan_compile(source: FleetSource, snapshot: Snapshot, store: DeviceStore,
                 state: CompilerState, *, now: float,
                 rollouts: Mapping[str, RolloutPlan],
                 fleet_key: FleetKey | None = None, pack_commits: bool = False) -> CompilePlan:
    """Resolve the intents, find what changed, and list the devices to compile; binds
    `state` to `store` (a state of another repository is forgotten). `pack_commits`:
    `CompileContext.pack_commits`."""
    intents = resolve_intents(source)
    previous_intents = state.intents()
    records = {name: intents.record(name) for name in intents.usable}
    changed = {n for n, r in records.items() if previous_intents.get(n) != r}
    changed |= {n for n in previous_intents if n not in records and n not in intents.frozen}
    gated = _gated_intents(intents, rollouts)
    changed |= set(gated)  # evaluated again on every device while the rollout moves
    ctx = CompileContext(source, intents, previous_intents, changed, ProfileConstraints(),
                         now, TargetIndex(snapshot.devices), RenderCache(fleet_key),
                         pack_commits=pack_commits)
    report = CompileReport(source.revision, devices=len(snapshot.devices))
    _assign_waves(ctx, snapshot, gated, report)
    report.errors.extend((None, p) for p in [*source.problems, *intents.problems,
                                            *snapshot.problems])
    state.bind(store.identity, compiler_version=COMPILER_VERSION)
    jobs = _jobs(ctx, snapshot, store, state, report)
    return CompilePlan(ctx, jobs, report, records, gated, snapshot.memo)


def _gated_intents(intents: ResolvedIntents,
                   rollouts: Mapping[str, RolloutPlan]) -> dict[str, RolloutPlan]:
    """The usable intents with a rollout spec whose plan is not complete."""
    return {name: plan for name, plan in sorted(rollouts.items())
            if plan.status != "complete" and name in intents.usable
            and intents.usable[name][0].rollout is not None}


def _assign_waves(ctx: CompileContext, snapshot: Snapshot, gated: dict[str, RolloutPlan],
                  report: CompileReport) -> None:
    """Each device an intent under a rollout targets gets its wave (`compiler.rollout`)."""
    for name, plan in gated.items():
        intent = ctx.intents.usable[name][0]
        assert intent.rollout is not None
        members = ctx.targeted_by(name)
        waves = assign_waves(name, intent.rollout, (
            (d, snapshot.devices[d].properties, snapshot.devices[d].labels)
            for d in members if d in snapshot.devices))
        ctx.rollouts[name] = (plan, waves)
        report.rollout_waves[name] = waves


def _jobs(ctx: CompileContext, snapshot: Snapshot, store: DeviceStore, state: CompilerState,
          report: CompileReport) -> list[DeviceJob]:
    """The devices that must be compiled, with what they need to know of their branch (the
    state's rows of each are read where it compiles, `compiler.workers`); the others are
    accounted in `report` as unchanged."""
    todo, lost = _devices_to_compile(ctx, snapshot, store, state, report)
    # Devices the state does not know may still have branches (e.g. the state was lost):
    # one listing answers for all of them when there are many (a first compile).
    unknown = sum(record is None for _, record in todo)
    branches = set(store.device_ids()) if unknown > _LIST_BRANCHES_ABOVE else None
    # A device deleted on purpose starts from nothing, whatever a compile that raced the
    # deletion wrote back: its old commits are never continued (`CompilerState.forget`).
    forgotten = state.forgotten()
    lost_tips = {device_id: tip for device_id, (tip, _) in state.trees_of(lost).items()
                 if device_id not in forgotten}
    report.restored_branches += len(lost_tips)
    return [DeviceJob(device, record, branches is None or device.id in branches,
                      lost_tips.get(device.id))
            for device, record in todo]


def _devices_to_compile(ctx: CompileContext, snapshot: Snapshot, store: DeviceStore,
                        state: CompilerState, report: CompileReport,
                        ) -> tuple[list[tuple[Device, DeviceRecord | None]], list[str]]:
    """The devices to compile with their records, in device order, and the devices whose
    branch the state recorded but the repository lost; the others are accounted as
    unchanged in `report`.

    Worked out with set operations, comprehensions and C loops over the fleet, not Python
    calls per device: this is most of what a no-op recompile of a large fleet does (a call
    per device had cost 0.7 s at 100,000 devices)."""
    previous, recorded_digests, recorded_deployments = state.device_records()
    in_grace = state.devices_in_grace()
    placed_by_changed = state.devices_placed_by(ctx.changed)
    devices = snapshot.devices
    ids, plain = _usable_ids(devices, report)
    steady = (set(ids) if _vouched_as_recorded(devices, state)
              else _recorded_as_they_are(ids, devices, recorded_digests))
    # A device the state recorded whose branch is gone (its ref lost, e.g. `packed-refs`
    # deleted) is compiled as a new one: its branch is rebuilt from the source instead of
    # staying missing because nothing it depends on changed.
    lost = _lost_branches(ids, plain, previous, store, all_recorded=len(steady) == len(ids))
    steady.difference_update(lost)
    if steady:  # only worked out if some device may be skipped (targeting costs)
        steady -= _affected_devices(ctx, in_grace, placed_by_changed)
    report.unchanged += len(steady)
    report.deployments += _steady_deployments(previous, recorded_deployments, steady)
    gone = set(lost)
    # The others, in the order of `ids`: filtered in C, then a Python step per device to
    # compile only (a recompile for one intent compiles a tenth of the fleet).
    todo = [] if len(steady) == len(ids) else [  # (steady: some of `ids`)
        (devices[device_id], None if device_id in gone else previous.get(device_id))
        for device_id in filterfalse(steady.__contains__, ids)]
    return todo, lost


def _steady_deployments(previous: Mapping[str, DeviceRecord], total: int,
                        steady: set[str]) -> int:
    """The deployments the records of `steady` (some of `previous`) count, `total` those
    of all: summed over the smaller side, the steady devices or the others (most devices
    of a recompile are steady)."""
    if len(steady) == len(previous):
        return total
    if 2 * len(steady) < len(previous):
        return int(sum(map(_DEPLOYMENTS, map(previous.__getitem__, steady))))
    others = previous.keys() - steady
    return total - int(sum(map(_DEPLOYMENTS, map(previous.__getitem__, others))))


#: A `DeviceRecord`'s deployments, read in C.
_DEPLOYMENTS = attrgetter("deployments")


def _usable_ids(devices: Mapping[str, Device], report: CompileReport,
                ) -> tuple[list[str], bool]:
    """The sorted ids of `devices` but those that can name no branch (`_unusable_id`,
    which reports them), and whether all are plain (`all_plain_device_ids`). A fleet's ids
    are usually all plain, which a few C scans tell, or a `LazyDevices` already knows."""
    if isinstance(devices, LazyDevices) and devices.plain_ids:
        return devices.ids, True
    ids = sorted(devices)
    if all_plain_device_ids(ids):
        return ids, True
    return [device_id for device_id in ids if not _unusable_id(devices[device_id], report)], False


def _vouched_as_recorded(devices: Mapping[str, Device], state: CompilerState) -> bool:
    """Whether every device of a `LazyDevices` is recorded with its document's digest,
    known without comparing: its digests were found among the trusted digests the state
    copied from the records it still holds (`CompilerState.records_are_those_of`), which
    are the digests `_recorded_as_they_are` would compare them with (0.3-0.6 s at a
    million devices, once more after `load_snapshot` did)."""
    vouched_by = devices.vouched_by if isinstance(devices, LazyDevices) else None
    return vouched_by is not None and state.records_are_those_of(vouched_by)


def _recorded_as_they_are(ids: list[str], devices: Mapping[str, Device],
                          recorded: Mapping[str, str]) -> set[str]:
    """The devices of `ids` whose capability document is the one their record was compiled
    from (`recorded`: device id -> that digest). The digests of a `LazyDevices` are its
    memo's, compared all at once (C loops over two dicts' items) without building a device;
    the usual answer of a recompile is every device."""
    digests = devices.digests if isinstance(devices, LazyDevices) else None
    if digests is not None and (digests == recorded or digests.items() <= recorded.items()):
        return set(ids)
    if digests is not None:
        return {device_id for device_id in ids if recorded.get(device_id) == digests[device_id]}
    return {device_id for device_id in ids
            if recorded.get(device_id) == devices[device_id].digest}


def _lost_branches(ids: list[str], plain: bool, previous: Mapping[str, DeviceRecord],
                   store: DeviceStore, *, all_recorded: bool = False) -> list[str]:
    """The devices of `ids` the state recorded whose branch the repository does not have,
    in order; one listing of the refs answers for all of them (`plain`: every id is its
    branch's last component, unencoded; `all_recorded`: the caller knows every id is in
    `previous`, which a no-op of a million devices would otherwise check one by one)."""
    if not previous:
        return []
    refs = store.branch_names()
    recorded = (ids if all_recorded or all(map(previous.__contains__, ids))
                else list(filter(previous.__contains__, ids)))
    if plain:
        branches = branch_components(refs)
        if branches.issuperset(recorded):
            return []
        return [device_id for device_id in recorded if device_id not in branches]
    return [device_id for device_id in recorded if device_ref(device_id) not in refs]


def _unusable_id(device: Device, report: CompileReport) -> bool:
    """Whether no branch can be named for the device's id (one a snapshot built by hand
    holds, or one stored before ids were bounded where they enter): then it is reported as
    an error of its own and left out, so it cannot stop the commits of the rest."""
    problem = branch_problem(device.id)
    if problem is None:
        return False
    located = Problem(("properties", "id"), f"device {short_repr(device.id)} gets no desired "
                      f"state: {problem}", file=device.file, found=short_repr(device.id))
    report.results.append(DeviceResult(device.id, "error", problems=[located]))
    report.errors.append((device.id, located))
    return True


def _affected_devices(ctx: CompileContext, in_grace: set[str], placed_by_changed: set[str],
                      ) -> set[str]:
    """Devices an unchanged capability document does not exempt from compiling: a grace
    period may have run out, a changed intent placed them before or targets them now.
    One set for the fleet, so each device costs one lookup instead of one per intent."""
    affected = in_grace | placed_by_changed
    for name in ctx.changed:
        if name in ctx.intents.usable and name not in ctx.placed_as_before:
            affected |= ctx.targeted_by(name)  # (else: the devices it placed before)
    return affected
