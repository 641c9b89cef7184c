"""Rendering: (intent, application, profile, device) → one ApplicationDeployment YAML file.

The document is built as a model and serialized canonically (never text-templated), so
the same inputs always give the same bytes and digest. Parameter values are the
application's defaults overridden by the intent's values, expressions evaluated against
the device; every value is checked against the application's configuration schema and
`immutable` settings are checked against what the device was given before. Any problem
makes the whole rendering fail with located problems, so the caller can keep the device's
previous state.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compiler.expressions import ExpressionError, device_context
from compiler.intents import Intent
from compiler.snapshot import Device
from compiler.source import AppVersion
from margo.canonical import canonical_yaml
from margo.emit import deployment_document
from margo.errors import Problem
from margo.models import ApplicationDeployment, DeploymentProfile, Parameter, ParameterTarget
from margo.parameters import EMPTY, check_immutable, validate_value

__all__ = ["INTENT_LABEL", "RenderCache", "RenderError", "Rendered", "deployment_id", "file_name",
           "previous_values", "render"]

#: Namespace for deployment ids: uuid5(NAMESPACE, "<intent>/<device>") is stable, so editing
#: an intent updates the same deployment instead of replacing it.
NAMESPACE = uuid.UUID("5c1f1f43-6d0f-5bd5-9b53-2f6a6f6b1e10")
INTENT_LABEL = "margo-gitops.dev/intent"


class RenderError(Exception):
    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Rendered:
    file: str
    data: bytes


def deployment_id(intent_name: str, device_id: str) -> str:
    return str(uuid.uuid5(NAMESPACE, f"{intent_name}/{device_id}"))


def file_name(intent_name: str) -> str:
    return f"{intent_name}.yaml"


def _default_namespace(app_id: str) -> str:
    return app_id[:63].rstrip("-")


def _targets_in(parameter: Parameter, components: set[str]) -> tuple[ParameterTarget, ...]:
    out = []
    for target in parameter.targets:
        kept = tuple(c for c in target.components if c in components)
        if kept:
            out.append(ParameterTarget(target.pointer, kept))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _ProfilePlan:
    """What every rendering of one application profile shares, worked out once."""

    profile: DeploymentProfile
    targets: dict[str, tuple[ParameterTarget, ...]]  # parameters reaching this profile
    rules: tuple[tuple[str, Mapping[str, Any]], ...]  # (parameter, configuration rule)
    immutable: tuple[str, ...]


def _plan(app: AppVersion, profile: DeploymentProfile) -> _ProfilePlan:
    description = app.description
    components = {c.name for c in profile.components}
    targets = {name: t for name, p in description.parameters.items()
               if (t := _targets_in(p, components))}
    settings = description.settings()
    rules = tuple((name, description.schemas[s.schema]) for name, s in settings.items()
                  if s.schema in description.schemas)
    return _ProfilePlan(
        profile=DeploymentProfile(type=profile.type, components=profile.components,
                                  device_constraints=profile.device_constraints,
                                  extensions=profile.extensions),
        targets=targets, rules=rules,
        immutable=tuple(n for n, s in settings.items() if s.immutable))


class RenderCache:
    """Per-compile memo: profile plans, one device context per device, one validation per
    distinct (application, parameter, value).

    Most values are literals shared by thousands of devices; validating each distinct
    value once keeps rendering cheap without skipping any check.
    """

    def __init__(self) -> None:
        self._device: tuple[str, dict[str, Any]] | None = None
        self._checked: dict[tuple[str, str, str], list[Problem]] = {}
        self._plans: dict[tuple[str, str | None], _ProfilePlan] = {}
        self._keys: dict[tuple[str, str, int], str] = {}

    def plan(self, app: AppVersion, profile: DeploymentProfile) -> _ProfilePlan:
        key = (app.digest, profile.id)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(app, profile)
        return plan

    def context(self, device: Device) -> dict[str, Any]:
        if self._device is None or self._device[0] != device.id:
            self._device = (device.id, {"device": device_context(
                device.id, device.properties, device.labels, device.capabilities.extensions)})
        return self._device[1]

    def literal_key(self, owner: str, name: str, value: Any) -> str:
        """`value_key` of a value that is the same for every device (memoised by owner)."""
        key = (owner, name, id(value))
        found = self._keys.get(key)
        if found is None:
            found = self._keys[key] = value_key(value)
        return found

    def check(self, app: AppVersion, name: str, key: str, value: Any,
              rule: Mapping[str, Any]) -> list[Problem]:
        memo = (app.digest, name, key)
        problems = self._checked.get(memo)
        if problems is None:
            problems = validate_value(value, rule, path=("spec", "parameters", name))
            if len(self._checked) < 100_000:
                self._checked[memo] = problems
        return problems


def value_key(value: Any) -> str:
    """A text that differs whenever two values differ, type included (1, 1.0, true)."""
    if value is EMPTY:
        return "<empty>"
    return f"{type(value).__name__}:{json.dumps(value, sort_keys=True)}"


def _values(intent: Intent, app: AppVersion, device: Device, cache: RenderCache,
            ) -> tuple[dict[str, Any], dict[str, str], list[Problem]]:
    """Every parameter's value for this device (EMPTY when none) and its `value_key`, with
    expression errors."""
    description = app.description
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, p in description.parameters.items():
        values[name] = p.value if p.has_value else EMPTY
        keys[name] = cache.literal_key(app.digest, name, values[name])
    problems: list[Problem] = []
    for name, compiled in intent.parameters.items():
        if name not in description.parameters:
            problems.append(intent.locate(Problem(
                ("spec", "parameters", name), f"application {description.id} "
                f"{description.version} has no parameter {name!r}",
                expected="one of " + ", ".join(sorted(description.parameters)))))
            continue
        if compiled.is_literal:
            values[name] = compiled.source
            keys[name] = cache.literal_key(intent.digest, name, compiled.source)
            continue
        try:
            values[name] = compiled.render(cache.context(device))
        except ExpressionError as exc:
            problems.append(intent.locate(Problem(
                ("spec", "parameters", name), f"on device {device.id}: {exc}")))
            continue
        keys[name] = value_key(values[name])
    return values, keys, problems


def _check_values(values: Mapping[str, Any], keys: Mapping[str, str], app: AppVersion,
                  plan: _ProfilePlan, device: Device,
                  previous_values: Mapping[str, Any] | None, intent: Intent,
                  cache: RenderCache) -> list[Problem]:
    problems: list[Problem] = []
    for name, rule in plan.rules:
        if name not in values:
            continue
        for problem in cache.check(app, name, keys[name], values[name], rule):
            problems.append(intent.locate(Problem(
                problem.path, f"on device {device.id}: {problem.message}",
                expected=problem.expected, found=problem.found)))
    if previous_values is not None and plan.immutable:
        after = {n: v for n, v in values.items() if v is not EMPTY}
        for problem in check_immutable(previous_values, after, plan.immutable,
                                       path=("spec", "parameters")):
            problems.append(intent.locate(Problem(
                problem.path, f"on device {device.id}: {problem.message} (the setting is "
                              "immutable once deployed)", expected=problem.expected,
                found=problem.found)))
    return problems


def previous_values(document: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Parameter values of a previously rendered deployment document (any shape)."""
    if not isinstance(document, Mapping):
        return None
    parameters = document.get("spec", {}).get("parameters") or {}
    return {name: body["value"] for name, body in parameters.items()
            if isinstance(body, Mapping) and "value" in body}


