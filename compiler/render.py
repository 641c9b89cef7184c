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

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compiler.expressions import CompiledValue, ExpressionError, device_context
from compiler.intents import Intent
from compiler.sealing import (
    GRANTS,
    SealItem,
    compare_previous,
    grant_item,
    no_key_problem,
    parameter_item,
    previous_envelopes,
    redacted,
    seal_for,
)
from compiler.secrets import SECRET, FleetKey, SecretError, is_secret
from compiler.snapshot import Device
from compiler.source import AppVersion
from margo.canonical import Slot, YamlTemplate, yaml_template
from margo.emit import deployment_document, profile_type_spelling
from margo.errors import Problem
from margo.kinds import Shape
from margo.models import ApplicationDeployment, DeploymentProfile, Parameter, ParameterTarget
from margo.parameters import EMPTY, check_immutable, validate_value
from margo.sealing import device_recipient, is_sealed

__all__ = ["INTENT_LABEL", "RenderCache", "RenderError", "Rendered", "deployment_id", "file_name",
           "plain_value_problem", "previous_values", "render"]

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


_NAMESPACE_BYTES = NAMESPACE.bytes


def deployment_id(intent_name: str, device_id: str) -> str:
    """`str(uuid.uuid5(NAMESPACE, "<intent>/<device>"))`, computed without building `UUID`
    objects (one per deployment: a full compile makes tens of thousands)."""
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + f"{intent_name}/{device_id}".encode(),
                                    usedforsecurity=False).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


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


#: `CompiledValue.reads` in a fixed order: (section, key or None for the whole section).
ReadOrder = tuple[tuple[str, str | None], ...]


@dataclass(frozen=True, slots=True)
class _ValuePlan:
    """An intent's parameter values for one application before any device is looked at:
    the defaults overridden by the intent's literals, and the expressions left to
    evaluate per device. Callers must not change `values` or `keys` (they are shared)."""

    values: dict[str, Any]  # EMPTY for a parameter without a value
    keys: dict[str, str]  # name -> value_key
    #: (name, value, what it reads of the device in a fixed order; None: all of it)
    expressions: tuple[tuple[str, CompiledValue, ReadOrder | None], ...]
    problems: tuple[Problem, ...]  # intent parameters the application does not have
    #: Parameters given as secrets (`values` holds their plaintext: memory only).
    secrets: frozenset[str] = frozenset()
    #: The intent's registry grants opened: (registry, username, password; memory only).
    grants: tuple[tuple[str, str, str], ...] = ()
    #: Secrets that could not be opened (their problem is in `problems`; no rule checks them).
    unopened: frozenset[str] = frozenset()


#: Entries a memo (templates, expression results) keeps per compile before starting over.
_MEMO_LIMIT = 50_000


class RenderCache:
    """Per-compile memo: profile plans, value plans, one device context per device, one
    validation per distinct (application, parameter, value), one document template per
    distinct (intent, application, profile, values).

    Most values are literals shared by thousands of devices; validating each distinct
    value once, and serializing each distinct document once with its device-specific
    strings left open (`margo.canonical.YamlTemplate`), keeps rendering cheap without
    skipping any check.
    """

    def __init__(self, secrets: FleetKey | None = None) -> None:
        #: The fleet key, which opens the intents' secrets (None: none configured).
        self.secrets = secrets
        self._device: tuple[str, dict[str, Any]] | None = None
        self._checked: dict[tuple[str, str, str], list[Problem]] = {}
        self._plans: dict[tuple[str, str | None], _ProfilePlan] = {}
        self._keys: dict[tuple[str, str, int], str] = {}
        self._values: dict[tuple[str, str, str], _ValuePlan] = {}
        self.templates: dict[tuple[Any, ...], YamlTemplate] = {}
        self._results: dict[tuple[Any, ...], tuple[Any, str]] = {}

    def evaluate(self, intent: Intent, name: str, compiled: CompiledValue,
                 reads: ReadOrder | None, device: Device) -> tuple[Any, str]:
        """An expression's value for `device` and its `value_key`; raises ExpressionError.

        Evaluated once per distinct input: an expression is a pure function of what it
        reads of `device` (`CompiledValue.reads`), so devices that agree on that share the
        result (``site: "{{ device.labels['zone'] }}"`` runs once per zone, not per device).
        """
        inputs = None if reads is None else _device_inputs(device, reads)
        memo = None if inputs is None else (intent.name, intent.digest, name, inputs)
        if memo is not None:
            found = self._results.get(memo)
            if found is not None:
                return found
        value = compiled.render(self.context(device))
        result = (value, value_key(value))
        if memo is not None:
            if len(self._results) >= _MEMO_LIMIT:
                self._results.clear()
            self._results[memo] = result
        return result

    def value_plan(self, intent: Intent, app: AppVersion) -> _ValuePlan:
        key = (intent.name, intent.digest, app.digest)
        plan = self._values.get(key)
        if plan is None:
            plan = self._values[key] = _value_plan(intent, app, self)
        return plan

    def remember(self, key: tuple[Any, ...], template: YamlTemplate) -> None:
        if len(self.templates) >= _MEMO_LIMIT:
            self.templates.clear()
        self.templates[key] = template

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


