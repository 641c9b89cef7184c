"""One device's capacity round: what the files its new tree holds take, then the decisions
that need room, one after another (docs/intents.md, "Capacity accounting").

The decisions that need room are new placements and *upgrades*: changes of a placed
deployment (a new application version, an edited intent) that raise what it takes. Both are
decided in one deterministic order, highest `priority` first, then by intent name, each in
what the ones before it left. An upgrade that no longer fits is *held*: the device keeps the
file it runs (the previous version keeps running, and is counted at what it takes), the
placement is recorded as held (eligible, deployed and waiting), a note says why in numbers,
and it is decided again whenever the device's capabilities or its other placements change,
like a waiting placement. A change that takes the same or less is never held; nor is an
intent with `overcommit: true`.

What a file the tree keeps takes is read from the file itself when it is not what its intent
renders now (held, kept by a rollout or after an error, kept for a grace period, or of a
frozen intent): rc.3 files carry their profile's `deviceConstraints` verbatim, rc.2 files in
our extension, and an Oct-2024 file takes what the one application profile whose text it
holds takes (`compiler.storedfiles`). The compiler's state is only a cache; the branch is
the truth, so a compile from scratch decides exactly as an incremental one. A file that does
not say (an Oct-2024 file whose profile the source no longer has, or has in versions that
take different amounts) is counted at what its intent's profile takes now, and a change of
it is never held.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from compiler.capacity import DeviceCapacity
from compiler.context import CompileContext
from compiler.decisions import DeviceRound, place_eligible
from compiler.intents import Intent
from compiler.outcome import DeviceOutcome
from compiler.placement import Placement
from compiler.render import file_name
from compiler.source import AppVersion
from compiler.state import PlacementRecord
from margo.constraints import Demand, Failure

__all__ = ["Upgrade", "decide_in_order", "grows", "held_note", "take_back_upgrades"]

_SUFFIX = ".yaml"


def grows(old: Demand, new: Demand) -> bool:
    """Whether `new` asks for anything `old` did not hold: more cores, memory or storage,
    cores on fewer architectures, or a GPU claim `old` did not have."""
    if new.cores > old.cores or new.memory > old.memory or new.storage > old.storage:
        return True
    if new.cores and new.architectures is not None and (
            old.architectures is None or not new.architectures >= old.architectures):
        return True
    had = Counter(claim.text for claim in old.gpus)
    return any(count > had[text] for text, count in
               Counter(claim.text for claim in new.gpus).items())


def held_note(name: str, running: str | None, version: str,
              short: tuple[Failure, ...]) -> str:
    """`<intent>: held at 1.0.0: the new version needs 1.5 cores; the device has 2, of which
    1 is assigned to other`."""
    what = "the change" if running == version else "the new version"
    return (f"{name}: held at {running or 'the version it runs'}: {what} "
            + "; ".join(f.message for f in short))


@dataclass
class Upgrade:
    """A change of a placed deployment that raises what it takes, taken back out of the new
    tree until the round decides it: what it would write, and what it takes then."""

    intent: Intent
    app: AppVersion
    demand: Demand
    data: bytes
    oid: str
    move: tuple[str, str] | None  # the rollout move it makes, if it moves on


def take_back_upgrades(dev: DeviceRound) -> list[Upgrade]:
    """The updates of this compile that raise what a placed deployment takes, each taken
    back out of the new tree (the device keeps its file meanwhile). The device's
    accounting is made only when some update needs it."""
    ctx, out, current = dev.ctx, dev.out, dev.current
    records = {r.intent: r for r in out.placements}
    upgrades = []
    for change in out.changes:
        entry = ctx.intents.usable.get(change.intent)
        fname = change.file
        if change.action != "update" or entry is None or entry[0].overcommit \
                or fname not in out.files or fname not in current.ids:
            continue
        intent, app = entry
        record = records.get(intent.name)
        profile = None if record is None else ctx.profile(app, record.profile)
        compiled = ctx.stored.constraints(current.read(fname))
        if profile is None or compiled is None:
            continue
        device = dev.capacity()
        new = device.demand_now(intent, app, profile)
        if not grows(device.file_demand(intent.name, intent, compiled), new):
            continue
        move = next((m for m in out.moves if m[0] == intent.name), None)
        if move is not None:
            out.moves.remove(move)
        upgrades.append(Upgrade(intent, app, new, out.files.pop(fname), out.ids[fname], move))
        out.keep(fname, current)
        out.stale.add(intent.name)
    return upgrades


def _priority(ctx: CompileContext, name: str) -> int:
    entry = ctx.intents.usable.get(name)
    return 0 if entry is None else entry[0].priority


def _is_fresh(out: DeviceOutcome, record: PlacementRecord | None) -> bool:
    """Whether the tree's file of `record` is what its intent renders now."""
    return (record is not None and record.deployed and not record.waiting
            and record.ineligible_since is None and record.intent not in out.stale)


