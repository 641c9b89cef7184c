"""Compile one device: its branch as the compile finds it → its new tree, its records, and
the commit that writes it (or none when nothing changed).

The walk, in the order the code reads:

1. `read_branch`: the device's tree as the state recorded it, if its branch is still there,
   else read from the branch (or from the commit a lost branch was left at);
2. `compile_device`, a pure function of the compile's context, the job and that tree:
   `decide_tree` settles what did not change (`keep_steady`), decides each other intent
   once (`decide_intent`), then runs the capacity round (`compiler.holding`) for what
   needs room; `_commit_for` turns the outcome into a commit message and what the commit
   sends;
3. `compile_job` does both and contains whatever the device trips into its own error.

Runs in this process or in a forked worker (`compiler.workers`): nothing here writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from compiler.context import COMPILER_VERSION, CompileContext
from compiler.decisions import (
    DeviceRound,
    keep_steady,
    place_as_before,
    place_eligible,
    place_ineligible,
    shares_may_change,
)
from compiler.gitformat import flat_tree_of, packed_commit
from compiler.gitstore import DeviceCommit, DeviceStore, PackedCommit, StoredTree, tree_id_of
from compiler.holding import decide_in_order, take_back_upgrades
from compiler.intents import Intent
from compiler.messages import Change, commit_message
from compiler.outcome import NO_TREE, DeviceOutcome
from compiler.placement import Placement, place
from compiler.render import file_name
from compiler.snapshot import Device
from compiler.source import AppVersion
from compiler.state import DeviceRecord, PlacementRecord, files_json
from margo.errors import Problem, short_repr

__all__ = ["Branch", "DeviceJob", "DeviceWork", "compile_device", "compile_job",
           "placement_changes", "read_branch"]

_SUFFIX = ".yaml"
#: A new placement, decided in the capacity round once every file the tree keeps is known.
NewPlacement = tuple[Intent, AppVersion, Placement]


@dataclass(frozen=True, slots=True)
class DeviceJob:
    """What a device's compile needs from the state. The planning gives the device, its
    record and what it knows of its branch; the rows the state holds of it (`previous`,
    `known`) are read by whoever compiles it (`compiler.workers`: a worker process reads
    those of the devices it compiles), and its branch too, unless it is known to have none."""

    device: Device
    record: DeviceRecord | None
    may_have_branch: bool
    #: The branch is gone (its ref lost) and the state says it was left at this commit: the
    #: device is compiled as a new one and its new commit continues from that one.
    lost_tip: str | None = None
    previous: dict[str, PlacementRecord] = dataclasses.field(default_factory=dict)
    #: The commit the state says the branch was left at, and its files (name -> blob id)
    #: as the JSON text the state stores (`CompilerState.tree_texts_of`): decoded by the
    #: device's own compile, in whichever process runs it.
    known: tuple[str, str] | None = None

    @property
    def likely_reuse(self) -> bool:
        """Whether the compile will probably re-evaluate only changed intents (see
        `compile_device`: it also needs the branch where the state left it), for sizing
        the work up front."""
        return self.record is not None and self.record.caps_digest == self.device.digest


@dataclass(frozen=True, slots=True)
class DeviceWork:
    """A device's compile as the write needs it."""

    outcome: DeviceOutcome
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
    #: What the state must change of the device's placement rows (`placement_changes`):
    #: the rows of `outcome.placements` it does not hold as they are, and the intents of
    #: rows it holds that the outcome has none of.
    placements_written: tuple[PlacementRecord, ...] = ()
    placements_dropped: tuple[str, ...] = ()
    #: `ids` as the state records them (`compiler.state.files_json`) and their number, in
    #: place of `ids` in a result a worker process sent (`compiler.workers`). Why: the
    #: parent only records them, and holds every result until the branches move; the
    #: dict of names and blob ids is about three times its text (0.6 GB of the peak at a
    #: million devices).
    ids_json: str | None = None
    ids_count: int = 0
    #: The commit's objects made and deflated here (`CompileContext.pack_commits`): what
    #: crosses to the writer instead of `outcome.files`.
    packed: PackedCommit | None = None

    @property
    def failed(self) -> bool:
        """The device as a whole failed (it keeps its branch as it is)."""
        return self.tree is None

    @property
    def file_count(self) -> int:
        """How many files the new tree has."""
        return len(self.ids) if self.ids is not None else self.ids_count

    def files_json(self) -> str:
        """The new tree's files as the state records them."""
        if self.ids_json is not None:
            return self.ids_json
        assert self.ids is not None
        return files_json(self.ids)


@dataclass(frozen=True, slots=True)
class Branch:
    """A device's branch as its compile starts from it."""

    tree: StoredTree | None  # None: the device has no branch (yet)
    #: The branch's ref is gone and `tree` is the commit the state says it was left at.
    lost: bool = False


