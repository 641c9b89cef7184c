"""The orchestrator: a profile's constraint documents into `CompiledConstraints`.

It reads the top level of `deviceConstraints` (and our extension's two keys) and hands each
clause to the dialect module that compiles and checks it:

    capacityRequirements                       capacity
    eligibilityRules                           rules (matchExpressions: expressions)
    x-margo-gitops-extensions.cluster          cluster (nodes, version, features)
    x-margo-gitops-extensions.deviceCharacteristics   characteristics (the draft)
    requiredResources (the older block)        required_resources

All of them record into one `ProblemCollector`, so a document reports every mistake at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from margo.constraints.capacity import CAPACITY_FIELDS, compile_capacity
from margo.constraints.characteristics import CharacteristicRule, compile_characteristic_rules
from margo.constraints.cluster import compile_cluster
from margo.constraints.compiled import Check, CompiledConstraints
from margo.constraints.problems import ProblemCollector
from margo.constraints.required_resources import (
    compile_required_resources,
    locate_required_resources,
)
from margo.constraints.results import MatchResult
from margo.constraints.rules import Rule, compile_rules
from margo.constraints.vocabulary import EXTENSION
from margo.errors import DocumentError, Path

__all__ = ["compile_constraints", "match"]

_DEVICE_CONSTRAINT_FIELDS: Final = ("capacityRequirements", "eligibilityRules")
_EXTENSION_FIELDS: Final = ("cluster", "deviceCharacteristics")


def _compile_extension(log: ProblemCollector, value: Any,
                       path: Path) -> tuple[list[Check], list[CharacteristicRule]]:
    """`deviceConstraints["x-margo-gitops-extensions"]`: our namespace, so unknown keys are
    errors here (a typo must not drop a requirement); other vendors' are ignored."""
    doc = log.fields_of(value, path, EXTENSION, _EXTENSION_FIELDS)
    if doc is None:
        return [], []
    checks = compile_cluster(log, doc["cluster"], (*path, "cluster")) if "cluster" in doc else []
    characteristics = (compile_characteristic_rules(log, doc["deviceCharacteristics"],
                                                    (*path, "deviceCharacteristics"))
                       if "deviceCharacteristics" in doc else [])
    return checks, characteristics


def _compile_device_constraints(
    log: ProblemCollector, value: Any, path: Path
) -> tuple[list[Check], list[Rule], list[CharacteristicRule]]:
    """`deviceConstraints`: capacity, rules, and our extension (other `x-...-extensions`
    keys belong to other vendors and are ignored)."""
    checks: list[Check] = []
    rules: list[Rule] = []
    characteristics: list[CharacteristicRule] = []
    doc = log.fields_of(value, path, "deviceConstraints", _DEVICE_CONSTRAINT_FIELDS,
                        extensions=True)
    if doc is None:
        return checks, rules, characteristics
    if "capacityRequirements" in doc:
        checks += compile_capacity(log, doc["capacityRequirements"],
                                   (*path, "capacityRequirements"), "capacity",
                                   CAPACITY_FIELDS, "capacityRequirements")
    if "eligibilityRules" in doc:
        rules = compile_rules(log, doc["eligibilityRules"], (*path, "eligibilityRules"))
    if EXTENSION in doc:
        cluster_checks, characteristics = _compile_extension(log, doc[EXTENSION],
                                                             (*path, EXTENSION))
        checks += cluster_checks
    return checks, rules, characteristics


def compile_constraints(
    device_constraints: Mapping[str, Any] | None = None,
    *,
    required_resources: Mapping[str, Any] | None = None,
    path: Path = (),
    required_resources_path: Path | None = None,
) -> CompiledConstraints:
    """Validate and pre-parse a profile's constraints for fast repeated evaluation.

    `path` locates `device_constraints` in its document; every `Problem` in the raised
    `DocumentError` is `path` plus the offending clause's keys and indices. Problems in
    `required_resources` are located at `required_resources_path`; by default that is the
    sibling `requiredResources` of a `path` ending in `deviceConstraints`, `path` itself when it
    ends in `requiredResources`, else `path + ("requiredResources",)`.
    """
    log = ProblemCollector()
    checks: list[Check] = []
    rules: list[Rule] = []
    characteristics: list[CharacteristicRule] = []
    if device_constraints is not None:
        checks, rules, characteristics = _compile_device_constraints(log, device_constraints,
                                                                     path)
    if required_resources is not None:
        legacy_path = (
            locate_required_resources(path)
            if required_resources_path is None
            else required_resources_path
        )
        checks += compile_required_resources(log, required_resources, legacy_path)
    if log.problems:
        raise DocumentError(log.problems)
    return CompiledConstraints(tuple(checks), tuple(rules), tuple(characteristics))


def match(
    device_constraints: Mapping[str, Any] | None,
    properties: Mapping[str, Any] | None,
    labels: Mapping[str, Any] | None,
    *,
    required_resources: Mapping[str, Any] | None = None,
) -> MatchResult:
    """Compile and evaluate in one go; compile once yourself when matching many devices."""
    compiled = compile_constraints(device_constraints, required_resources=required_resources)
    return compiled.evaluate(properties, labels)