def hold_tree(dev: DeviceRound, capacity: DeviceCapacity) -> None:
    """Every file the new tree holds so far takes its share of the device, in placement
    order: what its intent takes now when the file is what it renders now, else what the
    file itself says it takes."""
    ctx, out, current = dev.ctx, dev.out, dev.current
    records = {r.intent: r for r in out.placements}
    names = [f[: -len(_SUFFIX)] for f in out.ids if f.endswith(_SUFFIX)]
    for name in sorted(names, key=lambda n: (-_priority(ctx, n), n)):
        entry = ctx.intents.usable.get(name)
        if entry is not None and entry[0].overcommit:
            continue
        record = records.get(name)
        profile = None if entry is None or record is None else ctx.profile(entry[1],
                                                                          record.profile)
        if entry is not None and profile is not None and _is_fresh(out, record):
            capacity.hold(entry[0], entry[1], profile)
            continue
        fname = file_name(name)
        data = out.files.get(fname)
        compiled = ctx.stored.constraints(current.blob(out.ids[fname]) if data is None
                                          else data)
        if compiled is not None:
            capacity.hold_demand(name, capacity.file_demand(
                name, None if entry is None else entry[0], compiled))
        elif entry is not None and profile is not None:
            capacity.hold(entry[0], entry[1], profile)
        else:
            _hold_as_recorded(ctx, capacity, name, record)


def _hold_as_recorded(ctx: CompileContext, capacity: DeviceCapacity, name: str,
                      record: PlacementRecord | None) -> None:
    """A file that does not say what it takes, of an intent that cannot be used now: its
    application version as the state last recorded it says."""
    before = ctx.previous_intents.get(name)
    app = None if before is None else ctx.source.application(before.app_id,
                                                             before.app_version)
    profile = None if app is None or record is None else ctx.profile(app, record.profile)
    if app is not None and profile is not None:
        capacity.hold_frozen(name, app, profile)


def decide_in_order(dev: DeviceRound, new: list[tuple[Intent, AppVersion, Placement]],
                    upgrades: list[Upgrade]) -> None:
    """The round: the tree's files take their shares, then new placements and upgrades
    are decided one after another (highest priority, then name), in passes until a pass
    decides nothing more: an upgrade that goes through may free what an earlier one in
    the order needed (more storage, less memory), and the next compile of the same inputs
    must not find anything left to do. A new placement that does not fit then waits; an
    upgrade that does not fit is held; both say why in numbers."""
    capacity = dev.capacity()
    hold_tree(dev, capacity)
    pending: list[tuple[Intent, AppVersion, Placement | Upgrade]] = sorted(
        [*new, *((u.intent, u.app, u) for u in upgrades)],
        key=lambda e: (-e[0].priority, e[0].name))
    short_of: dict[str, tuple[Failure, ...]] = {}
    while pending:
        left = []
        for intent, app, item in pending:
            short = (_try_upgrade(dev.out, capacity, item) if isinstance(item, Upgrade)
                     else _try_new(dev, capacity, intent, app, item))
            if short:
                short_of[intent.name] = short
                left.append((intent, app, item))
        if len(left) == len(pending):
            break
        pending = left
    for intent, _app, item in pending:
        if isinstance(item, Upgrade):
            _hold(dev, item, short_of[intent.name])
        else:
            _wait(dev.out, capacity.device.id, intent, short_of[intent.name])


def _try_new(dev: DeviceRound, capacity: DeviceCapacity, intent: Intent, app: AppVersion,
             placement: Placement) -> tuple[Failure, ...]:
    """Place a new placement if it fits (nothing returned), else say why."""
    placement, short = capacity.admit(intent, app, placement)
    if short:
        return short
    place_eligible(dev, intent, app, placement)
    if file_name(intent.name) not in dev.out.ids:  # it could not be rendered: nothing to hold
        capacity.ledger.release(intent.name)
    return ()


def _wait(out: DeviceOutcome, device_id: str, intent: Intent,
          short: tuple[Failure, ...]) -> None:
    out.placements.append(PlacementRecord(device_id, intent.name, False, False, None, None,
                                          True))
    out.notes.append(f"{intent.name}: waits for capacity: "
                     + "; ".join(f.message for f in short))


def _try_upgrade(out: DeviceOutcome, capacity: DeviceCapacity,
                 upgrade: Upgrade) -> tuple[Failure, ...]:
    """Put an upgrade back into the tree if it fits (nothing returned), else say why."""
    name, fname = upgrade.intent.name, file_name(upgrade.intent.name)
    short = capacity.upgrade(name, upgrade.demand)
    if short:
        return short
    del out.kept[fname]
    out.add(fname, upgrade.data, upgrade.oid)
    out.stale.discard(name)
    if upgrade.move is not None:
        out.moves.append(upgrade.move)
    return ()


def _hold(dev: DeviceRound, upgrade: Upgrade, short: tuple[Failure, ...]) -> None:
    """The device keeps the file it runs; the record says held, a note says why."""
    ctx, out, current = dev.ctx, dev.out, dev.current
    name, fname = upgrade.intent.name, file_name(upgrade.intent.name)
    out.changes = [c for c in out.changes if c.intent != name]
    out.placements = [r._replace(waiting=True) if r.intent == name else r
                      for r in out.placements]
    description = upgrade.app.description
    running = ctx.stored.running_version(ctx.source.applications.get(description.id, {}),
                                         current.read(fname), ctx.renders)
    out.notes.append(held_note(name, running, description.version, short))