def _value_plan(intent: Intent, app: AppVersion, cache: RenderCache) -> _ValuePlan:
    description = app.description
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, p in description.parameters.items():
        values[name] = p.value if p.has_value else EMPTY
        keys[name] = cache.literal_key(app.digest, name, values[name])
    problems: list[Problem] = []
    expressions: list[tuple[str, CompiledValue, ReadOrder | None]] = []
    secrets: set[str] = set()
    unopened: set[str] = set()
    sensitive = description.sensitive_parameters()
    for name, compiled in intent.parameters.items():
        if name not in description.parameters:
            problems.append(intent.locate(Problem(
                ("spec", "parameters", name), f"application {description.id} "
                f"{description.version} has no parameter {name!r}",
                expected="one of " + ", ".join(sorted(description.parameters)))))
        elif compiled.is_literal and is_secret(compiled.source):
            problem = _open_secret(name, compiled.source, cache, values, keys)
            if problem is not None:
                problems.append(intent.locate(problem))
                unopened.add(name)
            secrets.add(name)
        elif (problem := plain_value_problem(name, compiled, sensitive)) is not None:
            problems.append(intent.locate(problem))
        elif compiled.is_literal:
            values[name] = compiled.source
            keys[name] = cache.literal_key(intent.digest, name, compiled.source)
        else:
            reads = compiled.reads
            expressions.append((name, compiled, None if reads is None else tuple(
                sorted(reads, key=lambda r: (r[0], r[1] is not None, r[1] or "")))))
    grants = _open_grants(intent, cache, problems)
    return _ValuePlan(values, keys, tuple(expressions), tuple(problems), frozenset(secrets),
                      grants, frozenset(unopened))


def _open_grants(intent: Intent, cache: RenderCache,
                 problems: list[Problem]) -> tuple[tuple[str, str, str], ...]:
    """The intent's registry grants with their passwords opened (problems appended)."""
    opened = []
    for index, grant in enumerate(intent.registry_credentials):
        path = ("spec", "registryCredentials", index, "password", SECRET)
        if cache.secrets is None:
            problems.append(intent.locate(Problem(path, "this intent grants registry "
                            "credentials, but no fleet key is configured to open them "
                            "(margo serve --fleet-key, docs/secrets.md)")))
            continue
        try:
            opened.append((grant.registry, grant.username,
                           cache.secrets.decrypt(grant.password)))
        except SecretError as exc:
            problems.append(intent.locate(Problem(path, str(exc))))
    return tuple(opened)


def _open_secret(name: str, secret: Mapping[str, Any], cache: RenderCache,
                 values: dict[str, Any], keys: dict[str, str]) -> Problem | None:
    """Put a secret's plaintext in `values` (its key is the ciphertext's digest, so no
    memo ever holds the plaintext as a key); a problem when it cannot be opened."""
    path = ("spec", "parameters", name, SECRET)
    if cache.secrets is None:
        values[name] = EMPTY
        return Problem(path, "this intent gives a secret, but no fleet key is configured to "
                       "open it (margo serve --fleet-key, docs/secrets.md)")
    try:
        values[name] = cache.secrets.decrypt(secret[SECRET])
    except SecretError as exc:
        values[name] = EMPTY
        return Problem(path, str(exc))
    digest = hashlib.sha256(secret[SECRET].encode("utf-8")).hexdigest()
    keys[name] = f"secret:{digest}"
    return None


def plain_value_problem(name: str, compiled: CompiledValue,
                        sensitive: frozenset[str]) -> Problem | None:
    """A sensitive parameter given in clear, or a clear value that looks sealed (a device
    would try to open it)."""
    path = ("spec", "parameters", name)
    if name in sensitive:
        return Problem(path, f"parameter {name!r} is sensitive: give it as a secret "
                       "({secret: <age file>}, margo secrets encrypt), never in clear",
                       expected="a secret")
    if compiled.is_literal and is_sealed(compiled.source):
        return Problem(path, "a value starting with margo-sealed: is reserved for values "
                       "the compiler seals")
    return None


@dataclass(frozen=True, slots=True)
class _DeviceValues:
    """Every parameter's value for one device (EMPTY when none) and its `value_key`; the
    dicts may be shared between devices: read them only."""

    values: dict[str, Any]
    keys: dict[str, str]
    problems: list[Problem]  # the value plan's, and expressions that failed on the device
    #: Parameters whose value could not be worked out (an expression that failed, a secret
    #: that could not be opened): already a problem, so no rule or immutability check
    #: reports their EMPTY once more ("a value is required").
    failed: frozenset[str]


