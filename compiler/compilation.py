"""Compile a fleet: source x capability snapshot → one commit per changed device branch.

For every device in the snapshot this decides which deployment files its tree must hold
(`placement` + `render`), compares with the branch tip, and commits only real changes,
with a message that says why. It is incremental: a device whose capabilities did not
change and that no changed intent targets (now or before) is skipped without rendering,
so a no-op recompile of 10,000 devices only hashes their capability documents.

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

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from compiler.capacity import DeviceCapacity, is_cluster
from compiler.gcpause import collection_paused
from compiler.gitstore import (
    DeviceCommit,
    DeviceStore,
    StoredTree,
    blob_id,
    branch_problem,
    device_ref,
    tree_id_of,
)
from compiler.holding import StoredFiles, decide_in_order, take_back_upgrades
from compiler.intents import Intent
from compiler.messages import Change, commit_message, warm_up
from compiler.outcome import NO_TREE as _NO_TREE
from compiler.outcome import DeviceOutcome as _DeviceOutcome
from compiler.parallel import (
    PARALLEL_TARGETING,
    forked_state,
    map_in_chunks,
    split_in_two,
    worker_count,
)
from compiler.placement import Placement, ProfileConstraints, place
from compiler.render import RenderCache, RenderError, file_name, render
from compiler.rollout import RolloutPlan, assign_waves
from compiler.snapshot import Device, Snapshot
from compiler.source import AppVersion, FleetSource
from compiler.specdiff import classify
from compiler.state import (
    CompilerState,
    DeviceRecord,
    IntentRecord,
    PlacementRecord,
    StagedSave,
)
from compiler.targeting import TargetIndex
from margo.errors import Problem, short_repr
from margo.models import DeploymentProfile

__all__ = ["CompileReport", "DeviceResult", "compile_fleet", "resolve_intents"]

#: Reports progress over an iterable of known length (a progress bar, or nothing).
Progress = Callable[[Iterable[Any], int], Iterable[Any]]

#: Bumped when the compiler's output for the same inputs changes, forcing re-rendering.
#: 2: placements see root extensions and cluster sections. 3: a string ending in a newline
#: is quoted in the YAML (written plain, it lost the newline). 4: capacity accounting.
COMPILER_VERSION = "4"
_SUFFIX = ".yaml"
_FAST_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class DeviceResult:
    device_id: str
    status: str  # committed | unchanged | error
    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    commit: str | None = None
    notes: list[str] = field(default_factory=list)  # e.g. deployments kept for a grace period
    grace_until: float | None = None  # when the first grace period kept here runs out


@dataclass
class CompileReport:
    revision: str
    devices: int = 0
    deployments: int = 0
    commits: int = 0
    unchanged: int = 0
    errors: list[tuple[str | None, Problem]] = field(default_factory=list)  # (device, problem)
    results: list[DeviceResult] = field(default_factory=list)
    #: Per intent under a rollout: each targeted device's wave, and the devices this compile
    #: moved to the new revision with the blob each had before (for `wfm.rollouts`).
    rollout_waves: dict[str, dict[str, int]] = field(default_factory=dict)
    rollout_moves: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def next_grace_expiry(self) -> float | None:
        """The earliest moment (epoch seconds) a kept deployment's grace period runs out: a
        compile is due then even if no input changes, or the deployment would stay forever."""
        times = [r.grace_until for r in self.results if r.grace_until is not None]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "deployments": self.deployments, "commits": self.commits,
            "unchanged": self.unchanged,
            "errors": [{"device": device, **problem.to_json()} for device, problem in self.errors],
        }


@dataclass
class ResolvedIntents:
    usable: dict[str, tuple[Intent, AppVersion]]
    frozen: set[str]
    problems: list[Problem]

    def record(self, name: str) -> IntentRecord:
        intent, app = self.usable[name]
        return IntentRecord(name, intent.digest, app.description.id, app.description.version,
                            app.digest, intent.placement_digest)


def resolve_intents(source: FleetSource) -> ResolvedIntents:
    """Pair each intent with its application version; freeze those that cannot be used."""
    usable: dict[str, tuple[Intent, AppVersion]] = {}
    frozen = set(source.broken_intents)
    problems: list[Problem] = []
    for name, intent in sorted(source.intents.items()):
        app = source.application(intent.application_id, intent.application_version)
        if intent.application_id in source.broken_apps:
            frozen.add(name)
            problems.append(intent.locate(Problem(
                ("spec", "application"), f"application {intent.application_id} has errors; "
                "devices keep this intent's previous deployments")))
            continue
        if app is None:
            frozen.add(name)
            wanted = intent.application_id + (f" version {intent.application_version}"
                                               if intent.application_version else "")
            known = ", ".join(sorted(source.applications.get(intent.application_id, {})))
            problems.append(intent.locate(Problem(
                ("spec", "application"), f"no application {wanted} in the fleet source"
                + (f" (versions: {known})" if known else ""))))
            continue
        unknown = sorted(set(intent.parameters) - set(app.description.parameters))
        if unknown:
            frozen.add(name)
            known_parameters = "one of " + ", ".join(sorted(app.description.parameters))
            problems.extend(intent.locate(Problem(
                ("spec", "parameters", p), f"application {app.description.id} "
                f"{app.description.version} has no parameter {p!r}",
                expected=known_parameters)) for p in unknown)
            continue
        usable[name] = (intent, app)
    return ResolvedIntents(usable, frozen, problems)


def _parse_previous(data: bytes) -> dict[str, Any] | None:
    """A file this compiler wrote earlier, as data. Our canonical YAML reads the same in
    YAML 1.1 and 1.2 (a tested property), so libyaml's fast loader is safe here."""
    try:
        document = yaml.load(data, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return None
    return document if isinstance(document, dict) else None


@dataclass
class _Context:
    """Everything one compile shares across devices."""

    source: FleetSource
    intents: ResolvedIntents
    previous_intents: dict[str, IntentRecord]
    changed: set[str]
    constraints: ProfileConstraints
    now: float
    targets: TargetIndex
    store: DeviceStore  # device branches are read from it while compiling
    renders: RenderCache = field(default_factory=RenderCache)
    stored: StoredFiles = field(default_factory=StoredFiles)  # what files on devices take
    #: Every intent a device's tree may hold a file of, sorted (worked out once, not per
    #: device); a tree's other files are of deleted intents.
    names: list[str] = field(init=False)
    known: frozenset[str] = field(init=False)
    #: Name -> file name of every usable intent that did not change: what a device whose
    #: capabilities did not change either may keep exactly as last time (`_keep_steady`).
    steady: dict[str, str] = field(init=False)
    steady_files: dict[str, str] = field(init=False)  # file name -> name
    #: Changed intents that place every device as last time (the same application and the
    #: same `Intent.placement_digest`, e.g. only parameters were edited): a device whose
    #: capabilities did not change either keeps its recorded placement (`_place_as_before`).
    placed_as_before: frozenset[str] = field(init=False)
    #: Intent name -> the devices it targets (`TargetIndex.targeted`), looked up inline: the
    #: innermost loop asks it for every (device, intent) pair.
    targeted: dict[str, frozenset[str]] = field(default_factory=dict)
    _immutable: dict[str, bool] = field(default_factory=dict)
    _profiles: dict[tuple[str, str | None], DeploymentProfile | None] = field(
        default_factory=dict)
    classified: dict[tuple[bytes, bytes], str] = field(default_factory=dict)  # `classify`
    #: Intent name -> its rollout plan and each targeted device's wave (`compiler.rollout`),
    #: for intents whose rollout is not complete.
    rollouts: dict[str, tuple[RolloutPlan, dict[str, int]]] = field(default_factory=dict)
    #: Intent name -> its line of `_inputs_digest` (the same for every device it placed).
    digest_lines: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.known = frozenset(self.intents.usable) | self.intents.frozen
        self.names = sorted(self.known)
        self.steady = {name: file_name(name) for name in self.names
                       if name in self.intents.usable and name not in self.changed}
        self.steady_files = {fname: name for name, fname in self.steady.items()}
        self.placed_as_before = frozenset(
            name for name in self.changed if name in self.intents.usable
            and (before := self.previous_intents.get(name)) is not None
            and (now := self.intents.record(name)).app_digest == before.app_digest
            and now.placement_digest == before.placement_digest)

    def targeted_by(self, name: str) -> frozenset[str]:
        """The devices intent `name` (a usable one) targets."""
        found = self.targeted.get(name)
        if found is None:
            found = self.targeted[name] = self.targets.targeted(self.intents.usable[name][0])
        return found

    def profile(self, app: AppVersion, profile_id: str | None) -> DeploymentProfile | None:
        """The profile of `app` with this id, or None unless exactly one has it."""
        key = (app.digest, profile_id)
        if key not in self._profiles:
            found = [p for p in app.description.profiles
                     if profile_id is not None and p.id == profile_id]
            self._profiles[key] = found[0] if len(found) == 1 else None
        return self._profiles[key]

    def has_immutable_settings(self, app: AppVersion) -> bool:
        """Whether a deployment of `app` must be checked against the previous one."""
        found = self._immutable.get(app.digest)
        if found is None:
            found = self._immutable[app.digest] = any(
                s.immutable for s in app.description.settings().values())
        return found


def _change_reasons(ctx: _Context, name: str, caps_changed: bool) -> tuple[str, ...]:
    previous = ctx.previous_intents.get(name)
    current = ctx.intents.record(name)
    reasons = []
    if previous is not None and previous.digest != current.digest:
        reasons.append("intent edited")
    if previous is not None and previous.app_version != current.app_version:
        reasons.append(f"application version {previous.app_version} -> {current.app_version}")
    elif previous is not None and previous.app_digest != current.app_digest:
        reasons.append("application description changed")
    if caps_changed:
        reasons.append("capabilities changed")
    return tuple(reasons) or ("re-rendered",)


def _add_reason(ctx: _Context, name: str, previous: PlacementRecord | None) -> str:
    if previous is not None and not previous.eligible:
        return "device became eligible"
    if name not in ctx.previous_intents:
        return "intent added"
    return "device now targeted"


def _keep_steady(ctx: _Context, previous: dict[str, PlacementRecord], current: StoredTree,
                 out: _DeviceOutcome, *, recheck_waiting: bool) -> set[str]:
    """With unchanged capabilities, an unchanged intent decides exactly as last time: keep
    its file (or its absence) and its record instead of evaluating and rendering again.
    Returns the intents so settled. Placements in a grace period are always evaluated
    again, since time is an input; so are placements waiting for capacity when what the
    device has left may have changed (`recheck_waiting`), and a file the state has no
    record of.

    Walks the device's few records and files rather than every steady intent: most
    intents target a device neither before nor now, and those are settled as they are."""
    steady = ctx.steady
    settled = set(steady)
    ids, kept, new_ids, placements = current.ids, out.kept, out.ids, out.placements
    for name, record in previous.items():
        fname = steady.get(name)
        if fname is None:
            continue
        if record.ineligible_since is not None or (record.waiting and recheck_waiting):
            settled.discard(name)
            continue
        if fname in ids:
            kept[fname] = new_ids[fname] = ids[fname]
        placements.append(record)
    for fname in ids:
        name = ctx.steady_files.get(fname)
        if name is not None and name not in previous:
            settled.discard(name)
    return settled


def _compile_device(ctx: _Context, device: Device, current: StoredTree,
                    previous: dict[str, PlacementRecord], caps_changed: bool, *,
                    reuse: bool = False) -> _DeviceOutcome:
    """The device's new tree. With `reuse` (its capabilities and last compile are known to
    be unchanged), only the intents that changed are evaluated again."""
    out = _DeviceOutcome({}, [], [], [], [])
    names = ctx.names
    deleted = [f[: -len(_SUFFIX)] for f in current.ids
               if f.endswith(_SUFFIX) and f[: -len(_SUFFIX)] not in ctx.known]
    if deleted:
        names = sorted(ctx.known.union(deleted))
    usable, frozen, ids, targeted = (ctx.intents.usable, ctx.intents.frozen, current.ids,
                                     ctx.targeted)
    recheck_waiting = not reuse or _shares_may_change(ctx, previous, deleted)
    settled = (_keep_steady(ctx, previous, current, out, recheck_waiting=recheck_waiting)
               if reuse else set())
    # New placements wait until every placement the tree holds is known: they get what
    # those leave (capacity accounting, `compiler.capacity`).
    new: list[tuple[Intent, AppVersion, Placement]] = []
    cluster = is_cluster(device)
    capacity = DeviceCapacity(device, ctx.constraints) if cluster else None
    for name in names:
        if name in settled:
            continue
        fname = file_name(name)
        had = fname in ids
        if name in frozen:
            if had:
                out.keep(fname, current)
            if name in previous:
                out.placements.append(previous[name])
            continue
        entry = usable.get(name)
        if entry is None:
            if had:
                out.changes.append(Change(fname, name, "remove", ("intent deleted",)))
            continue
        intent, app = entry
        if reuse and name in ctx.placed_as_before and _place_as_before(
                ctx, out, intent, app, device, current, previous, caps_changed,
                recheck_waiting=recheck_waiting):
            continue
        members = targeted.get(name)
        if members is None:
            members = ctx.targeted_by(name)
        if device.id not in members:
            if had:
                out.changes.append(Change(fname, name, "remove",
                                          ("device no longer targeted by the intent",)))
            continue
        own = capacity.own_view(name) if capacity is not None and had else None
        placement = place(intent, app, device, ctx.constraints, targeted=True, view=own)
        if placement.eligible:
            if not had and not intent.overcommit:
                new.append((intent, app, placement))
                continue
            _place_eligible(ctx, out, intent, app, placement, device, current, previous,
                            caps_changed)
        else:
            _place_ineligible(ctx, out, intent, app, device, current, previous.get(name),
                              view=own)
    made = [capacity] if capacity is not None else []

    def accounting() -> DeviceCapacity:  # made only when something needs it
        if not made:
            made.append(DeviceCapacity(device, ctx.constraints))
        return made[0]

    upgrades = take_back_upgrades(ctx, out, current, accounting) if out.changes else []
    if new or upgrades:
        decide_in_order(ctx, out, accounting(), current, new, upgrades, lambda i, a, p: (
            _place_eligible(ctx, out, i, a, p, device, current, previous, caps_changed)))
    return out


def _shares_may_change(ctx: _Context, previous: dict[str, PlacementRecord],
                       deleted: list[str]) -> bool:
    """Whether what a device's placements take may differ from last time although its
    capabilities did not change: an intent it held was deleted, or changed otherwise than
    by what places every device as before (its parameters, say). If not, a placement that
    waited for capacity still waits, and is not evaluated again."""
    if deleted:
        return True
    changed, as_before = ctx.changed, ctx.placed_as_before
    return any(record.deployed and name in changed and name not in as_before
               for name, record in previous.items())


def _place_as_before(ctx: _Context, out: _DeviceOutcome, intent: Intent, app: AppVersion,
                     device: Device, current: StoredTree, previous: dict[str, PlacementRecord],
                     caps_changed: bool, *, recheck_waiting: bool) -> bool:
    """Place `device` for an intent of `ctx.placed_as_before` as its record says, without
    evaluating targets and constraints again; False (evaluate them) when the record cannot
    say: a grace period (time is an input), a profile it does not name, or a tree that
    disagrees with it."""
    record = previous.get(intent.name)
    had = file_name(intent.name) in current.ids
    if record is None:  # not targeted last time
        return not had
    if record.ineligible_since is not None or (record.waiting and recheck_waiting):
        return False
    if not record.eligible:
        if had:
            return False
        out.placements.append(record)
        return True
    profile = ctx.profile(app, record.profile)
    if profile is None or not had:  # (a new placement is decided with the others)
        return False
    _place_eligible(ctx, out, intent, app, Placement(True, profile), device, current,
                    previous, caps_changed)
    return True


def _place_eligible(ctx: _Context, out: _DeviceOutcome, intent: Intent, app: AppVersion,
                    placement: Placement, device: Device, current: StoredTree,
                    previous: dict[str, PlacementRecord], caps_changed: bool) -> None:
    fname = file_name(intent.name)
    old = None
    if fname in current.ids and ctx.has_immutable_settings(app):
        old = _parse_previous(current.read(fname))
    assert placement.profile is not None
    try:
        rendered = render(intent, app, placement.profile, device, previous=old,
                          cache=ctx.renders)
    except RenderError as exc:
        _keep_after_error(out, intent, current, previous, exc)
        return
    out.placements.append(PlacementRecord(device.id, intent.name, True, True, None,
                                          placement.profile.id))
    oid = blob_id(rendered.data)
    stored = current.ids.get(fname)
    gate = ctx.rollouts.get(intent.name)
    if gate is not None and stored is not None and _gated(ctx, out, intent, device, gate,
                                                          current, stored, oid):
        return
    if stored == oid:
        out.keep(fname, current)  # the same bytes: nothing to send again
        return
    out.add(fname, rendered.data, oid)
    if stored is None:
        out.changes.append(Change(fname, intent.name, "add",
                                  (_add_reason(ctx, intent.name, previous.get(intent.name)),)))
    else:
        out.changes.append(Change(fname, intent.name,
                                  classify(current.read(fname), rendered.data,
                                            ctx.classified),
                                  _change_reasons(ctx, intent.name, caps_changed)))


def _keep_after_error(out: _DeviceOutcome, intent: Intent, current: StoredTree,
                      previous: dict[str, PlacementRecord], error: RenderError) -> None:
    """One intent's error is that intent's alone: it keeps the file it has on the device
    (or gets none), which still takes its share, and its problems are reported."""
    fname = file_name(intent.name)
    out.problems.extend(error.problems)
    if fname in current.ids:
        out.keep(fname, current)
        out.stale.add(intent.name)
    if intent.name in previous:
        out.placements.append(previous[intent.name])
    out.notes.append(f"{intent.name}: {'keeps its file' if fname in current.ids else 'not placed'}"
                     ": it cannot be rendered for this device (see the errors)")


def _gated(ctx: _Context, out: _DeviceOutcome, intent: Intent, device: Device,
           gate: tuple[RolloutPlan, dict[str, int]], current: StoredTree, stored: str,
           oid: str) -> bool:
    """A rollout decides this device's file (True: done here): rolled back, it gets its
    file from before the rollout; in a wave not open yet, it keeps the one it has; in an
    open wave, it moves on (False), and the file it had is remembered as its base."""
    plan, waves = gate
    fname = file_name(intent.name)
    if plan.rolled_back:
        base = plan.base.get(device.id)
        if base is not None and base != stored:
            out.kept[fname] = out.ids[fname] = base
            out.stale.add(intent.name)
            out.changes.append(Change(fname, intent.name, "rollback", (
                f"rollout of revision {plan.revision[:12]} rolled back: {plan.reason}",)))
            return True
        if stored != oid:  # never moved: it keeps the revision it has
            out.keep(fname, current)
            out.stale.add(intent.name)
            return True
        return False
    if stored == oid:
        return False
    wave = waves.get(device.id)
    if not plan.is_open(wave, device.id):
        out.keep(fname, current)
        out.stale.add(intent.name)
        assert intent.rollout is not None
        where = ("in no wave" if wave is None else
                 f"in wave {intent.rollout.waves[wave].name}")
        out.notes.append(f"{intent.name}: held by its rollout ({where}; wave "
                         f"{intent.rollout.waves[plan.open_wave].name} is open)")
        return True
    out.moves.append((intent.name, stored))
    return False


def _place_ineligible(ctx: _Context, out: _DeviceOutcome, intent: Intent, app: AppVersion,
                      device: Device, current: StoredTree,
                      previous: PlacementRecord | None, *,
                      view: Mapping[str, Any] | None = None) -> None:
    fname = file_name(intent.name)
    since = previous.ineligible_since if previous and previous.ineligible_since else ctx.now
    explained = place(intent, app, device, ctx.constraints, explain=True, view=view)
    why = "; ".join(explained.failure_messages()[:3]) or "no profile fits"
    if fname in current.ids and intent.grace_seconds and ctx.now - since < intent.grace_seconds:
        left = int(intent.grace_seconds - (ctx.now - since))
        out.keep(fname, current)
        # The profile it runs with stays recorded: it still takes its share of the device.
        out.placements.append(PlacementRecord(device.id, intent.name, False, True, since,
                                              previous.profile if previous else None))
        out.notes.append(f"{intent.name}: not eligible ({why}); kept for the grace period, "
                         f"{left}s left")
        until = since + intent.grace_seconds
        out.grace_until = until if out.grace_until is None else min(out.grace_until, until)
        return
    out.placements.append(PlacementRecord(device.id, intent.name, False, False, None))
    if fname in current.ids:
        reason = f"device no longer eligible: {why}"
        if intent.grace_seconds:
            reason += f" (grace period of {intent.grace_seconds}s expired)"
        out.changes.append(Change(fname, intent.name, "remove", (reason,)))


def _inputs_digest(ctx: _Context, device: Device, placements: Iterable[PlacementRecord]) -> str:
    lines = ctx.digest_lines
    parts = [f"compiler {COMPILER_VERSION}\ncaps {device.digest}\n".encode()]
    for name in sorted(record.intent for record in placements):
        line = lines.get(name)
        if line is None and name in ctx.intents.usable:
            record = ctx.intents.record(name)
            line = lines[name] = f"{name} {record.digest} {record.app_digest}\n".encode()
        if line is not None:
            parts.append(line)
    return "sha256:" + hashlib.sha256(b"".join(parts)).hexdigest()


def _needs_compile(device: Device, record: DeviceRecord | None,
                   affected: Callable[[], set[str]]) -> bool:
    """Whether anything that decides this device's tree may have changed."""
    if record is None or record.caps_digest != device.digest:
        return True
    return device.id in affected()


def _affected_devices(ctx: _Context, in_grace: set[str], placed_by_changed: set[str],
                      ) -> set[str]:
    """Devices an unchanged capability document does not exempt from compiling: a grace
    period may have run out, a changed intent placed them before or targets them now.
    One set for the fleet, so each device costs one lookup instead of one per intent."""
    affected = in_grace | placed_by_changed
    for name in ctx.changed:
        if name in ctx.intents.usable and name not in ctx.placed_as_before:
            affected |= ctx.targeted_by(name)  # (else: the devices it placed before)
    return affected


@dataclass(frozen=True, slots=True)
class _Job:
    """What a device's compile needs from the state, read up front. Its branch is read by
    whoever compiles it (a worker process, in parallel), unless it is known to have none."""

    device: Device
    record: DeviceRecord | None
    previous: dict[str, PlacementRecord]
    may_have_branch: bool
    #: The commit the state says the branch was left at, and its files (name -> blob id).
    known: tuple[str, dict[str, str]] | None = None
    #: The branch is gone (its ref lost) and the state says it was left at this commit: the
    #: device is compiled as a new one and its new commit continues from that one.
    lost_tip: str | None = None

    @property
    def likely_reuse(self) -> bool:
        """Whether the compile will probably re-evaluate only changed intents (see `_work`:
        it also needs the branch where the state left it), for sizing the work up front."""
        return self.record is not None and self.record.caps_digest == self.device.digest


@dataclass(frozen=True, slots=True)
class _Work:
    outcome: _DeviceOutcome
    message: str | None  # None: the tree did not change
    tree: str | None  # id of the outcome's tree (None after problems)
    stored_files: int  # files on the branch before (what an erring device keeps)
    tip: str | None  # the branch tip the outcome was computed from (None: no branch)
    #: The commit changes the tip's tree (`DeviceCommit.on_parent`): `outcome.files` and
    #: `outcome.kept` hold only what differs from it, and `removed` what it loses.
    on_parent: bool = False
    removed: tuple[str, ...] = ()
    ids: dict[str, str] | None = None  # the new tree's files (None after problems)
    #: The branch is gone and `tip` is the commit it was at (`DeviceCommit.branch_lost`).
    branch_lost: bool = False


def _known_tree(ctx: _Context, job: _Job) -> StoredTree | None:
    """The device's tree as the state recorded it, when its branch is still at the recorded
    commit: one ref read instead of reading the commit and the tree back (most of what a
    device recompiled for one intent cost). None (read the branch) otherwise, or if the
    record is not self-consistent."""
    known, record = job.known, job.record
    if known is None or record is None:
        return None
    tip, ids = known
    if ctx.store.branch_target(job.device.id) != tip or tree_id_of(ids) != record.tree:
        return None
    return StoredTree(ctx.store, record.tree, ids, commit=tip)


def _work(ctx: _Context, job: _Job) -> _Work:
    """Compile one device (`_compile_one`); whatever it raises is that device's error.

    Why: the compile is one for the whole fleet, so one device's document or branch that
    trips something unforeseen must not stop the commits of every other device. The device
    keeps its branch as it is (like a device whose rendering fails) and the error names it.
    """
    try:
        return _compile_one(ctx, job)
    except Exception as exc:  # contained and reported, never swallowed
        problem = Problem((), f"device {short_repr(job.device.id)} could not be compiled "
                          f"and keeps its desired state: {type(exc).__name__}: "
                          f"{str(exc)[:300]}", file=job.device.file)
        outcome = _DeviceOutcome({}, [], [], [problem], [])
        return _Work(outcome, None, None, job.record.deployments if job.record else 0, None)


def _compile_one(ctx: _Context, job: _Job) -> _Work:
    """Compile one device: pure but for reading its branch, so it can run in a worker
    process. Only the intents that changed are evaluated again when the device's
    capabilities and its branch are as the state last recorded them."""
    device, record = job.device, job.record
    stored = _known_tree(ctx, job)
    if stored is None and job.may_have_branch:
        stored = ctx.store.tree(device.id)
    lost = stored is None and job.lost_tip is not None
    if lost:  # continue the lost branch's history if its last commit is still stored
        assert job.lost_tip is not None
        stored = ctx.store.commit_tree(job.lost_tip)
        lost = stored is not None
    current = _NO_TREE if stored is None else stored
    tip = None if stored is None else stored.commit
    reuse = (record is not None and stored is not None
             and record.caps_digest == device.digest and record.tree == stored.tree)
    caps_changed = record is not None and record.caps_digest != device.digest
    outcome = _compile_device(ctx, device, current, job.previous, caps_changed, reuse=reuse)
    if stored is not None and not stored.foreign and stored.ids == outcome.ids and not lost:
        return _Work(outcome, None, stored.tree, len(current.ids), tip, ids=outcome.ids)
    trailers = {"Fleet-Source": ctx.source.revision, "Capabilities-Digest": device.digest,
                "Inputs-Digest": _inputs_digest(ctx, device, outcome.placements)}
    message = commit_message(device.id, outcome.changes, trailers)
    if lost:
        message = (f"Restore the lost branch of {device.id}\n\nIts ref was missing from the "
                   "repository; this commit continues from the commit the compiler last "
                   "left it at.\n\n" + message)
    tree = tree_id_of(outcome.ids)
    if stored is None or stored.foreign:
        return _Work(outcome, message, tree, len(current.ids), tip, ids=outcome.ids,
                     branch_lost=lost)
    # Only the difference from the tip travels on (to the parent process and to Git).
    before, after = stored.ids, outcome.ids
    outcome.kept = {n: oid for n, oid in outcome.kept.items() if before.get(n) != oid}
    removed = tuple(n for n in before if n not in after)
    return _Work(outcome, message, tree, len(current.ids), tip, True, removed, after, lost)


#: Above this many devices unknown to the state, list all branches once rather than looking
#: each device's branch up (a lookup that finds nothing costs about as much as a listed ref).
_LIST_BRANCHES_ABOVE = 1_000
_CHANGE_FIELDS = tuple(f.name for f in dataclasses.fields(Change))


def _pack(work: _Work) -> tuple[Any, ...]:
    """A `_Work` as plain tuples: it crosses from a worker process in a pickle, and
    pickling ~10 objects per device costs more than rendering some of them."""
    o = work.outcome
    return (o.files, o.kept if work.message is not None else {},
            [tuple(p) for p in o.placements],
            [tuple(getattr(c, n) for n in _CHANGE_FIELDS) for c in o.changes],
            o.problems, o.notes, o.grace_until, work.message, work.tree, work.stored_files,
            work.tip, work.on_parent, work.removed, work.ids, o.moves, work.branch_lost)


def _unpack(packed: tuple[Any, ...]) -> _Work:
    """What the parent process needs of the `_Work` that `_pack` was given (the outcome's
    own `ids` stay behind: `ids` of the work is the same dict)."""
    (files, kept, placements, changes, problems, notes, grace_until, message, tree,
     stored_files, tip, on_parent, removed, ids, moves, branch_lost) = packed
    outcome = _DeviceOutcome(files, list(map(PlacementRecord._make, placements)),
                             [Change(*c) for c in changes], problems, notes, grace_until,
                             kept, moves=moves)
    return _Work(outcome, message, tree, stored_files, tip, on_parent, removed, ids,
                 branch_lost)


def _precompute_targets(ctx: _Context, names: list[str], *, split: bool) -> None:
    """Fill `ctx.targeted` for `names`; with `split` (inside `forked_state`), a forked
    process works out every other intent meanwhile. The sets are the same either way."""
    todo = [n for n in names if n not in ctx.targeted]
    if not split or len(todo) < 2:
        for name in todo:
            ctx.targeted_by(name)
        return
    ctx.targeted.update(split_in_two(todo))


def _run_jobs(ctx: _Context, jobs: list[_Job], progress: Progress | None) -> Iterator[_Work]:
    """Compile the devices, in forked worker processes when there are many (`parallel`).

    A generator, in job order: each result is available as soon as it is computed, so the
    caller streams commits to Git while the rest of the fleet is still rendering. Close it
    to stop the workers early.
    """
    evaluated = sum(len(ctx.changed) if job.likely_reuse else len(ctx.intents.usable)
                    for job in jobs)
    workers = worker_count(evaluated, len(jobs))
    if workers <= 1:
        for job in (progress(jobs, len(jobs)) if progress else jobs):
            yield _work(ctx, job)
        return
    every = not all(job.likely_reuse for job in jobs)
    with forked_state(work=lambda i: _work(ctx, jobs[i]), pack=_pack,
                      keyed=lambda names: {n: ctx.targeted_by(n) for n in names}):
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


@dataclass
class _Outcomes:
    """What a compile records in the state, gathered while its commits stream to Git."""

    devices: dict[str, DeviceRecord] = field(default_factory=dict)
    placements: list[PlacementRecord] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    #: Devices committed with no parent (a branch of their own from nothing).
    restarted: list[str] = field(default_factory=list)
    #: The placements the state had for the devices of `devices` (`_Job.previous`).
    before: dict[str, dict[str, PlacementRecord]] = field(default_factory=dict)
    #: Device -> (its tip when unchanged, else None until Git says; its files).
    trees: dict[str, tuple[str | None, dict[str, str]]] = field(default_factory=dict)

    def trees_at(self, tips: Mapping[str, str] | None) -> dict[str, tuple[str, dict[str, str]]]:
        """`trees` with the new tips of the committed devices filled in."""
        tips = tips or {}
        out = {}
        for device_id, (tip, files) in self.trees.items():
            tip = tip or tips.get(device_id)
            if tip is not None:
                out[device_id] = (tip, files)
        return out


def _commits(jobs: list[_Job], works: Iterable[_Work], report: CompileReport,
             outcomes: _Outcomes, now: float) -> Iterator[DeviceCommit]:
    """The commits of the compiled devices, in device order, accounting every device in
    `report` and `outcomes` as its result arrives (consume it fully before reading them)."""
    for job, work in zip(jobs, works, strict=True):
        device_id, outcome = job.device.id, work.outcome
        result = DeviceResult(device_id, "unchanged", outcome.changes, outcome.problems,
                              notes=outcome.notes, grace_until=outcome.grace_until)
        report.results.append(result)
        report.errors.extend((device_id, p) for p in outcome.problems)
        if work.tree is None or work.ids is None:  # the device as a whole failed
            result.status, result.changes = "error", []
            report.deployments += work.stored_files
            outcomes.forget.append(device_id)
            continue
        if outcome.problems:  # compiled in full next time, so they are reported again
            outcomes.forget.append(device_id)
        report.deployments += len(work.ids)
        for name, base in outcome.moves:
            report.rollout_moves.setdefault(name, {})[device_id] = base
        outcomes.devices[device_id] = DeviceRecord(device_id, job.device.digest, now,
                                                   work.tree, len(work.ids))
        outcomes.placements.extend(outcome.placements)
        outcomes.before[device_id] = job.previous
        outcomes.trees[device_id] = (work.tip if work.message is None else None, work.ids)
        if work.message is None:
            report.unchanged += 1
            continue
        result.status = "committed"
        report.commits += 1
        if work.tip is None:
            outcomes.restarted.append(device_id)
        yield DeviceCommit(device_id, outcome.files, work.message, int(now), outcome.kept,
                           parent=work.tip, parent_known=True, on_parent=work.on_parent,
                           removed=work.removed, branch_lost=work.branch_lost)


@collection_paused()
def compile_fleet(source: FleetSource, snapshot: Snapshot, store: DeviceStore,
                  state: CompilerState, *, now: float | None = None, dry_run: bool = False,
                  progress: Progress | None = None,
                  on_dry_commit: Callable[[DeviceCommit], None] | None = None,
                  rollouts: Mapping[str, RolloutPlan] | None = None) -> CompileReport:
    """Compile every device of the snapshot; commit (unless `dry_run`) and report.
    `on_dry_commit` sees each commit a dry run would have made (`margo plan --diff`).
    `rollouts`: the fleet server's plan for each intent under a staged rollout.

    Commits stream to Git while later devices still render (see `DeviceStore.write`). The
    state is written while Git moves the branches but committed only once they have moved,
    so it never claims a tree that a failed write did not commit.
    """
    now = time.time() if now is None else now
    intents = resolve_intents(source)
    previous_intents = state.intents()
    current_records = {name: intents.record(name) for name in intents.usable}
    changed = {n for n, r in current_records.items() if previous_intents.get(n) != r}
    changed |= {n for n in previous_intents if n not in current_records
                and n not in intents.frozen}
    gated = _gated_intents(intents, rollouts or {})
    changed |= set(gated)  # evaluated again on every device while the rollout moves
    ctx = _Context(source, intents, previous_intents, changed, ProfileConstraints(), now,
                   TargetIndex(snapshot.devices), store)
    report = CompileReport(source.revision, devices=len(snapshot.devices))
    for name, plan in gated.items():
        intent = intents.usable[name][0]
        assert intent.rollout is not None
        members = ctx.targeted_by(name)
        waves = assign_waves(name, intent.rollout, (
            (d, snapshot.devices[d].properties, snapshot.devices[d].labels)
            for d in members if d in snapshot.devices))
        ctx.rollouts[name] = (plan, waves)
        report.rollout_waves[name] = waves
    report.errors.extend((None, p) for p in [*source.problems, *intents.problems,
                                            *snapshot.problems])
    state.bind(store.identity, compiler_version=COMPILER_VERSION)
    jobs = _jobs(ctx, snapshot, store, state, report)
    outcomes = _Outcomes()
    commits = _commits(jobs, _run_jobs(ctx, jobs, progress), report, outcomes, now)
    staged: list[StagedSave] = []

    def stage(tips: Mapping[str, str] | None = None) -> None:  # every commit is made by now
        staged.append(state.stage(
            intents=[*(dataclasses.replace(r, digest=_GATED) if r.name in gated else r
                       for r in current_records.values()),
                     *_frozen_records(previous_intents, intents.frozen)],
            forget_intents=[n for n in previous_intents if n not in current_records
                            and n not in intents.frozen],
            devices=outcomes.devices.values(), placements=outcomes.placements,
            forget_devices=outcomes.forget, snapshot=snapshot.memo,
            restarted=outcomes.restarted,
            trees=outcomes.trees_at(tips), placements_before=outcomes.before))

    try:
        if dry_run:
            for commit in commits:
                if on_dry_commit is not None:
                    on_dry_commit(commit)
            return report
        first = next(commits, None)
        if first is None:  # nothing to write, no lock needed
            tips: dict[str, str] = {}
            stage()
            staged[0].commit()
        else:  # locked from the first commit until the state says what was written
            with store.lock():
                tips = store.write(itertools.chain([first], commits), while_moving=stage)
                if not staged:  # (write calls it whenever it writes anything)
                    stage()
                staged[0].commit()
    except BaseException:
        for save in staged:
            if save.pending:
                save.rollback()
        raise
    finally:
        commits.close()  # stops worker processes if the write failed half-way
    for result in report.results:
        result.commit = tips.get(result.device_id, result.commit)
    return report


def _gated_intents(intents: ResolvedIntents,
                   rollouts: Mapping[str, RolloutPlan]) -> dict[str, RolloutPlan]:
    """The usable intents with a rollout spec whose plan is not complete."""
    return {name: plan for name, plan in sorted(rollouts.items())
            if plan.status != "complete" and name in intents.usable
            and intents.usable[name][0].rollout is not None}


#: What the digest of an intent's record is while a rollout holds some of its devices back:
#: the compile after the rollout ends must see it as changed and move every device on.
_GATED = "rollout"
#: What the digests of a frozen intent's record are replaced with (no intent has them).
_FROZEN = "frozen"


def _frozen_records(previous: dict[str, IntentRecord], frozen: set[str]) -> list[IntentRecord]:
    """The records of frozen intents, marked so that the intent counts as changed, with
    changed placement, once it is usable again.

    Why: while frozen, its devices keep their files and placement records whatever their
    capabilities do, so those records say nothing about the devices any more; its first
    usable compile must evaluate every device again, not keep or reuse them."""
    return [dataclasses.replace(previous[name], digest=_FROZEN, placement_digest=_FROZEN)
            for name in sorted(frozen) if name in previous]


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


def _jobs(ctx: _Context, snapshot: Snapshot, store: DeviceStore, state: CompilerState,
          report: CompileReport) -> list[_Job]:
    """The devices that must be compiled, with what they need read up front; the others
    are accounted in `report` as unchanged."""
    previous_devices = state.devices()
    in_grace = state.devices_in_grace()
    placed_by_changed = state.devices_placed_by(ctx.changed)
    affected: set[str] | None = None

    def affected_devices() -> set[str]:  # only worked out if some device may be skipped
        nonlocal affected
        if affected is None:
            affected = _affected_devices(ctx, in_grace, placed_by_changed)
        return affected

    # A device the state recorded whose branch is gone (its ref lost, e.g. `packed-refs`
    # deleted) is compiled as a new one: its branch is rebuilt from the source instead of
    # staying missing because nothing it depends on changed.
    refs = store.branch_names() if previous_devices else frozenset()
    lost: list[str] = []
    todo: list[tuple[Device, DeviceRecord | None]] = []
    for device_id in sorted(snapshot.devices):
        device = snapshot.devices[device_id]
        if _unusable_id(device, report):
            continue
        record = previous_devices.get(device_id)
        if record is not None and device_ref(device_id) not in refs:
            lost.append(device_id)
            record = None
        if _needs_compile(device, record, affected_devices):
            todo.append((device, record))
        else:
            report.unchanged += 1
            report.deployments += record.deployments if record else 0
    placements = state.placements_of(device.id for device, _ in todo)
    trees = state.trees_of(device.id for device, record in todo
                           if record is not None and record.caps_digest == device.digest)
    # Devices the state does not know may still have branches (e.g. the state was lost):
    # one listing answers for all of them when there are many (a first compile).
    unknown = sum(record is None for _, record in todo)
    branches = set(store.device_ids()) if unknown > _LIST_BRANCHES_ABOVE else None
    # A device deleted on purpose starts from nothing, whatever a compile that raced the
    # deletion wrote back: its old commits are never continued (`CompilerState.forget`).
    forgotten = state.forgotten()
    lost_tips = {device_id: tip for device_id, (tip, _) in state.trees_of(lost).items()
                 if device_id not in forgotten}
    return [_Job(device, record, placements[device.id],
                 branches is None or device.id in branches, trees.get(device.id),
                 lost_tips.get(device.id))
            for device, record in todo]
