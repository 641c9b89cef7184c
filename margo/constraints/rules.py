"""Eligibility rules (AND of property and label expressions) and the draft device
characteristics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from margo.constraints.operators import _Expression
from margo.constraints.results import Failure
from margo.constraints.vocabulary import _MISSING, DEVICE_CHARACTERISTIC, EXTENSION

__all__ = []


@dataclass(frozen=True, slots=True)
class _Rule:
    """One eligibility rule: every property and every label expression must hold."""

    index: int
    properties: tuple[_Expression, ...]
    labels: tuple[_Expression, ...]

    def passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                if not expr.test(expr.lookup(doc)):
                    return False
        return True

    def explain(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> list[Failure]:
        failures = []
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                actual = expr.lookup(doc)
                if not expr.test(actual):
                    failures.append(self._failure(expr, actual))
        return failures

    def _failure(self, expr: _Expression, actual: Any) -> Failure:
        message = f"rule {self.index}: {expr.text} but {expr.why_not(actual)}"
        return Failure("eligibility", expr.key, expr.operator, expr.required,
                       None if actual is _MISSING else actual, self.index, message)


def _characteristic(view: Mapping[str, Any], labels: Mapping[str, Any], key: str) -> Any:
    """The draft's device side, mapped onto an rc.3 report: `DEVICE_CHARACTERISTIC` is the whole
    matching view; then characteristics the device reports in the draft's shape under
    `x-margo-gitops-extensions.deviceCharacteristics` ([{key, properties}]); then labels (a
    label is a characteristic whose value is the label value). `_MISSING` when none has it."""
    if key == DEVICE_CHARACTERISTIC:
        return view
    extension = view.get(EXTENSION)
    reported = extension.get("deviceCharacteristics") if isinstance(extension, Mapping) else None
    if isinstance(reported, list | tuple):
        for entry in reported:
            if isinstance(entry, Mapping) and entry.get("key") == key:
                return entry.get("properties", _MISSING)
    return labels.get(key, _MISSING)


@dataclass(frozen=True, slots=True)
class _CharacteristicExpression:
    """A draft matchExpression: find the characteristic `key`, then test `expression` (whose
    lookup is the `property` pointer, or the whole value when there is none)."""

    key: str
    property: str | None
    expression: _Expression

    def actual(self, view: Mapping[str, Any], labels: Mapping[str, Any]) -> tuple[Any, Any]:
        found = _characteristic(view, labels, self.key)
        return found, self.expression.lookup(found)

    def why_not(self, found: Any, actual: Any) -> str:
        if found is _MISSING:
            return f"the device has no characteristic or label {self.key!r}"
        return self.expression.why_not(actual)


@dataclass(frozen=True, slots=True)
class _CharacteristicRule:
    """One `deviceCharacteristics` entry of the draft: every expression must hold."""

    index: int
    expressions: tuple[_CharacteristicExpression, ...]

    def passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for item in self.expressions:
            expr = item.expression
            if not expr.test(expr.lookup(_characteristic(properties, labels, item.key))):
                return False
        return True

    def explain(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> list[Failure]:
        failures = []
        for item in self.expressions:
            found, actual = item.actual(properties, labels)
            if item.expression.test(actual):
                continue
            message = (f"deviceCharacteristics {self.index} (draft): {item.expression.text} but "
                       f"{item.why_not(found, actual)}")
            key = item.key if item.property is None else f"{item.key} {item.property}"
            failures.append(Failure("characteristics", key, item.expression.operator,
                                    item.expression.required,
                                    None if actual is _MISSING else actual, self.index, message))
        return failures