def _values(intent: Intent, app: AppVersion, device: Device,
            cache: RenderCache) -> _DeviceValues:
    plan = cache.value_plan(intent, app)
    problems = list(plan.problems)
    if not plan.expressions:
        return _DeviceValues(plan.values, plan.keys, problems, plan.unopened)
    values, keys = dict(plan.values), dict(plan.keys)
    failed = set(plan.unopened)
    for name, compiled, reads in plan.expressions:
        try:
            values[name], keys[name] = cache.evaluate(intent, name, compiled, reads, device)
        except ExpressionError as exc:
            values[name] = EMPTY
            failed.add(name)
            problems.append(intent.locate(Problem(
                ("spec", "parameters", name), f"on device {device.id}: {exc}")))
    return _DeviceValues(values, keys, problems, frozenset(failed))


_SECTION_READERS: dict[str, Any] = {
    "properties": lambda device: device.properties,
    "labels": lambda device: device.labels,
    "extensions": lambda device: device.capabilities.extensions,
}


def _plain_mapping(value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"not JSON data: {type(value).__name__}")


_ABSENT: tuple[str] = ("absent",)  # a key the device does not have (not the same as null)


def _json_part(value: Any) -> tuple[str, str] | None:
    try:
        return ("json", json.dumps(value, sort_keys=True, allow_nan=False,
                                   default=_plain_mapping))
    except (TypeError, ValueError):
        return None


def _device_inputs(device: Device, reads: ReadOrder) -> tuple[Any, ...] | None:
    """What an expression reads of this device (`reads` in a fixed order), as a key that
    differs whenever the data differs, types included (1, 1.0, true and "1"; -0.0 and
    0.0); None if it is not plain JSON data (the expression is then simply evaluated)."""
    parts: list[Any] = []
    for section, key in reads:
        if section == "id":
            parts.append(device.id)
            continue
        data = _SECTION_READERS[section](device)
        if key is not None and key not in data:
            parts.append(_ABSENT)
            continue
        value = data if key is None else data[key]
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            parts.append((kind, value))  # exact types: (int, 1) != (bool, True)
        elif kind is float:
            parts.append((kind, repr(value)))  # repr tells -0.0 from 0.0
        else:
            part = _json_part(value)
            if part is None:
                return None
            parts.append(part)
    return tuple(parts)


