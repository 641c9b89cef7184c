"""`margo explain`: for one device, why each intent does or does not deploy there.

Every failing clause is listed with the required and the actual value, for targeting
(device list, selectors) and for each deployment profile that was tried (deployment
type, capacity, eligibility rules, the intent's extra constraints); parameter problems
are shown too, since they keep a device on its previous state. Capacity accounting is
applied as the compiler applies it (`compiler.capacity`, `compiler.holding`): the intents
the device's tree holds take their share first, then new placements and upgrades in
placement order; a new placement that does not fit in what is left is "waiting for
capacity", and, when the device's files are given, a change of a placed deployment that
raises what it takes and does not fit is "held for capacity", both with the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from compiler.capacity import DeviceCapacity, is_cluster
from compiler.context import resolve_intents
from compiler.holding import grows
from compiler.intents import Intent
from compiler.placement import Attempt, Placement, ProfileConstraints, place
from compiler.render import RenderCache, RenderError, render
from compiler.secrets import FleetKey
from compiler.snapshot import Snapshot
from compiler.source import FleetSource
from compiler.specdiff import classify
from compiler.state import PlacementRecord
from compiler.storedfiles import StoredFiles
from margo.constraints import Demand, Failure
from margo.errors import Problem

__all__ = ["STATUSES", "IntentExplanation", "explain_device", "explanation_lines", "reasons"]

#: Every verdict an explanation can give, in the order of a decision's stages.
STATUSES = ("eligible", "not targeted", "not eligible", "waiting for capacity",
            "held for capacity", "grace period", "error", "frozen")


@dataclass
class IntentExplanation:
    intent: str
    #: eligible | not targeted | not eligible | waiting for capacity | held for capacity |
    #: grace period | error | frozen
    status: str
    application: str | None = None
    profile: str | None = None
    targeting: list[Failure] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    note: str | None = None
    #: Why a new placement does not fit in what the device has left (accounting).
    capacity: list[Failure] = field(default_factory=list)
    #: What the placement is counted as taking that the device's report does not show yet.
    assigned: dict[str, Any] | None = None
    #: Held for capacity: the version the device keeps running ("" when the source no
    #: longer has it); `capacity` says why the change does not fit.
    held_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "intent": self.intent, "status": self.status, "application": self.application,
            "profile": self.profile,
            "targeting": [f.to_json() for f in self.targeting],
            "attempts": [{"profile": a.profile_id, "failures": [f.to_json() for f in a.failures]}
                         for a in self.attempts],
            "problems": [p.to_json() for p in self.problems],
            "note": self.note,
            "capacity": [f.to_json() for f in self.capacity],
            "assigned": self.assigned,
            "heldAt": self.held_at,
        }

    def lines(self) -> list[str]:
        """Human-readable explanation, one line per fact (`explanation_lines`)."""
        return explanation_lines(self.to_json())


def explanation_lines(entry: Mapping[str, Any]) -> list[str]:
    """An explanation as people read it, from its JSON (`IntentExplanation.to_json`, also
    what a server answers): the verdict, then one line per fact."""
    head = f"{entry['intent']}: {entry['status']}"
    if entry.get("application"):
        head += f" (application {entry['application']}"
        head += f", profile {entry['profile']})" if entry.get("profile") else ")"
    return [head, *(f"  - {line}" for line in reasons(entry))]


def reasons(entry: Mapping[str, Any], *, assigned: bool = True) -> list[str]:
    """The facts of an explanation's JSON, one line each: failing clauses, problems (as
    `Problem.format` prints them), capacity, and (with `assigned`) what its placement is
    counted as taking."""
    out = [f"not targeted: {f['message']}" for f in entry["targeting"]]
    for attempt in entry["attempts"]:
        out += [f"profile {attempt['profile']}: {f['message']}" for f in attempt["failures"]]
    out += [f"{p.get('file') or '<input>'}:{p.get('line') or 0}:{p.get('column') or 0}: "
            f"{p['path']}: {p['message']}" for p in entry["problems"]]
    held_at = entry.get("heldAt")
    out += [held_reason(held_at, f["message"]) if held_at is not None
            else f"waits for capacity: {f['message']}" for f in entry["capacity"]]
    if assigned and entry.get("assigned"):
        taken = ", ".join(f"{v} {k}" if k != "cpu" else f"{v} cores"
                          for k, v in entry["assigned"].items())
        out.append(f"counted as taking {taken} (not yet in the device's report)")
    if entry.get("note"):
        out.append(entry["note"])
    return out


def held_reason(held_at: str, message: str) -> str:
    """`held at 1.0.0: the new version needs 1.5 cores; ...` (one capacity failure)."""
    return f"held at {held_at or 'the version it runs'}: the new version {message}"


#: A placed intent's share, taken in placement order: (priority, name, take it).
_Share = tuple[int, str, Callable[[], None]]


@dataclass
class _Upgrade:
    """A placed deployment whose file differs from what it renders now and needs more."""

    demand: Demand  # what the new file would take
    data: bytes  # the file the device runs


@dataclass
class _Round:
    """One device's accounting as `explain_device` gathers it: the shares of what its tree
    holds, then the new placements and upgrades to decide in order."""

    capacity: DeviceCapacity
    files: Mapping[str, bytes]
    stored: StoredFiles
    shares: list[_Share] = field(default_factory=list)
    upgrades: list[tuple[Intent, Any, _Upgrade, IntentExplanation]] = field(
        default_factory=list)
    new: list[tuple[Intent, Any, Placement, IntentExplanation]] = field(default_factory=list)
    accounted: list[IntentExplanation] = field(default_factory=list)  # say what they take

    @classmethod
    def start(cls, capacity: DeviceCapacity, placed: Collection[str] | Mapping[str, bytes],
              stored: StoredFiles) -> _Round:
        """A device's round, with its files when `placed` gives them."""
        return cls(capacity, placed if isinstance(placed, Mapping) else {}, stored)

    def keep_file(self, intent: Intent | None, name: str) -> None:
        """A file the compiler keeps as it is (frozen intent, grace period, error)."""
        if name in self.files and not (intent is not None and intent.overcommit):
            self.shares.append(_file_share(self.capacity, self.stored, intent, name,
                                           self.files[name]))

    def placed(self, intent: Intent, app: Any, profile: Any, rendered: bytes | None,
               explanation: IntentExplanation) -> None:
        """A placed deployment: its file as rendered now, an upgrade, or a kept file."""
        name = intent.name
        upgrade = None if rendered is None or intent.overcommit else _upgrade(
            self.capacity, self.stored, intent, app, profile, self.files.get(name), rendered)
        if upgrade is not None:
            self.upgrades.append((intent, app, upgrade, explanation))
            self.shares.append(_file_share(self.capacity, self.stored, intent, name,
                                           upgrade.data))
        elif rendered is not None or name not in self.files:
            self.shares.append((intent.priority, name, lambda: self.capacity.hold(
                intent, app, profile)))
        else:  # the compiler keeps its file after an error: the file says what it takes
            self.keep_file(intent, name)


