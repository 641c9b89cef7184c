"""What one device's new tree holds of one intent: placed and rendered, kept as it is, held
back by a rollout, kept for a grace period, or removed, with the reasons people read.

Each decision works on a `DeviceRound`: the per-device half of a compile's context (the
per-compile half is `compiler.context.CompileContext`). `compiler.device_compile` walks a
device's intents and calls one decision for each; decisions that need room on the device
are left to the capacity round (`compiler.holding`), which places what fits with
`place_eligible`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from compiler.capacity import DeviceCapacity, is_cluster
from compiler.context import CompileContext
from compiler.gitstore import StoredTree, blob_id
from compiler.intents import Intent
from compiler.messages import Change
from compiler.outcome import DeviceOutcome
from compiler.placement import Placement, place
from compiler.render import RenderError, file_name, render
from compiler.rollout import RolloutPlan
from compiler.snapshot import Device
from compiler.source import AppVersion
from compiler.specdiff import classify
from compiler.state import PlacementRecord

__all__ = ["DeviceRound", "keep_steady", "place_as_before", "place_eligible",
           "place_ineligible", "shares_may_change"]

_FAST_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class DeviceRound:
    """One device's compile in progress: what its tree is decided from, and `out`, what is
    decided so far. Made afresh for every device; nothing in it outlives the device."""

    ctx: CompileContext
    device: Device
    current: StoredTree  # the branch's tree the device's compile starts from
    previous: dict[str, PlacementRecord]  # what the state recorded of its placements
    caps_changed: bool
    #: Placements that waited for capacity are decided again (what the device has left
    #: may have changed); else a waiting placement still waits (`shares_may_change`).
    recheck_waiting: bool
    out: DeviceOutcome = field(default_factory=lambda: DeviceOutcome({}, [], [], [], []))
    _capacity: DeviceCapacity | None = None

    def __post_init__(self) -> None:
        if is_cluster(self.device):  # its own pods are released from what it reports
            self._capacity = DeviceCapacity(self.device, self.ctx.constraints)

    def own_view(self, name: str) -> Mapping[str, Any] | None:
        """What a deployment of intent `name` the tree holds is matched against: a cluster's
        report without that deployment's own pods (None: the device's own view will do)."""
        return None if self._capacity is None else self._capacity.own_view(name)

    def capacity(self) -> DeviceCapacity:
        """The device's capacity accounting, made only when something needs it."""
        if self._capacity is None:
            self._capacity = DeviceCapacity(self.device, self.ctx.constraints)
        return self._capacity


def keep_steady(dev: DeviceRound) -> set[str]:
    """With unchanged capabilities, an unchanged intent decides exactly as last time: keep
    its file (or its absence) and its record instead of evaluating and rendering again.
    Returns the intents so settled. Placements in a grace period are always evaluated
    again, since time is an input; so are placements waiting for capacity when what the
    device has left may have changed (`recheck_waiting`), and a file the state has no
    record of.

    Walks the device's few records and files rather than every steady intent: most
    intents target a device neither before nor now, and those are settled as they are."""
    steady = dev.ctx.steady
    settled = set(steady)
    out, previous = dev.out, dev.previous
    ids, kept, new_ids, placements = dev.current.ids, out.kept, out.ids, out.placements
    for name, record in previous.items():
        fname = steady.get(name)
        if fname is None:
            continue
        if record.ineligible_since is not None or (record.waiting and dev.recheck_waiting):
            settled.discard(name)
            continue
        if fname in ids:
            kept[fname] = new_ids[fname] = ids[fname]
        placements.append(record)
    for fname in ids:
        steady_name = dev.ctx.steady_files.get(fname)
        if steady_name is not None and steady_name not in previous:
            settled.discard(steady_name)
    return settled


