"""Placement: does an intent target a device, and with which deployment profile, if any?

Pure decisions (no I/O), explained: a "no" carries every reason — not targeted (not in the
device list, every selector clause that failed), or for each profile that was tried the
deployment type the device lacks and every failing constraint clause.

Profile choice follows the spec ("a Kubernetes device gets the helm components, a Compose
device the compose components"): the intent may name a profile id or a type; otherwise
the profiles are tried in the order the application lists them and the first one the
device supports and satisfies wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from compiler.intents import Intent
from compiler.snapshot import Device
from compiler.source import AppVersion
from margo.constraints import CompiledConstraints, Demand, Failure, compile_constraints, demand_of
from margo.models import DeploymentProfile

__all__ = ["Attempt", "Placement", "place", "targeting_failures"]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One profile that was tried, and why it did not fit (empty when it did)."""

    profile_id: str
    failures: tuple[Failure, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    targeted: bool
    profile: DeploymentProfile | None = None
    attempts: tuple[Attempt, ...] = ()
    not_targeted_because: tuple[Failure, ...] = ()

    @property
    def eligible(self) -> bool:
        return self.profile is not None

    def failure_messages(self) -> list[str]:
        """The reasons, most relevant first: profiles of a type the device does not run at
        all are mentioned only when no profile of a supported type was tried."""
        if not self.targeted:
            return [f.message for f in self.not_targeted_because]
        relevant = [a for a in self.attempts if any(f.stage != "profile" for f in a.failures)]
        return [f"profile {a.profile_id}: {f.message}"
                for a in (relevant or self.attempts) for f in a.failures]


@dataclass
class ProfileConstraints:
    """Compiled constraints per (application version, profile id), built once per compile."""

    cache: dict[tuple[str, str], CompiledConstraints] = field(default_factory=dict)

    def get(self, app: AppVersion, profile: DeploymentProfile) -> CompiledConstraints:
        key = (app.digest, str(profile.id))
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = compile_constraints(profile.device_constraints,
                                           required_resources=profile.required_resources)
            self.cache[key] = compiled
        return compiled

    def demand(self, intent: Intent, app: AppVersion, profile: DeploymentProfile,
               view: Mapping[str, Any], labels: Mapping[str, Any]) -> Demand:
        """What a deployment of `intent` with `profile` takes from a device (its matching
        view decides which eligibility rule, and so which GPU, applies): the profile's
        requirements and the intent's extra constraints together."""
        demand = demand_of(self.get(app, profile), view, labels)
        if intent.constraints is not None:
            demand = demand.combined(demand_of(intent.constraints, view, labels))
        return demand


def _candidates(intent: Intent, app: AppVersion) -> list[DeploymentProfile]:
    profiles = list(app.description.profiles)
    if intent.profile_id is not None:
        return [p for p in profiles if p.id == intent.profile_id]
    if intent.profile_type is not None:
        return [p for p in profiles if p.type == intent.profile_type]
    return profiles


def _type_failure(profile: DeploymentProfile, properties: Mapping[str, Any]) -> Failure | None:
    supported = properties.get("supportedDeploymentTypes")
    if isinstance(supported, list) and str(profile.type) in supported:
        return None
    return Failure(stage="profile", key="/supportedDeploymentTypes", operator="ContainsAny",
                   required=[str(profile.type)], actual=supported, rule=None,
                   message=f"the device does not support {profile.type} deployments "
                           f"(supportedDeploymentTypes: {supported if supported else 'none'})")


def targeting_failures(intent: Intent, device: Device) -> tuple[Failure, ...]:
    """Why an intent's targets do not select a device (for explanations)."""
    failures: list[Failure] = []
    if intent.devices is not None:
        failures.append(Failure(stage="targets", key="devices", operator="In",
                                required=sorted(intent.devices), actual=device.id, rule=None,
                                message=f"{device.id} is not in the intent's device list"))
    if intent.selector is not None:
        result = intent.selector.evaluate(device.matching, device.labels)
        failures.extend(Failure(stage="targets", key=f.key, operator=f.operator,
                                required=f.required, actual=f.actual, rule=f.rule,
                                message=f"selector {f.message}") for f in result.failures)
    return tuple(failures)


def place(intent: Intent, app: AppVersion, device: Device, constraints: ProfileConstraints, *,
          explain: bool = False, targeted: bool | None = None,
          view: Mapping[str, Any] | None = None) -> Placement:
    """Decide targeting (unless the caller already knows it) and profile; with `explain`,
    collect every failing clause. Everything is matched against the device's matching view
    (properties, root extensions, cluster sections), built once per device, or against
    `view` (what capacity accounting leaves of it); targets always see the device's own."""
    properties, labels = device.matching, device.labels
    if targeted is None:
        targeted = intent.targets(device.id, properties, labels)
    if not targeted:
        return Placement(False, not_targeted_because=targeting_failures(intent, device)
                         if explain else ())
    if view is not None:
        properties = view
    attempts: list[Attempt] = []
    candidates = _candidates(intent, app)
    for profile in candidates:
        type_failure = _type_failure(profile, properties)
        profile_constraints = constraints.get(app, profile)
        fits = type_failure is None and profile_constraints.is_eligible(properties, labels) and (
            intent.constraints is None or intent.constraints.is_eligible(properties, labels))
        if fits:
            return Placement(True, profile, tuple(attempts))
        failures: list[Failure] = [type_failure] if type_failure else []
        failures.extend(profile_constraints.evaluate(properties, labels).failures)
        if intent.constraints is not None:
            failures.extend(
                Failure(stage=f"intent {f.stage}", key=f.key, operator=f.operator,
                        required=f.required, actual=f.actual, rule=f.rule, message=f.message)
                for f in intent.constraints.evaluate(properties, labels).failures)
        attempts.append(Attempt(str(profile.id), tuple(failures)))
    if not candidates:
        wanted = intent.profile_id or intent.profile_type
        attempts.append(Attempt(str(wanted), (Failure(
            stage="profile", key="deploymentProfiles", operator="In", required=str(wanted),
            actual=[p.id for p in app.description.profiles], rule=None,
            message=f"application {app.description.id} {app.description.version} has no "
                    f"profile {wanted!r}"),)))
    return Placement(True, None, tuple(attempts))