def render(intent: Intent, app: AppVersion, profile: DeploymentProfile, device: Device, *,
           previous: Mapping[str, Any] | None = None,
           cache: RenderCache | None = None) -> Rendered:
    """The deployment file for one device; raise `RenderError` with located problems.

    `previous` is the device's current document for this intent (parsed), used for
    `immutable` settings.
    """
    cache = cache or RenderCache()
    plan = cache.plan(app, profile)
    values, keys, problems = _values(intent, app, device, cache)
    problems += _check_values(values, keys, app, plan, device, previous_values(previous),
                              intent, cache)
    if problems:
        raise RenderError(problems)
    parameters = {name: Parameter(name, targets, values[name], True)
                  for name, targets in plan.targets.items() if values[name] is not EMPTY}
    deployment = ApplicationDeployment(
        id=deployment_id(intent.name, device.id),
        name=intent.name,
        namespace=intent.namespace or _default_namespace(app.description.id),
        application_id=app.description.id,
        profile=plan.profile,
        parameters=parameters,
        device_id=device.id,
        labels={INTENT_LABEL: intent.name},
    )
    spec_key = (app.digest, profile.id, tuple((name, keys[name]) for name in parameters))
    document = deployment_document(deployment, shape=intent.output_shape, spec_key=spec_key)
    return Rendered(file_name(intent.name), canonical_yaml(document))
