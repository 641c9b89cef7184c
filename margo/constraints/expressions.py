"""The matchExpressions dialect: selectors of property, label and item expressions (key,
operator, values, itemSelector), compiled and checked here.

Compilation validates one selector and turns every expression into an `Expression`: where to
look (a pre-split JSON Pointer or a label key), the operator as a test over the value found,
and the words that explain a miss. Eligibility rules, draft characteristics and cluster node
selectors all build on `compile_selector`; `extended` selectors (inside our extension) take
the draft's `GtEq`/`LtEq` too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from margo.constraints.pointers import label_lookup, parse_pointer, pointer_lookup
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import is_number, kind_of, show
from margo.constraints.vocabulary import (
    CONTAINS_OPERATORS,
    DRAFT_OPERATORS,
    EXTENSION,
    MISSING,
    OPERATORS,
    Lookup,
    Test,
)
from margo.errors import Path, short_repr

__all__ = ["Expression", "build_expression", "compile_item_selector", "compile_operator",
           "compile_selector", "compile_values", "pointer_text"]

_EXTENDED_OPERATORS: Final = OPERATORS | DRAFT_OPERATORS
_VALUE_OPERATORS: Final = frozenset({"In", "NotIn"})
_BOUND_OPERATORS: Final = frozenset({"Gt", "Lt", "GtEq", "LtEq"})
_PRESENCE_OPERATORS: Final = frozenset({"Exists", "DoesNotExist"})
_SELECTOR_FIELDS: Final = ("matchExpressions",)
_EXPRESSION_FIELDS: Final = ("key", "operator", "values", "itemSelector")
_PLURAL: Final[Mapping[str, str]] = {
    "a string": "strings",
    "a number": "numbers",
    "a boolean": "a boolean",
}
_VALUES_EXPECTED: Final[Mapping[str, str]] = {
    "In": "one or more strings, one or more numbers, or exactly one boolean",
    "NotIn": "one or more strings, one or more numbers, or exactly one boolean",
    "Gt": "exactly one number",
    "Lt": "exactly one number",
    "GtEq": "exactly one number",
    "LtEq": "exactly one number",
}


def pointer_text(key: str) -> str:
    """A pointer as written in explanations: the empty pointer (the whole document) as `""`."""
    return key if key else '""'


# --------------------------------------------------------------------------- tests


def _in_test(values: tuple[Any, ...]) -> Test:
    """Strictly typed membership: "1" is not 1 and true is not 1."""
    if isinstance(values[0], bool):
        flag = values[0]
        return lambda actual: actual is flag
    allowed = frozenset(values)
    if isinstance(values[0], str):
        return lambda actual: isinstance(actual, str) and actual in allowed
    return lambda actual: is_number(actual) and actual in allowed


def _not_in_test(values: tuple[Any, ...]) -> Test:
    """Present scalar (string, number, boolean) equal to none of the values."""
    member = _in_test(values)
    return lambda actual: isinstance(actual, str | int | float) and not member(actual)


def _bound_test(operator: str, bound: int | float) -> Test:
    if operator == "Gt":
        return lambda actual: is_number(actual) and actual > bound
    if operator == "GtEq":
        return lambda actual: is_number(actual) and actual >= bound
    if operator == "LtEq":
        return lambda actual: is_number(actual) and actual <= bound
    return lambda actual: is_number(actual) and actual < bound


def _exists(actual: Any) -> bool:
    return actual is not MISSING


def _does_not_exist(actual: Any) -> bool:
    return actual is MISSING


def _contains_all(items: tuple[Expression, ...]) -> Test:
    """Some element of an array matches every item expression."""

    def contains_all(actual: Any) -> bool:
        if not isinstance(actual, list | tuple):
            return False
        for element in actual:
            for item in items:
                if not item.test(item.lookup(element)):
                    break
            else:
                return True
        return False

    return contains_all


def _contains_any(items: tuple[Expression, ...]) -> Test:
    """Some element of an array matches some item expression."""

    def contains_any(actual: Any) -> bool:
        if not isinstance(actual, list | tuple):
            return False
        for element in actual:
            for item in items:
                if item.test(item.lookup(element)):
                    return True
        return False

    return contains_any


def _contains_test(operator: str, items: tuple[Expression, ...]) -> Test:
    """Some element of an array matches all (ContainsAll) / any (ContainsAny) item expression."""
    return _contains_all(items) if operator == "ContainsAll" else _contains_any(items)


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class Expression:
    """A compiled matchExpression: where to look, what to test, and how to explain a miss."""

    key: str
    operator: str
    subject: str  # "/vendor" or "label 'example.com/gpu'"
    noun: str  # "property /vendor" or "label 'example.com/gpu'"
    lookup: Lookup
    test: Test
    values: tuple[Any, ...]
    required: Any
    text: str  # "/vendor In ['Acme']"
    #: The item expressions of ContainsAll/ContainsAny (what one element must match); read by
    #: `demand` to tell which peripheral a placement takes.
    items: tuple[Expression, ...] = ()

    def why_not(self, actual: Any) -> str:
        """Why `actual` fails this expression, as the second half of a sentence."""
        if actual is MISSING:
            return f"the device has no {self.noun}"
        shown = f"the device has {show(actual)}"
        if self.operator in CONTAINS_OPERATORS:
            return self._why_not_contains(actual, shown)
        if self.operator == "DoesNotExist" or actual is None:
            return shown
        if isinstance(actual, list | tuple | Mapping):
            hint = "; ContainsAll/ContainsAny test lists" if isinstance(actual, list) else ""
            return f"{shown} ({kind_of(actual)}, not a single value{hint})"
        if self.operator in _BOUND_OPERATORS and not is_number(actual):
            return f"{shown} ({kind_of(actual)}, not a number)"
        if self.operator == "In" and kind_of(actual) != kind_of(self.values[0]):
            return f"{shown} ({kind_of(actual)}; the values are {_PLURAL[kind_of(self.values[0])]})"
        return shown

    def _why_not_contains(self, actual: Any, shown: str) -> str:
        if not isinstance(actual, list | tuple):
            return f"{shown}, {kind_of(actual)}, not a list"
        if not actual:
            return f"{shown}, an empty list"
        which = "all item expressions" if self.operator == "ContainsAll" else "any item expression"
        return f"no element of {show(actual)} matches {which}"


# --------------------------------------------------------------------------- compilation


def compile_selector(log: ProblemCollector, value: Any, path: Path, *, labels: bool,
                     item: bool = False, extended: bool = False) -> tuple[Expression, ...]:
    """matchExpressions of a property, label or item selector (missing selector = none);
    `extended` selectors (inside our extension) also take the draft operators."""
    if value is MISSING:
        return ()
    doc = log.fields_of(value, path, "a selector", _SELECTOR_FIELDS)
    if doc is None:
        return ()
    expressions = doc.get("matchExpressions", MISSING)
    if expressions is MISSING:
        log.problem(path, "a selector needs matchExpressions", expected="matchExpressions: [...]")
        return ()
    path = (*path, "matchExpressions")
    if not isinstance(expressions, list | tuple) or (item and not expressions):
        need = "a non-empty list" if item else "a list"
        log.problem(path, f"matchExpressions must be {need}", expected=need, found=expressions)
        return ()
    compiled = [_compile_expression(log, e, (*path, i), labels=labels, extended=extended)
                for i, e in enumerate(expressions)]
    return tuple(e for e in compiled if e is not None)


def _compile_expression(log: ProblemCollector, value: Any, path: Path, *, labels: bool,
                        extended: bool) -> Expression | None:
    before = len(log.problems)
    doc = log.fields_of(value, path, "a matchExpression", _EXPRESSION_FIELDS)
    if doc is None:
        return None
    key = _compile_key(log, doc, path, labels=labels)
    operator = compile_operator(log, doc, path, extended=extended)
    if operator is None:
        return None
    values = compile_values(log, doc, operator, path)
    items = compile_item_selector(log, doc, operator, path, extended=extended)
    if len(log.problems) != before or key is None or values is None or items is None:
        return None
    return build_expression(key, operator, values, items, labels=labels)


def _compile_key(log: ProblemCollector, doc: Mapping[str, Any], path: Path, *,
                 labels: bool) -> tuple[str, Lookup] | None:
    key = doc.get("key", MISSING)
    if key is MISSING:
        log.problem(path, "a matchExpression needs `key`",
                    expected="a label key" if labels else "a JSON Pointer such as /vendor")
        return None
    if not isinstance(key, str) or (labels and not key):
        log.problem((*path, "key"), "key must be a non-empty string", expected="a string",
                    found=key)
        return None
    if labels:
        return key, label_lookup(key)
    try:
        return key, pointer_lookup(parse_pointer(key))
    except ValueError as exc:
        log.problem((*path, "key"), f"key is not a valid JSON Pointer: {exc}",
                    expected="an RFC 6901 JSON Pointer such as /vendor or /cpus/0/cores",
                    found=key)
        return None


def compile_operator(log: ProblemCollector, doc: Mapping[str, Any], path: Path, *,
                     extended: bool = False) -> str | None:
    """The expression's operator if this selector allows it; a draft operator outside our
    extension is an error that says where it belongs."""
    allowed = _EXTENDED_OPERATORS if extended else OPERATORS
    expected = "one of " + ", ".join(sorted(allowed))
    operator = doc.get("operator", MISSING)
    if operator is MISSING:
        log.problem(path, "a matchExpression needs `operator`", expected=expected)
        return None
    if isinstance(operator, str) and operator in allowed:
        return operator
    if isinstance(operator, str) and operator in DRAFT_OPERATORS:
        log.problem((*path, "operator"),
                    f"{operator} belongs to the schema-agnostic matching draft, not to the"
                    f" rc.3 operators of this selector; use {operator[:2]} here, or use it"
                    f" inside deviceConstraints.{EXTENSION}", expected=expected,
                    found=operator)
        return None
    close = [o for o in allowed if isinstance(operator, str) and o.lower() == operator.lower()]
    hint = f"; did you mean {close[0]!r}? (operators are case-sensitive)" if close else ""
    log.problem((*path, "operator"), f"unknown operator {short_repr(operator)}{hint}",
                expected=expected, found=operator)
    return None


def compile_values(log: ProblemCollector, doc: Mapping[str, Any], operator: str,
                   path: Path) -> tuple[Any, ...] | None:
    """The expression's values, typed for `operator` (None when they are wrong)."""
    values = doc.get("values", MISSING)
    if operator in _PRESENCE_OPERATORS | CONTAINS_OPERATORS:
        if values is MISSING:
            return ()
        log.problem((*path, "values"), f"{operator} takes no values", expected="no values",
                    found=values)
        return None
    if values is MISSING:
        log.problem(path, f"{operator} needs `values`", expected=_VALUES_EXPECTED[operator])
        return None
    path = (*path, "values")
    if not isinstance(values, list | tuple) or not values:
        log.problem(path, f"{operator} needs a non-empty list of values",
                    expected=_VALUES_EXPECTED[operator], found=values)
        return None
    if operator in _BOUND_OPERATORS:
        return _compile_bound(log, values, operator, path)
    return _compile_value_list(log, values, operator, path)