def explain_device(source: FleetSource, snapshot: Snapshot, device_id: str, *,
                   intent_name: str | None = None,
                   placements: dict[str, PlacementRecord] | None = None,
                   placed: Collection[str] | Mapping[str, bytes] | None = None,
                   now: float | None = None, fleet_key: FleetKey | None = None
                   ) -> list[IntentExplanation]:
    """Explain every intent (or one) for a device; raise KeyError for an unknown device.
    `fleet_key` opens the intents' secrets as the compiler does. `placed` names the
    intents the device's tree holds (by default those `placements` say are deployed; none
    without either), or maps them to the files it holds: accounting gives them their
    share first, and with the files a change that raises what a placed deployment takes is
    decided (and explained as held) as the compiler decides it."""
    device = snapshot.devices[device_id]
    resolved = resolve_intents(source)
    constraints, renders = ProfileConstraints(), RenderCache(fleet_key)
    names = sorted(set(resolved.usable) | resolved.frozen)
    if intent_name is not None and intent_name not in names:
        raise KeyError(intent_name)
    records = placements or {}
    placed = {n for n, r in records.items() if r.deployed} if placed is None else placed
    capacity = DeviceCapacity(device, constraints)
    round_ = _Round.start(capacity, placed, StoredFiles(source.applications, renders))
    cluster = is_cluster(device)
    out: list[IntentExplanation] = []
    for name in names:
        if name not in resolved.usable:
            out.append(_frozen(source, resolved.problems, name))
            round_.keep_file(None, name)
            continue
        intent, app = resolved.usable[name]
        app_label = f"{app.description.id} {app.description.version}"
        own = capacity.own_view(name) if cluster and name in placed else None
        placement = place(intent, app, device, constraints, explain=True, view=own)
        if not placement.targeted:
            out.append(IntentExplanation(name, "not targeted", app_label,
                                         targeting=list(placement.not_targeted_because)))
            continue
        if placement.profile is None:
            out.append(_ineligible(intent, app_label, placement, records.get(name), now,
                                   kept=name in placed))
            if out[-1].status == "grace period":
                round_.keep_file(intent, name)
            continue
        profile = placement.profile
        if name in placed:
            profile = _recorded_profile(app, records.get(name)) or profile
        explanation = IntentExplanation(name, "eligible", app_label, str(profile.id),
                                        attempts=list(placement.attempts))
        try:
            rendered: bytes | None = render(intent, app, profile, device, cache=renders).data
        except RenderError as exc:
            explanation.status, explanation.problems, rendered = "error", exc.problems, None
        out.append(explanation)
        round_.accounted.append(explanation)
        if name in placed:
            round_.placed(intent, app, profile, rendered, explanation)
        elif not intent.overcommit:
            round_.new.append((intent, app, placement, explanation))
    _account(round_, source)
    return [e for e in out if intent_name is None or e.intent == intent_name]


