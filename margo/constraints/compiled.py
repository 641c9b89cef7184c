"""The compiled form: checks, rules and characteristics, evaluated against many devices.

Every dialect compiles into one of three shapes: a `Check` (capacity, legacy, cluster: must
hold), a `Rule` (eligibilityRules: some must hold) or a `CharacteristicRule` (the draft's
deviceCharacteristics: some must hold). `CompiledConstraints` combines them and knows
nothing else of any dialect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from margo.constraints.characteristics import CharacteristicRule
from margo.constraints.results import ELIGIBLE, Failure, MatchResult
from margo.constraints.rules import Rule
from margo.constraints.vocabulary import EMPTY

__all__ = ["Check", "CompiledConstraints"]


class Check(Protocol):
    """A requirement every matching device meets (capacity, legacy and cluster dialects)."""

    def passes(self, properties: Mapping[str, Any]) -> bool:
        """The verdict alone, without allocating an explanation."""
        ...

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        """Every way the device misses this requirement (empty when it meets it)."""
        ...


@dataclass(frozen=True, slots=True)
class CompiledConstraints:
    """Validated, pre-parsed constraints; immutable and safe to share across threads.

    `evaluate` first runs a boolean-only pass (the common "eligible" answer costs no
    allocations) and builds explanations only for devices that do not match.
    """

    checks: tuple[Check, ...]
    rules: tuple[Rule, ...]
    characteristics: tuple[CharacteristicRule, ...] = ()

    def _passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for check in self.checks:
            if not check.passes(properties):
                return False
        if self.rules and not any(rule.passes(properties, labels) for rule in self.rules):
            return False
        return not self.characteristics or any(
            rule.passes(properties, labels) for rule in self.characteristics)

    @property
    def reads_properties(self) -> bool:
        """Whether a verdict can depend on the device's properties at all: with labels-only
        rules it cannot, and callers may pass None instead of building a matching view."""
        return bool(self.checks or self.characteristics
                    or any(rule.properties for rule in self.rules))

    def is_eligible(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> bool:
        """The verdict alone, for callers that explain only on demand (fleet compiles)."""
        return self._passes(EMPTY if properties is None else properties,
                            EMPTY if labels is None else labels)

    def evaluate(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> MatchResult:
        """Match one device: capacity and cluster requirements AND (no rules OR some rule) AND
        (no draft characteristics OR some characteristics entry), explaining every miss.

        `properties` is the device's matching view (`matching_view`); plain `properties`
        work too, but then extensions and cluster requirements see nothing (and fail)."""
        properties = EMPTY if properties is None else properties
        labels = EMPTY if labels is None else labels
        if self._passes(properties, labels):
            return ELIGIBLE
        failures: list[Failure] = []
        for check in self.checks:
            failures.extend(check.explain(properties))
        for group in (self.rules, self.characteristics):
            group_failures: list[Failure] = []
            for rule in group:
                missed = rule.explain(properties, labels)
                if not missed:
                    group_failures = []
                    break
                group_failures.extend(missed)
            failures.extend(group_failures)
        return MatchResult(False, tuple(failures))