def shares_may_change(ctx: CompileContext, previous: dict[str, PlacementRecord],
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


def place_as_before(dev: DeviceRound, intent: Intent, app: AppVersion) -> bool:
    """Place the device for an intent of `placed_as_before` as its record says, without
    evaluating targets and constraints again; False (evaluate them) when the record cannot
    say: a grace period (time is an input), a profile it does not name, or a tree that
    disagrees with it."""
    record = dev.previous.get(intent.name)
    had = file_name(intent.name) in dev.current.ids
    if record is None:  # not targeted last time
        return not had
    if record.ineligible_since is not None or (record.waiting and dev.recheck_waiting):
        return False
    if not record.eligible:
        if had:
            return False
        dev.out.placements.append(record)
        return True
    profile = dev.ctx.profile(app, record.profile)
    if profile is None or not had:  # (a new placement is decided with the others)
        return False
    place_eligible(dev, intent, app, Placement(True, profile))
    return True


def place_eligible(dev: DeviceRound, intent: Intent, app: AppVersion,
                   placement: Placement) -> None:
    """Render the intent's file for the device with the placement's profile, and keep it,
    change it or add it (or leave it to its rollout)."""
    ctx, out, current, device = dev.ctx, dev.out, dev.current, dev.device
    fname = file_name(intent.name)
    old = None
    if fname in current.ids and ctx.needs_previous(intent, app):
        old = _parse_previous(current.read(fname))
    assert placement.profile is not None
    try:
        rendered = render(intent, app, placement.profile, device, previous=old,
                          cache=ctx.renders)
    except RenderError as exc:
        _keep_after_error(dev, intent, exc)
        return
    out.placements.append(PlacementRecord(device.id, intent.name, True, True, None,
                                          placement.profile.id))
    oid = blob_id(rendered.data)
    stored = current.ids.get(fname)
    gate = ctx.rollouts.get(intent.name)
    if gate is not None and stored is not None and _gated(dev, intent, gate, stored, oid):
        return
    if stored == oid:
        out.keep(fname, current)  # the same bytes: nothing to send again
        return
    out.add(fname, rendered.data, oid)
    if stored is None:
        out.changes.append(Change(fname, intent.name, "add",
                                  (_add_reason(dev, intent.name),)))
    else:
        out.changes.append(Change(fname, intent.name,
                                  classify(current.read(fname), rendered.data,
                                           ctx.classified),
                                  _change_reasons(dev, intent.name)))


def _parse_previous(data: bytes) -> dict[str, Any] | None:
    """A file this compiler wrote earlier, as data. Our canonical YAML reads the same in
    YAML 1.1 and 1.2 (a tested property), so libyaml's fast loader is safe here."""
    try:
        document = yaml.load(data, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return None
    return document if isinstance(document, dict) else None


def _change_reasons(dev: DeviceRound, name: str) -> tuple[str, ...]:
    previous = dev.ctx.previous_intents.get(name)
    current = dev.ctx.intents.record(name)
    reasons = []
    if previous is not None and previous.digest != current.digest:
        reasons.append("intent edited")
    if previous is not None and previous.app_version != current.app_version:
        reasons.append(f"application version {previous.app_version} -> {current.app_version}")
    elif previous is not None and previous.app_digest != current.app_digest:
        reasons.append("application description changed")
    if dev.caps_changed:
        reasons.append("capabilities changed")
    return tuple(reasons) or ("re-rendered",)


def _add_reason(dev: DeviceRound, name: str) -> str:
    previous = dev.previous.get(name)
    if previous is not None and not previous.eligible:
        return "device became eligible"
    if name not in dev.ctx.previous_intents:
        return "intent added"
    return "device now targeted"


def _keep_after_error(dev: DeviceRound, intent: Intent, error: RenderError) -> None:
    """One intent's error is that intent's alone: it keeps the file it has on the device
    (or gets none), which still takes its share, and its problems are reported."""
    out, current = dev.out, dev.current
    fname = file_name(intent.name)
    out.problems.extend(error.problems)
    if fname in current.ids:
        out.keep(fname, current)
        out.stale.add(intent.name)
    if intent.name in dev.previous:
        out.placements.append(dev.previous[intent.name])
    out.notes.append(f"{intent.name}: {'keeps its file' if fname in current.ids else 'not placed'}"
                     ": it cannot be rendered for this device (see the errors)")


def _gated(dev: DeviceRound, intent: Intent, gate: tuple[RolloutPlan, dict[str, int]],
           stored: str, oid: str) -> bool:
    """A rollout decides this device's file (True: done here): rolled back, it gets its
    file from before the rollout; in a wave not open yet, it keeps the one it has; in an
    open wave, it moves on (False), and the file it had is remembered as its base."""
    plan, waves = gate
    if plan.rolled_back:
        return _rolled_back(dev, intent, plan, stored, oid)
    if stored == oid:
        return False
    device_id, out = dev.device.id, dev.out
    wave = waves.get(device_id)
    if not plan.is_open(wave, device_id):
        out.keep(file_name(intent.name), dev.current)
        out.stale.add(intent.name)
        assert intent.rollout is not None
        where = ("in no wave" if wave is None else
                 f"in wave {intent.rollout.waves[wave].name}")
        out.notes.append(f"{intent.name}: held by its rollout ({where}; wave "
                         f"{intent.rollout.waves[plan.open_wave].name} is open)")
        return True
    out.moves.append((intent.name, stored))
    return False


def _rolled_back(dev: DeviceRound, intent: Intent, plan: RolloutPlan, stored: str,
                 oid: str) -> bool:
    """A rolled-back rollout: the device gets its file from before it (True), keeps the
    revision it has if it never moved (True), or takes the file rendered now (False)."""
    out, fname = dev.out, file_name(intent.name)
    base = plan.base.get(dev.device.id)
    if base is not None and base != stored:
        out.kept[fname] = out.ids[fname] = base
        out.stale.add(intent.name)
        out.changes.append(Change(fname, intent.name, "rollback", (
            f"rollout of revision {plan.revision[:12]} rolled back: {plan.reason}",)))
        return True
    if stored != oid:  # never moved: it keeps the revision it has
        out.keep(fname, dev.current)
        out.stale.add(intent.name)
        return True
    return False


def place_ineligible(dev: DeviceRound, intent: Intent, app: AppVersion, *,
                     view: Mapping[str, Any] | None = None) -> None:
    """The device is targeted but no profile fits: its file is kept for the intent's grace
    period, else removed, and the record says since when it is not eligible."""
    ctx, out, current, device = dev.ctx, dev.out, dev.current, dev.device
    previous = dev.previous.get(intent.name)
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