def _frozen(source: FleetSource, problems: list[Problem], name: str) -> IntentExplanation:
    located = [p for p in [*source.problems, *problems]
               if p.file and p.file.endswith(f"/{name}.yaml")]
    return IntentExplanation(name, "frozen", problems=located,
                             note="the intent cannot be used; devices keep its previous "
                                  "deployments")


def _ineligible(intent: Intent, app_label: str, placement: Placement,
                record: PlacementRecord | None, now: float | None, *,
                kept: bool) -> IntentExplanation:
    """A targeted intent no profile of which the device satisfies. `kept`: the device's
    tree still holds its file. Without the compiler's record (the server's read API
    explains with the device's files only), a held file of an intent with a grace period
    is in that period: the compiler removes an ineligible file at once otherwise."""
    explanation = IntentExplanation(intent.name, "not eligible", app_label,
                                    attempts=list(placement.attempts))
    if record and record.deployed and record.ineligible_since and intent.grace_seconds:
        elapsed = (now or 0) - record.ineligible_since
        left = max(0, int(intent.grace_seconds - elapsed))
        explanation.status = "grace period"
        explanation.note = (f"still deployed: kept for the grace period of "
                            f"{intent.grace_seconds}s, {left}s left")
    elif record is None and kept and intent.grace_seconds:
        explanation.status = "grace period"
        explanation.note = (f"still deployed: kept for the grace period of "
                            f"{intent.grace_seconds}s")
    return explanation


def _upgrade(capacity: DeviceCapacity, stored: StoredFiles, intent: Intent, app: Any,
             profile: Any, data: bytes | None, rendered: bytes) -> _Upgrade | None:
    """The upgrade a placed deployment's file makes when it is rendered now, if it raises
    what the deployment takes (`compiler.holding.take_back_upgrades`)."""
    if data is None or data == rendered or classify(data, rendered) != "update":
        return None
    compiled = stored.constraints(data)
    if compiled is None:
        return None
    new = capacity.demand_now(intent, app, profile)
    if not grows(capacity.file_demand(intent.name, intent, compiled), new):
        return None
    return _Upgrade(new, data)


def _file_share(capacity: DeviceCapacity, stored: StoredFiles, intent: Intent | None,
                name: str, data: bytes) -> _Share:
    """The share of a file the device keeps as it is: what the file says it takes."""
    def take() -> None:
        compiled = stored.constraints(data)
        if compiled is not None:
            capacity.hold_demand(name, capacity.file_demand(name, intent, compiled))
    return (0 if intent is None else intent.priority, name, take)


def _recorded_profile(app: Any, record: PlacementRecord | None) -> Any:
    """The profile a placed deployment runs with, as the compiler recorded it (a profile
    chosen because the first did not fit stays chosen)."""
    if record is None or record.profile is None:
        return None
    return next((p for p in app.description.profiles if p.id == record.profile), None)


def _account(round_: _Round, source: FleetSource) -> None:
    """Accounting as the compiler does it (`compiler.holding.decide_in_order`): what the
    tree holds first, then new placements and upgrades in order, in passes until one
    decides nothing more; explanations of those that do not fit say so, in numbers."""
    capacity = round_.capacity
    for _, _, take in sorted(round_.shares, key=lambda s: (-s[0], s[1])):
        take()
    pending: list[tuple[Intent, Any, Placement | _Upgrade, IntentExplanation]] = sorted(
        [*round_.new, *round_.upgrades], key=lambda e: (-e[0].priority, e[0].name))
    short_of: dict[str, tuple[Failure, ...]] = {}
    while pending:
        left = []
        for intent, app, item, explanation in pending:
            if isinstance(item, _Upgrade):
                short = capacity.upgrade(intent.name, item.demand)
            else:
                chosen, short = capacity.admit(intent, app, item)
                if not short and chosen.profile is not None:
                    explanation.profile = str(chosen.profile.id)
            if short:
                short_of[intent.name] = short
                left.append((intent, app, item, explanation))
        if len(left) == len(pending):
            break
        pending = left
    for intent, app, item, explanation in pending:
        if isinstance(item, _Upgrade):
            _held(explanation, round_.stored, source, app, item.data, short_of[intent.name])
        else:
            explanation.status = "waiting for capacity"
            explanation.capacity = list(short_of[intent.name])
    assigned = capacity.ledger.assigned()
    for explanation in round_.accounted:
        explanation.assigned = assigned.get(explanation.intent) or None


def _held(explanation: IntentExplanation, stored: StoredFiles, source: FleetSource, app: Any,
          data: bytes, short: tuple[Failure, ...]) -> None:
    versions = source.applications.get(app.description.id, {})
    running = stored.running_version(versions, data, RenderCache())
    explanation.status, explanation.capacity = "held for capacity", list(short)
    explanation.held_at = running or ""
    explanation.note = (f"the device keeps running {running or 'the version it has'} until "
                        f"{app.description.version} fits")
