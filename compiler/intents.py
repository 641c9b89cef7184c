"""Deployment intents: "run this application, configured like this, on these devices".

An intent is a small document kind of ours (`kind: DeploymentIntent`, see
`docs/intents.md`), one per file `deployments/<name>.yaml`. Loading validates it against
its JSON Schema, compiles its target selectors, extra constraints and parameter
expressions once, and keeps its source so any later problem (an expression that fails on
one device) can still be reported with file, line and path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import fastjsonschema
from fastjsonschema import JsonSchemaException
from jsonschema import Draft202012Validator

from compiler.expressions import CompiledValue, ExpressionError, compile_value
from compiler.rollout import PERCENT, POSITIVE_PERCENT, RolloutSpec, Wave
from compiler.secrets import SECRET, is_secret, secret_problem
from margo.constraints import CompiledConstraints, compile_constraints
from margo.digests import data_digest
from margo.errors import DocumentError, Path, Problem, short_repr
from margo.identifiers import DEVICE_ID as DEVICE_ID_NAME
from margo.identifiers import DNS_LABEL as DNS_LABEL_NAME
from margo.identifiers import REGISTRY_HOST
from margo.kinds import GENERATIONS
from margo.loading import LoadedDocument
from margo.models import ProfileType
from margo.schemas import python_patterns
from margo.schemas.source import APP_ID, CONSTRAINT_DEFS, DEVICE_ID, closed
from margo.validation import explain_schema_errors, gate_problems

__all__ = ["INTENT_API_VERSION", "Intent", "RegistryGrant", "intent_schema", "load_intent",
           "parse_duration"]

INTENT_API_VERSION = "margo-gitops.dev/v1alpha1"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DURATION = r"^(?=\d)(\d+d)?(\d+h)?(\d+m)?(\d+s)?$"
_DURATION_PARTS = re.compile(r"(\d+)([dhms])")
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
#: The fields of an intent's spec that `compiler.placement.place` reads.
_PLACEMENT_FIELDS = ("application", "profile", "targets", "constraints", "priority",
                     "overcommit")


@cache
def intent_schema() -> dict[str, Any]:
    """JSON Schema of a DeploymentIntent (2020-12)."""
    rule = closed({"propertySelector": {"$ref": "#/$defs/selector"},
                   "labelSelector": {"$ref": "#/$defs/selector"}}, minProperties=1)
    spec = closed({
        "application": closed({"id": {"type": "string", "pattern": APP_ID},
                               "version": {"type": ["string", "number"]}}, ["id"]),
        "profile": closed({"id": {"type": "string", "minLength": 1},
                           "type": {"enum": [str(t) for t in ProfileType]}}, maxProperties=1),
        "namespace": {"type": "string", "pattern": DNS_LABEL},
        "parameters": {"type": "object"},
        "targets": closed({
            "devices": {"type": "array", "uniqueItems": True,
                        "items": {"type": "string", "pattern": DEVICE_ID}},
            "selectors": {"type": "array", "items": rule},
        }),
        "constraints": {"$ref": "#/$defs/deviceConstraints"},
        "gracePeriod": {"type": "string", "pattern": DURATION},
        "priority": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
        "overcommit": {"type": "boolean"},
        # Registries the devices may pull from with these credentials (docs/secrets.md).
        "registryCredentials": {"type": "array", "items": closed({
            "registry": {"type": "string", "pattern": REGISTRY_HOST},
            "username": {"type": "string", "minLength": 1},
            "password": closed({SECRET: {"type": "string"}}, [SECRET]),
        }, ["registry", "username", "password"])},
        # Absent: each device gets the shape of the generation it speaks (docs/server.md).
        "outputShape": {"enum": list(GENERATIONS)},
        "rollout": closed({
            "waves": {"type": "array", "minItems": 1, "items": closed({
                "name": {"type": "string", "pattern": DNS_LABEL},
                "devices": {"oneOf": [{"type": "integer", "minimum": 1},
                                      {"type": "string", "pattern": PERCENT}]},
                "selectors": {"type": "array", "minItems": 1, "items": rule},
            }, ["name"])},
            "soak": {"type": "string", "pattern": DURATION},
            "waveDeadline": {"type": "string", "pattern": DURATION},
            "maxFailed": {"oneOf": [{"type": "integer", "minimum": 0},
                                    {"type": "string", "pattern": PERCENT}]},
            # At least one device must be allowed to be unavailable, or none could move.
            "maxUnavailable": {"oneOf": [{"type": "integer", "minimum": 1},
                                         {"type": "string", "pattern": POSITIVE_PERCENT}]},
        }, ["waves"]),
    }, ["application"])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "margo-gitops DeploymentIntent",
        **closed({
            "apiVersion": {"const": INTENT_API_VERSION},
            "kind": {"const": "DeploymentIntent"},
            "metadata": closed({"name": {"type": "string", "pattern": DNS_LABEL},
                                "description": {"type": "string"},
                                "labels": {"type": "object",
                                           "additionalProperties": {"type": "string"}}},
                               ["name"]),
            "spec": spec,
        }, ["apiVersion", "kind", "metadata", "spec"]),
        "$defs": CONSTRAINT_DEFS,
    }


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(python_patterns(intent_schema()))


@cache
def fast_intent_check() -> Callable[[Any], Any]:
    """A compiled yes/no check of `intent_schema` (fastjsonschema, as `margo.schemas` does
    for the standard's documents): only a gate, `_validator` explains a no. A test holds the
    two to agreeing on every intent we can think of."""
    schema = dict(intent_schema())
    # The intent schema uses no keyword whose meaning differs between draft-07 and 2020-12.
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    return fastjsonschema.compile(schema)


def _schema_problems(loaded: LoadedDocument) -> list[Problem]:
    try:
        fast_intent_check()(loaded.value)
        return []
    except JsonSchemaException as refusal:
        found = (explain_schema_errors(_validator(), loaded.value)
                 or gate_problems(refusal, loaded.value))
        return [loaded.locate(p, at_key=at_key) for p, at_key in found]


def parse_duration(text: str) -> int:
    """`1d2h30m10s` style durations in seconds."""
    return sum(int(n) * _SECONDS[unit] for n, unit in _DURATION_PARTS.findall(text))


@dataclass(frozen=True, slots=True)
class RegistryGrant:
    """One `registryCredentials` entry: a registry host, a user name, and the password as
    an armored age file to the fleet key (opened only while compiling)."""

    registry: str
    username: str
    password: str


@dataclass(frozen=True, slots=True)
class Intent:
    """A validated, compiled intent."""

    name: str
    file: str
    application_id: str
    application_version: str | None
    profile_id: str | None
    profile_type: ProfileType | None
    namespace: str | None
    parameters: Mapping[str, CompiledValue]
    devices: frozenset[str] | None  # None: no explicit list
    selector: CompiledConstraints | None  # None: no selectors
    constraints: CompiledConstraints | None
    grace_seconds: int
    #: New placements on a device are decided highest priority first, then by name (what
    #: capacity accounting leaves for the next one depends on it).
    priority: int
    #: Placed without capacity accounting, and not counted against other placements.
    overcommit: bool
    #: The shape every device's document is written in; None: each device's own generation
    #: (`compiler.snapshot.Device.generation`).
    output_shape: str | None
    digest: str
    #: Digest of what decides which devices get a deployment and with which profile (the
    #: application named, profile, targets, constraints): an intent edited elsewhere
    #: (parameters, namespace, grace period...) places every device as before.
    placement_digest: str
    document: LoadedDocument = field(repr=False, compare=False)
    #: Staged rollout of changes (`compiler.rollout`); None: every device at once.
    rollout: RolloutSpec | None = None
    #: Digest of the intent without its rollout: a new one is a change to roll out (an edit
    #: of the rollout itself is not).
    rollout_digest: str = ""
    #: Registry credentials granted to the devices, their passwords still secrets.
    registry_credentials: tuple[RegistryGrant, ...] = ()

    @property
    def targets_everything(self) -> bool:
        return self.devices is None and self.selector is None

    def targets(self, device_id: str, properties: Mapping[str, Any],
                labels: Mapping[str, Any]) -> bool:
        """Whether the intent's targets select a device (eligibility is decided later)."""
        if self.targets_everything:
            return True
        if self.devices is not None and device_id in self.devices:
            return True
        return self.selector is not None and self.selector.is_eligible(properties, labels)

    def locate(self, problem: Problem) -> Problem:
        return self.document.locate(problem)


def _compile_parameters(parameters: Mapping[str, Any]) -> tuple[dict[str, CompiledValue],
                                                                  list[Problem]]:
    compiled: dict[str, CompiledValue] = {}
    problems: list[Problem] = []
    for name, value in parameters.items():
        if is_secret(value) and (problem := secret_problem(value)) is not None:
            problems.append(Problem(("spec", "parameters", name, SECRET), problem))
            continue
        try:
            compiled[name] = compile_value(value)
        except ExpressionError as exc:
            problems.append(Problem(("spec", "parameters", name), f"invalid expression: {exc}",
                                    found=repr(value)))
    return compiled, problems


def _compile_optional(raw: Any, path: Path) -> tuple[CompiledConstraints | None,
                                                                 list[Problem]]:
    if raw is None:
        return None, []
    try:
        return compile_constraints(raw, path=path), []
    except DocumentError as exc:
        return None, exc.problems


def _compile_rollout(raw: Any) -> tuple[RolloutSpec | None, list[Problem]]:
    if raw is None:
        return None, []
    waves: list[Wave] = []
    problems: list[Problem] = []
    names: set[str] = set()
    for index, wave in enumerate(raw["waves"]):
        path = ("spec", "rollout", "waves", index)
        if wave["name"] in names:
            problems.append(Problem((*path, "name"), f"wave {wave['name']!r} is named twice"))
        names.add(wave["name"])
        selectors = wave.get("selectors")
        if selectors is not None and "devices" in wave:
            problems.append(Problem(path, "a wave takes either devices (a count or a "
                                    "percentage) or selectors, not both"))
        selector, found = _compile_optional(
            {"eligibilityRules": selectors} if selectors is not None else None, (*path,
                                                                                  "selectors"))
        problems += [dataclasses.replace(p, path=_without_rules_key(p.path, 5))
                     for p in found]
        devices = wave.get("devices")
        waves.append(Wave(wave["name"], devices if isinstance(devices, int) else None,
                          int(devices[:-1]) if isinstance(devices, str) else None, selector))
    failed = raw.get("maxFailed", 0)
    unavailable = raw.get("maxUnavailable")
    return RolloutSpec(
        tuple(waves), soak_seconds=parse_duration(raw.get("soak", "0s")),
        deadline_seconds=parse_duration(raw.get("waveDeadline", "1h")),
        max_failed=failed if isinstance(failed, int) else None,
        max_failed_percent=int(failed[:-1]) if isinstance(failed, str) else None,
        # (JSON Schema counts 2.0 as an integer: keep it a cap, not "no cap".)
        max_unavailable=int(unavailable) if isinstance(unavailable, int | float) else None,
        max_unavailable_percent=int(unavailable[:-1]) if isinstance(unavailable, str)
        else None), problems


def _registry_grants(raw: Any) -> tuple[tuple[RegistryGrant, ...], list[Problem]]:
    """The intent's registry credentials; a registry named twice or a password that is no
    age file is a problem (the shape is checked without any key)."""
    grants: list[RegistryGrant] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        path = ("spec", "registryCredentials", index)
        if entry["registry"] in seen:
            problems.append(Problem((*path, "registry"), f"registry {entry['registry']!r} "
                                    "is granted twice"))
        seen.add(entry["registry"])
        problem = secret_problem(entry["password"])
        if problem is not None:
            problems.append(Problem((*path, "password", SECRET), problem))
            continue
        grants.append(RegistryGrant(entry["registry"], entry["username"],
                                    entry["password"][SECRET]))
    return tuple(grants), problems


def _without_rules_key(path: tuple[str | int, ...], at: int = 3) -> tuple[str | int, ...]:
    if path[at:at + 1] == ("eligibilityRules",):
        return path[:at] + path[at + 1:]
    return path


def _name_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """Names the intent hands on that would not survive where they go: listed device ids
    beyond `margo.identifiers.DEVICE_ID`'s bounds (no device can have them: the server
    refuses such ids), and, without a `namespace`, an application id whose first 63
    characters (what `compiler.render` names the namespace after) are no DNS label."""
    problems = []
    for index, device_id in enumerate(spec.get("targets", {}).get("devices", ())):
        problem = DEVICE_ID_NAME.problem(device_id)
        if problem is not None:
            problems.append(Problem(("spec", "targets", "devices", index), problem,
                                    found=short_repr(device_id)))
    app_id = spec["application"]["id"]
    if "namespace" not in spec and DNS_LABEL_NAME.problem(app_id[:63].rstrip("-")):
        problems.append(Problem(("spec", "application", "id"), "without spec.namespace the "
                                "namespace is named after the application id, and this one "
                                "gives no DNS label: set spec.namespace",
                                expected="an id starting with a letter or digit",
                                found=short_repr(app_id)))
    return problems


def load_intent(loaded: LoadedDocument, *, expected_name: str | None = None) -> Intent:
    """Validate and compile one intent; raise `DocumentError` with located problems."""
    doc = loaded.value
    problems = _schema_problems(loaded)
    if problems:
        raise DocumentError(problems)
    spec = doc["spec"]
    name = doc["metadata"]["name"]
    found: list[Problem] = []
    if expected_name is not None and name != expected_name:
        found.append(Problem(("metadata", "name"), f"the intent in {expected_name}.yaml must be "
                             f"named {expected_name!r}", expected=expected_name, found=name))
    targets = spec.get("targets", {})
    selectors = targets.get("selectors")
    selector, selector_problems = _compile_optional(
        {"eligibilityRules": selectors} if selectors is not None else None,
        ("spec", "targets", "selectors"))
    # The selectors were compiled as eligibility rules: point at the intent's own field.
    selector_problems = [dataclasses.replace(p, path=_without_rules_key(p.path))
                         for p in selector_problems]
    constraints, constraint_problems = _compile_optional(spec.get("constraints"),
                                                         ("spec", "constraints"))
    parameters, parameter_problems = _compile_parameters(spec.get("parameters", {}))
    rollout, rollout_problems = _compile_rollout(spec.get("rollout"))
    grants, grant_problems = _registry_grants(spec.get("registryCredentials", ()))
    found += selector_problems + constraint_problems + parameter_problems + rollout_problems
    found += grant_problems
    found += _name_problems(spec)
    if found:
        raise DocumentError([loaded.locate(p) for p in found])
    profile = spec.get("profile", {})
    version = spec["application"].get("version")
    return Intent(
        name=name,
        file=loaded.file or name,
        application_id=spec["application"]["id"],
        application_version=None if version is None else str(version),
        profile_id=profile.get("id"),
        profile_type=ProfileType(profile["type"]) if "type" in profile else None,
        namespace=spec.get("namespace"),
        parameters=parameters,
        devices=(frozenset(targets.get("devices", ()))
                 if "devices" in targets or selectors == [] else None),
        selector=selector if selectors else None,  # an empty list selects nothing
        constraints=constraints,
        grace_seconds=parse_duration(spec["gracePeriod"]) if "gracePeriod" in spec else 0,
        priority=int(spec.get("priority", 0)),
        overcommit=bool(spec.get("overcommit", False)),
        output_shape=spec.get("outputShape"),
        digest=data_digest(doc),
        placement_digest=data_digest({key: spec[key] for key in _PLACEMENT_FIELDS
                                      if key in spec}),
        rollout=rollout,
        rollout_digest=data_digest({**doc, "spec": {k: v for k, v in spec.items()
                                                    if k != "rollout"}}),
        document=loaded,
        registry_credentials=grants,
    )
