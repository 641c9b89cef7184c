"""`margo explain`: for one device, why each intent does or does not deploy there.

Every failing clause is listed with the required and the actual value, for targeting
(device list, selectors) and for each deployment profile that was tried (deployment
type, capacity, eligibility rules, the intent's extra constraints); parameter problems
are shown too, since they keep a device on its previous state. Capacity accounting is
applied as the compiler applies it (`compiler.capacity`): the intents the device's tree
holds take their share first, then the others in placement order, and one that does not fit
in what is left is "waiting for capacity", with the numbers.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from compiler.capacity import DeviceCapacity, is_cluster
from compiler.compilation import resolve_intents
from compiler.intents import Intent
from compiler.placement import Attempt, Placement, ProfileConstraints, place
from compiler.render import RenderError, render
from compiler.snapshot import Snapshot
from compiler.source import FleetSource
from compiler.state import PlacementRecord
from margo.constraints import Failure
from margo.errors import Problem

__all__ = ["IntentExplanation", "explain_device"]


@dataclass
class IntentExplanation:
    intent: str
    #: eligible | not targeted | not eligible | waiting for capacity | grace period | error |
    #: frozen
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
        }

    def lines(self) -> list[str]:
        """Human-readable explanation, one line per fact."""
        head = f"{self.intent}: {self.status}"
        if self.application:
            head += f" (application {self.application}"
            head += f", profile {self.profile})" if self.profile else ")"
        out = [head]
        out += [f"  - not targeted: {f.message}" for f in self.targeting]
        for attempt in self.attempts:
            out += [f"  - profile {attempt.profile_id}: {f.message}" for f in attempt.failures]
        out += [f"  - {p.format()}" for p in self.problems]
        out += [f"  - waits for capacity: {f.message}" for f in self.capacity]
        if self.assigned:
            taken = ", ".join(f"{v} {k}" if k != "cpu" else f"{v} cores"
                              for k, v in self.assigned.items())
            out.append(f"  - counted as taking {taken} (not yet in the device's report)")
        if self.note:
            out.append(f"  - {self.note}")
        return out


def explain_device(source: FleetSource, snapshot: Snapshot, device_id: str, *,
                   intent_name: str | None = None,
                   placements: dict[str, PlacementRecord] | None = None,
                   placed: Collection[str] | None = None,
                   now: float | None = None) -> list[IntentExplanation]:
    """Explain every intent (or one) for a device; raise KeyError for an unknown device.

    `placed` names the intents the device's tree holds (by default those `placements` say
    are deployed; none without either): accounting gives them their share first."""
    device = snapshot.devices[device_id]
    resolved = resolve_intents(source)
    constraints = ProfileConstraints()
    names = sorted(set(resolved.usable) | resolved.frozen)
    if intent_name is not None and intent_name not in names:
        raise KeyError(intent_name)
    if placed is None:
        placed = {n for n, r in (placements or {}).items() if r.deployed}
    capacity = DeviceCapacity(device, constraints)
    cluster = is_cluster(device)
    out: list[IntentExplanation] = []
    new: list[tuple[Intent, Any, Placement, IntentExplanation]] = []
    held: list[tuple[Intent, Any, Any, IntentExplanation]] = []
    for name in names:
        if name not in resolved.usable:
            problems = [p for p in [*source.problems, *resolved.problems]
                        if p.file and p.file.endswith(f"/{name}.yaml")]
            out.append(IntentExplanation(name, "frozen", problems=problems,
                                         note="the intent cannot be used; devices keep its "
                                              "previous deployments"))
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
            explanation = IntentExplanation(name, "not eligible", app_label,
                                            attempts=list(placement.attempts))
            record = (placements or {}).get(name)
            if record and record.deployed and record.ineligible_since and intent.grace_seconds:
                elapsed = (now or 0) - record.ineligible_since
                left = max(0, int(intent.grace_seconds - elapsed))
                explanation.status = "grace period"
                explanation.note = (f"still deployed: kept for the grace period of "
                                    f"{intent.grace_seconds}s, {left}s left")
            out.append(explanation)
            continue
        explanation = IntentExplanation(name, "eligible", app_label, str(placement.profile.id),
                                        attempts=list(placement.attempts))
        try:
            render(intent, app, placement.profile, device)
        except RenderError as exc:
            explanation.status = "error"
            explanation.problems = exc.problems
        out.append(explanation)
        if name in placed:
            profile = _recorded_profile(app, (placements or {}).get(name)) or placement.profile
            explanation.profile = str(profile.id)
            held.append((intent, app, profile, explanation))
        elif not intent.overcommit:
            new.append((intent, app, placement, explanation))
    _account(capacity, held, new)
    return [e for e in out if intent_name is None or e.intent == intent_name]


def _recorded_profile(app: Any, record: PlacementRecord | None) -> Any:
    """The profile a placed deployment runs with, as the compiler recorded it (a profile
    chosen because the first did not fit stays chosen)."""
    if record is None or record.profile is None:
        return None
    return next((p for p in app.description.profiles if p.id == record.profile), None)


def _account(capacity: DeviceCapacity,
             held: list[tuple[Intent, Any, Any, IntentExplanation]],
             new: list[tuple[Intent, Any, Placement, IntentExplanation]]) -> None:
    """Accounting as the compiler does it: what the tree holds first, then new placements in
    order; explanations of those that do not fit say so, in numbers."""
    for intent, app, profile, _ in sorted(held, key=lambda e: (-e[0].priority, e[0].name)):
        capacity.hold(intent, app, profile)
    for intent, app, placement, explanation in sorted(
            new, key=lambda e: (-e[0].priority, e[0].name)):
        chosen, short = capacity.admit(intent, app, placement)
        if short:
            explanation.status = "waiting for capacity"
            explanation.capacity = list(short)
        elif chosen.profile is not None:
            explanation.profile = str(chosen.profile.id)
    assigned = capacity.ledger.assigned()
    for _, _, _, explanation in [*held, *new]:
        explanation.assigned = assigned.get(explanation.intent) or None