def _check_values(found: _DeviceValues, app: AppVersion, plan: _ProfilePlan, device: Device,
                  previous_values: Mapping[str, Any] | None, intent: Intent,
                  cache: RenderCache, *, checked: bool = False) -> list[Problem]:
    """Problems with the values: configuration rules (unless `checked`, i.e. these exact
    values passed them before) and `immutable` settings against `previous_values`; values
    that could not be worked out (`_DeviceValues.failed`) are not checked."""
    problems: list[Problem] = []
    values, keys = found.values, found.keys
    for name, rule in () if checked else plan.rules:
        if name not in values or name in found.failed:
            continue
        for problem in cache.check(app, name, keys[name], values[name], rule):
            problems.append(intent.locate(Problem(
                problem.path, f"on device {device.id}: {problem.message}",
                expected=problem.expected, found=problem.found)))
    if previous_values is not None and plan.immutable:
        after = {n: v for n, v in values.items() if v is not EMPTY}
        immutable = [n for n in plan.immutable if n not in found.failed]
        for problem in check_immutable(previous_values, after, immutable,
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
    worked_out = _values(intent, app, device, cache)
    values, keys, problems = worked_out.values, worked_out.keys, list(worked_out.problems)
    hidden = cache.value_plan(intent, app).secrets  # (most intents: none, and no grants)
    secrets = sorted(n for n in hidden if n in plan.targets and values[n] is not EMPTY)
    items: list[SealItem] = []
    before = previous_values(previous)
    shape = _output_shape(intent, device)
    problems += _shape_problems(intent, plan.profile, device, shape)
    if hidden or intent.registry_credentials:
        items, before, found = _to_seal(intent, app, device, values, secrets, before, cache)
        problems += found
    # Everything the document holds but the two device-specific strings (its id and the
    # device id): the intent (name, namespace: its digest), the shape, the application, the
    # profile and every parameter's value (also those the configuration rules check that
    # do not reach this profile: a known key means the rules passed these exact values).
    key = (intent.name, intent.digest, shape, app.digest, profile.id, tuple(keys.values()))
    template = cache.templates.get(key)
    found = _check_values(worked_out, app, plan, device, before, intent, cache,
                          checked=template is not None)
    problems += redacted(found, hidden, device.id) if hidden and found else found
    if problems:
        raise RenderError(problems)
    slots = {"id": deployment_id(intent.name, device.id), "device": device.id}
    if items and cache.secrets is not None:
        slots.update(seal_for(cache.secrets, device.id, device.capabilities.extensions,
                              items, previous_envelopes(previous)))
    if template is None:
        template = _template(intent, app, profile.id, plan, values, keys, secrets, shape)
        cache.remember(key, template)
    return Rendered(file_name(intent.name), template.fill(slots))


#: Where each output shape holds the deployment id and the device id (Oct-2024 has none).
_SLOT_PATHS: dict[str, dict[str, tuple[str, ...]]] = {
    Shape.RC3: {"id": ("id",), "device": ("metadata", "deviceId")},
    Shape.RC2: {"id": ("id",), "device": ("metadata", "deviceId")},
    Shape.OCT_2024: {"id": ("metadata", "annotations", "id")}}


def _output_shape(intent: Intent, device: Device) -> str:
    """The shape of the device's document of `intent`: the one the intent forces
    (`outputShape`), else the generation the device speaks."""
    return intent.output_shape or device.generation


def _forced(intent: Intent) -> str:
    """How a shape problem's message names where the shape came from."""
    if intent.output_shape is None:
        return "the device speaks"
    return "this intent's outputShape asks for"


def _shape_problems(intent: Intent, profile: DeploymentProfile, device: Device,
                    shape: str) -> list[Problem]:
    """What the device's document cannot hold in `shape`: a profile type that generation
    does not have (rc.2 and Oct-2024 know helm and compose only)."""
    if profile_type_spelling(shape, profile.type) is not None:
        return []
    path = ("spec", "outputShape") if intent.output_shape else ("spec", "application")
    return [intent.locate(Problem(path, f"on device {device.id}: the profile is of type "
                                  f"{profile.type}, which {shape} documents cannot hold "
                                  f"({_forced(intent)} {shape})",
                                  expected="a helm or compose profile, or an rc.3 device"))]


def _to_seal(intent: Intent, app: AppVersion, device: Device, values: Mapping[str, Any],
             secrets: list[str], before: dict[str, Any] | None, cache: RenderCache,
             ) -> tuple[list[SealItem], dict[str, Any] | None, list[Problem]]:
    """What this device's document seals (its secret parameters, its registry grants),
    `before` (the device's current values, to check `immutable` settings against) with its
    sealed ones compared by mac, and why the device cannot have them (no key; an Oct-2024
    document has no place for registry credentials)."""
    grants = cache.value_plan(intent, app).grants
    items = [parameter_item(n, values[n]) for n in secrets]
    items += [grant_item(registry, password) for registry, _, password in grants]
    problems: list[Problem] = []
    if intent.registry_credentials and _output_shape(intent, device) == Shape.OCT_2024:
        problems.append(intent.locate(Problem(("spec", "registryCredentials"), "on device "
                        f"{device.id}: an Oct-2024 document has no place for registry "
                        f"credentials (its spec takes no extensions; {_forced(intent)} "
                        "oct-2024): set outputShape rc.2 or rc.3 if the device's client reads "
                        "that shape")))
    if items and cache.secrets is not None:
        before = compare_previous(cache.secrets, device.id, values, secrets, before)
        if device_recipient(device.capabilities.extensions) is None:
            problems.append(intent.locate(no_key_problem(device.id, items)))
    return items, before, problems


def _template(intent: Intent, app: AppVersion, profile_id: str | None, plan: _ProfilePlan,
              values: Mapping[str, Any], keys: Mapping[str, str],
              secrets: list[str], shape: str) -> YamlTemplate:
    """The document of (intent, application, profile, values) for any device, with its id,
    device id and sealed values open (a secret's plaintext never enters the template)."""
    parameters = {name: Parameter(name, targets, Slot(parameter_item(name, "").slot)
                                  if name in secrets else values[name], True)
                  for name, targets in plan.targets.items() if values[name] is not EMPTY}
    grants = [{"registry": g.registry, "username": g.username,
               "password": Slot(grant_item(g.registry, "").slot)}
              for g in intent.registry_credentials]
    deployment = ApplicationDeployment(
        id="", name=intent.name,
        namespace=intent.namespace or _default_namespace(app.description.id),
        application_id=app.description.id, profile=plan.profile, parameters=parameters,
        device_id="", labels={INTENT_LABEL: intent.name},
        extensions={GRANTS[0]: {GRANTS[1]: grants}} if grants else {})
    spec_key = (app.digest, profile_id, tuple((name, keys[name]) for name in parameters))
    document = deployment_document(deployment, shape=shape,
                                   spec_key=None if secrets or grants else spec_key)
    for name, path in _SLOT_PATHS[shape].items():
        *parents, last = path
        holder = document
        for part in parents:
            holder = holder[part]
        holder[last] = Slot(name)
    return yaml_template(document)
