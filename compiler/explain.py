"""`margo explain`: for one device, why each intent does or does not deploy there.

Every failing clause is listed with the required and the actual value, for targeting
(device list, selectors) and for each deployment profile that was tried (deployment
type, capacity, eligibility rules, the intent's extra constraints); parameter problems
are shown too, since they keep a device on its previous state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compiler.compilation import resolve_intents
from compiler.placement import Attempt, ProfileConstraints, place
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
    status: str  # eligible | not targeted | not eligible | grace period | error | frozen
    application: str | None = None
    profile: str | None = None
    targeting: list[Failure] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "intent": self.intent, "status": self.status, "application": self.application,
            "profile": self.profile,
            "targeting": [f.to_json() for f in self.targeting],
            "attempts": [{"profile": a.profile_id, "failures": [f.to_json() for f in a.failures]}
                         for a in self.attempts],
            "problems": [p.to_json() for p in self.problems],
            "note": self.note,
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
        if self.note:
            out.append(f"  - {self.note}")
        return out


def explain_device(source: FleetSource, snapshot: Snapshot, device_id: str, *,
                   intent_name: str | None = None,
                   placements: dict[str, PlacementRecord] | None = None,
                   now: float | None = None) -> list[IntentExplanation]:
    """Explain every intent (or one) for a device; raise KeyError for an unknown device."""
    device = snapshot.devices[device_id]
    resolved = resolve_intents(source)
    constraints = ProfileConstraints()
    names = sorted(set(resolved.usable) | resolved.frozen)
    if intent_name is not None:
        if intent_name not in names:
            raise KeyError(intent_name)
        names = [intent_name]
    out = []
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
        placement = place(intent, app, device, constraints, explain=True)
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
    return out