def compile_job(ctx: CompileContext, store: DeviceStore, job: DeviceJob) -> DeviceWork:
    """Compile one device (`read_branch`, `compile_device`); whatever it raises is that
    device's error.

    Why: the compile is one for the whole fleet, so one device's document or branch that
    trips something unforeseen must not stop the commits of every other device. The device
    keeps its branch as it is (like a device whose rendering fails) and the error names it.
    """
    try:
        work = compile_device(ctx, job, read_branch(store, job))
    except Exception as exc:  # contained and reported, never swallowed
        problem = Problem((), f"device {short_repr(job.device.id)} could not be compiled "
                          f"and keeps its desired state: {type(exc).__name__}: "
                          f"{str(exc)[:300]}", file=job.device.file)
        outcome = DeviceOutcome({}, [], [], [problem], [])
        return DeviceWork(outcome, None, None,
                          job.record.deployments if job.record else 0, None)
    written, dropped = placement_changes(job.previous, work.outcome.placements)
    if not written and not dropped:
        return work
    return dataclasses.replace(work, placements_written=written, placements_dropped=dropped)


def placement_changes(previous: Mapping[str, PlacementRecord],
                      placements: list[PlacementRecord],
                      ) -> tuple[tuple[PlacementRecord, ...], tuple[str, ...]]:
    """The rows of `placements` that `previous` (what the state holds of the device) does
    not hold as they are, and the intents of `previous` that `placements` has no row for.

    Why here: a recompile for one intent keeps almost every placement, and working this
    out where the device compiles (a worker, in parallel) means only the few changed rows
    cross back to the main process and the state's save does not walk every row again
    (`CompilerState.stage`, `dropped_placements`)."""
    written = tuple(p for p in placements if previous.get(p.intent) != p)
    present = {p.intent for p in placements}
    return written, tuple(name for name in previous if name not in present)


def read_branch(store: DeviceStore, job: DeviceJob) -> Branch:
    """The device's tree to compile from: as the state recorded it when the branch is still
    at the recorded commit (one ref read), else read from its branch; for a branch whose
    ref was lost, the commit it was left at, if still stored."""
    stored = _known_tree(store, job)
    if stored is None and job.may_have_branch:
        stored = store.tree(job.device.id)
    if stored is None and job.lost_tip is not None:  # continue the lost branch's history
        stored = store.commit_tree(job.lost_tip)
        return Branch(stored, lost=stored is not None)
    return Branch(stored)


def _known_tree(store: DeviceStore, job: DeviceJob) -> StoredTree | None:
    """The device's tree as the state recorded it, when its branch is still at the recorded
    commit: one ref read instead of reading the commit and the tree back (most of what a
    device recompiled for one intent cost). None (read the branch) otherwise, or if the
    record is not self-consistent."""
    known, record = job.known, job.record
    if known is None or record is None:
        return None
    tip, files = known
    if store.branch_target(job.device.id) != tip:
        return None
    try:
        ids = json.loads(files)
    except ValueError:  # a damaged row: the branch says what the tree is
        return None
    if not isinstance(ids, dict) or tree_id_of(ids) != record.tree:
        return None
    return StoredTree(store, record.tree, ids, commit=tip)


def compile_device(ctx: CompileContext, job: DeviceJob, branch: Branch) -> DeviceWork:
    """Compile one device from its branch: pure but for reading the branch's files, so it
    can run in a worker process. Only the intents that changed are evaluated again when
    the device's capabilities and its branch are as the state last recorded them."""
    device, record, stored = job.device, job.record, branch.tree
    current = NO_TREE if stored is None else stored
    reuse = (record is not None and stored is not None
             and record.caps_digest == device.digest and record.tree == stored.tree)
    caps_changed = record is not None and record.caps_digest != device.digest
    outcome = decide_tree(ctx, device, current, job.previous, caps_changed, reuse=reuse)
    if (stored is not None and not stored.foreign and stored.ids == outcome.ids
            and not branch.lost):
        return DeviceWork(outcome, None, stored.tree, len(current.ids), stored.commit,
                          ids=outcome.ids)
    return _commit_for(ctx, device, outcome, branch)