def _compile_bound(log: ProblemCollector, values: Any, operator: str,
                   path: Path) -> tuple[Any, ...] | None:
    if len(values) != 1:
        log.problem(path, f"{operator} takes exactly one numeric value, found {len(values)}",
                    expected="exactly one number", found=values)
        return None
    bound = values[0]
    if not is_number(bound) or not math.isfinite(bound):
        log.problem((*path, 0), f"{operator} compares numbers",
                    expected="a finite number (not a string or boolean)", found=bound)
        return None
    return (bound,)


def _compile_value_list(log: ProblemCollector, values: Any, operator: str,
                        path: Path) -> tuple[Any, ...] | None:
    """One or more strings, or one or more numbers, or exactly one boolean."""
    ok = True
    for i, value in enumerate(values):
        if not isinstance(value, str | int | float) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            log.problem((*path, i), f"{operator} values must be strings, numbers or a"
                        " boolean", expected="a string, finite number or boolean",
                        found=value)
            ok = False
    if not ok:
        return None
    kinds = {kind_of(v) for v in values}
    if len(kinds) > 1:
        log.problem(path, f"{operator} values must all be of one type, found "
                    + " and ".join(sorted(kinds)),
                    expected="all strings, all numbers, or exactly one boolean", found=values)
        return None
    if kinds == {"a boolean"} and len(values) != 1:
        log.problem(path, f"{operator} takes exactly one boolean value",
                    expected="[true] or [false]", found=values)
        return None
    return tuple(values)


