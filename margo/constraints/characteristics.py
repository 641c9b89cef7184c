"""The draft dialect (`deviceConstraints["x-margo-gitops-extensions"].deviceCharacteristics`):
the schema-agnostic matching draft's characteristics (key, optional property pointer, the
operators including `GtEq`/`LtEq`), OR across entries and AND within one; compiled and
checked here, explained in the same words as the rc.3 expressions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from margo.constraints.expressions import (
    Expression,
    build_expression,
    compile_item_selector,
    compile_operator,
    compile_values,
    pointer_text,
)
from margo.constraints.pointers import identity, parse_pointer, pointer_lookup
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure, kind_of
from margo.constraints.vocabulary import DEVICE_CHARACTERISTIC, EXTENSION, MISSING, Lookup
from margo.errors import Path

__all__ = ["CharacteristicExpression", "CharacteristicRule", "compile_characteristic_rules"]

_CHARACTERISTIC_RULE_FIELDS: Final = ("matchExpressions",)
_CHARACTERISTIC_FIELDS: Final = ("key", "property", "operator", "values", "itemSelector")


def _characteristic(view: Mapping[str, Any], labels: Mapping[str, Any], key: str) -> Any:
    """The draft's device side, mapped onto an rc.3 report: `DEVICE_CHARACTERISTIC` is the whole
    matching view; then characteristics the device reports in the draft's shape under
    `x-margo-gitops-extensions.deviceCharacteristics` ([{key, properties}]); then labels (a
    label is a characteristic whose value is the label value). `MISSING` when none has it."""
    if key == DEVICE_CHARACTERISTIC:
        return view
    extension = view.get(EXTENSION)
    reported = extension.get("deviceCharacteristics") if isinstance(extension, Mapping) else None
    if isinstance(reported, list | tuple):
        for entry in reported:
            if isinstance(entry, Mapping) and entry.get("key") == key:
                return entry.get("properties", MISSING)
    return labels.get(key, MISSING)


@dataclass(frozen=True, slots=True)
class CharacteristicExpression:
    """A draft matchExpression: find the characteristic `key`, then test `expression` (whose
    lookup is the `property` pointer, or the whole value when there is none)."""

    key: str
    property: str | None
    expression: Expression

    def actual(self, view: Mapping[str, Any], labels: Mapping[str, Any]) -> tuple[Any, Any]:
        found = _characteristic(view, labels, self.key)
        return found, self.expression.lookup(found)

    def why_not(self, found: Any, actual: Any) -> str:
        if found is MISSING:
            return f"the device has no characteristic or label {self.key!r}"
        return self.expression.why_not(actual)


@dataclass(frozen=True, slots=True)
class CharacteristicRule:
    """One `deviceCharacteristics` entry of the draft: every expression must hold."""

    index: int
    expressions: tuple[CharacteristicExpression, ...]

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
                                    None if actual is MISSING else actual, self.index, message))
        return failures


def compile_characteristic_rules(log: ProblemCollector, value: Any,
                                 path: Path) -> list[CharacteristicRule]:
    """The draft's `deviceCharacteristics`: OR across entries, AND within an entry."""
    if not isinstance(value, list | tuple) or not value:
        log.problem(path, "deviceCharacteristics must be a non-empty list",
                    expected="[{matchExpressions: [...]}, ...] (OR across entries)",
                    found=value)
        return []
    rules = []
    for index, raw in enumerate(value):
        where = (*path, index)
        doc = log.fields_of(raw, where, "a deviceCharacteristics entry",
                            _CHARACTERISTIC_RULE_FIELDS)
        if doc is None:
            continue
        expressions = doc.get("matchExpressions", MISSING)
        where = (*where, "matchExpressions")
        if not isinstance(expressions, list | tuple) or not expressions:
            log.problem(where, "matchExpressions must be a non-empty list",
                        expected="a non-empty list", found=expressions)
            continue
        compiled = [_compile_characteristic(log, e, (*where, i))
                    for i, e in enumerate(expressions)]
        if all(c is not None for c in compiled):
            rules.append(CharacteristicRule(index, tuple(c for c in compiled if c)))
    return rules


def _compile_property(log: ProblemCollector, pointer: Any, path: Path) -> Lookup:
    """The lookup of the optional `property` pointer (the whole characteristic without one)."""
    if pointer is MISSING:
        return identity
    try:
        if not isinstance(pointer, str):
            raise ValueError(f"expected a string, found {kind_of(pointer)}")
        return pointer_lookup(parse_pointer(pointer))
    except ValueError as exc:
        log.problem((*path, "property"), f"property is not a valid JSON Pointer: {exc}",
                    expected="an RFC 6901 JSON Pointer such as /cpus", found=pointer)
        return identity


def _compile_characteristic(log: ProblemCollector, value: Any,
                            path: Path) -> CharacteristicExpression | None:
    before = len(log.problems)
    doc = log.fields_of(value, path, "a characteristic expression", _CHARACTERISTIC_FIELDS)
    if doc is None:
        return None
    key = doc.get("key", MISSING)
    if not isinstance(key, str) or not key:
        log.problem(path if key is MISSING else (*path, "key"),
                    "a characteristic expression needs `key`, a non-empty string",
                    expected="a characteristic key or label key", found=key)
    pointer = doc.get("property", MISSING)
    lookup = _compile_property(log, pointer, path)
    operator = compile_operator(log, doc, path, extended=True)
    if operator is None:
        return None
    values = compile_values(log, doc, operator, path)
    items = compile_item_selector(log, doc, operator, path, extended=True)
    if len(log.problems) != before or values is None or items is None:
        return None
    prop = None if pointer is MISSING else str(pointer)
    subject = f"characteristic {key!r}" + ("" if prop is None else f" {pointer_text(prop)}")
    noun = (f"characteristic or label {key!r}" if prop is None
            else f"property {pointer_text(prop)} in characteristic {key!r}")
    expression = build_expression((prop or "", lookup), operator, values, items, labels=False,
                                  naming=(subject, noun))
    return CharacteristicExpression(str(key), prop, expression)