def decide_tree(ctx: CompileContext, device: Device, current: StoredTree,
                previous: dict[str, PlacementRecord], caps_changed: bool, *,
                reuse: bool = False) -> DeviceOutcome:
    """The device's new tree. With `reuse` (its capabilities and last compile are known to
    be unchanged), only the intents that changed are evaluated again."""
    deleted = [f[: -len(_SUFFIX)] for f in current.ids
               if f.endswith(_SUFFIX) and f[: -len(_SUFFIX)] not in ctx.known]
    names = sorted(ctx.known.union(deleted)) if deleted else ctx.names
    recheck_waiting = not reuse or shares_may_change(ctx, previous, deleted)
    dev = DeviceRound(ctx, device, current, previous, caps_changed, recheck_waiting)
    settled = keep_steady(dev) if reuse else set()
    # New placements wait until every placement the tree holds is known: they get what
    # those leave (capacity accounting, `compiler.capacity`).
    new: list[NewPlacement] = []
    for name in names:
        if name not in settled:
            decided = decide_intent(dev, name, reuse=reuse)
            if decided is not None:
                new.append(decided)
    _capacity_round(dev, new)
    return dev.out


def decide_intent(dev: DeviceRound, name: str, *, reuse: bool) -> NewPlacement | None:
    """Decide what the device's tree holds of intent `name`; a new placement that takes
    room on the device is returned instead, for the capacity round."""
    ctx, out, fname = dev.ctx, dev.out, file_name(name)
    had = fname in dev.current.ids
    if name in ctx.intents.frozen:  # its file and its record stay as they are
        if had:
            out.keep(fname, dev.current)
        if name in dev.previous:
            out.placements.append(dev.previous[name])
        return None
    entry = ctx.intents.usable.get(name)
    if entry is None:
        if had:
            out.changes.append(Change(fname, name, "remove", ("intent deleted",)))
        return None
    intent, app = entry
    if reuse and name in ctx.placed_as_before and place_as_before(dev, intent, app):
        return None
    if dev.device.id not in ctx.targeted_by(name):
        if had:
            out.changes.append(Change(fname, name, "remove",
                                      ("device no longer targeted by the intent",)))
        return None
    own = dev.own_view(name) if had else None
    placement = place(intent, app, dev.device, ctx.constraints, targeted=True, view=own)
    if not placement.eligible:
        place_ineligible(dev, intent, app, view=own)
    elif not had and not intent.overcommit:
        return intent, app, placement
    else:
        place_eligible(dev, intent, app, placement)
    return None


def _capacity_round(dev: DeviceRound, new: list[NewPlacement]) -> None:
    """Upgrades that raise what a placement takes, and new placements, each decided in
    what the device has left (`compiler.holding`)."""
    upgrades = take_back_upgrades(dev) if dev.out.changes else []
    if new or upgrades:
        decide_in_order(dev, new, upgrades)


def _commit_for(ctx: CompileContext, device: Device, outcome: DeviceOutcome,
                branch: Branch) -> DeviceWork:
    """The commit of a device whose tree changed (or that has no branch yet): its message,
    and, on a branch the compile read, only the difference from the tip."""
    stored, lost = branch.tree, branch.lost
    trailers = {"Fleet-Source": ctx.source.revision, "Capabilities-Digest": device.digest,
                "Inputs-Digest": _inputs_digest(ctx, device, outcome.placements)}
    message = commit_message(device.id, outcome.changes, trailers)
    if lost:
        message = (f"Restore the lost branch of {device.id}\n\nIts ref was missing from the "
                   "repository; this commit continues from the commit the compiler last "
                   "left it at.\n\n" + message)
    flat = flat_tree_of(outcome.ids)
    tree = flat[1].hex()
    tip = None if stored is None else stored.commit
    packed = (packed_commit(device.id, outcome.files, outcome.ids, tip, message, int(ctx.now),
                            DeviceStore.AUTHOR, tree=flat) if ctx.pack_commits else None)
    if stored is None or stored.foreign:
        return DeviceWork(outcome, message, tree, 0 if stored is None else len(stored.ids),
                          tip, ids=outcome.ids, branch_lost=lost, packed=packed)
    # Only the difference from the tip travels on (to the parent process and to Git).
    before, after = stored.ids, outcome.ids
    outcome.kept = {n: oid for n, oid in outcome.kept.items() if before.get(n) != oid}
    removed = tuple(n for n in before if n not in after)
    return DeviceWork(outcome, message, tree, len(before), tip, True, removed, after, lost,
                      packed=packed)


def work_commit(device_id: str, work: DeviceWork, now: float) -> DeviceCommit:
    """The commit of a device whose tree changed (`work.message` is set): its objects as
    the worker packed them when it did, else its files."""
    outcome = work.outcome
    assert work.message is not None
    return DeviceCommit(device_id, {} if work.packed else outcome.files, work.message,
                        int(now), outcome.kept, parent=work.tip, parent_known=True,
                        on_parent=work.on_parent, removed=work.removed,
                        branch_lost=work.branch_lost, packed=work.packed)


def _inputs_digest(ctx: CompileContext, device: Device,
                   placements: list[PlacementRecord]) -> str:
    """What the device's tree was compiled from (the `Inputs-Digest` trailer)."""
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