def compile_item_selector(log: ProblemCollector, doc: Mapping[str, Any], operator: str,
                          path: Path, *, extended: bool = False
                          ) -> tuple[Expression, ...] | None:
    """The item expressions of ContainsAll/ContainsAny (none for other operators)."""
    selector = doc.get("itemSelector", MISSING)
    if operator not in CONTAINS_OPERATORS:
        if selector is MISSING:
            return ()
        log.problem((*path, "itemSelector"),
                    f"{operator} takes no itemSelector (only ContainsAll/ContainsAny do)",
                    expected="no itemSelector", found=selector)
        return None
    if selector is MISSING:
        log.problem(path, f"{operator} needs itemSelector.matchExpressions",
                    expected="itemSelector: {matchExpressions: [...]}")
        return None
    before = len(log.problems)
    items = compile_selector(log, selector, (*path, "itemSelector"), labels=False, item=True,
                             extended=extended)
    return items if len(log.problems) == before else None


def build_expression(key_lookup: tuple[str, Lookup], operator: str, values: tuple[Any, ...],
                     items: tuple[Expression, ...], *, labels: bool,
                     naming: tuple[str, str] | None = None) -> Expression:
    """The compiled expression; `naming` overrides (subject, noun) for the draft form."""
    key, lookup = key_lookup
    subject = f"label {key!r}" if labels else pointer_text(key)
    noun = subject if labels else f"property {subject}"
    if naming is not None:
        subject, noun = naming
    if operator in _VALUE_OPERATORS:
        test = _in_test(values) if operator == "In" else _not_in_test(values)
        required: Any = list(values)
        shown = f" {show(required)}"
    elif operator in _BOUND_OPERATORS:
        test, required = _bound_test(operator, values[0]), values[0]
        shown = f" {show(required)}"
    elif operator in CONTAINS_OPERATORS:
        test, required = _contains_test(operator, items), [i.text for i in items]
        shown = " [" + ", ".join(required) + "]"
    else:
        test = _exists if operator == "Exists" else _does_not_exist
        required, shown = None, ""
    return Expression(key, operator, subject, noun, lookup, test, values, required,
                      f"{subject} {operator}{shown}", items)
