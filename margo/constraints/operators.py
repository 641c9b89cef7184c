"""The matchExpression operators as tests, and one compiled expression (key, operator, values).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from margo.constraints.results import _PLURAL, _is_number, _kind, _show
from margo.constraints.vocabulary import (
    _BOUND_OPERATORS,
    _CONTAINS_OPERATORS,
    _MISSING,
    Lookup,
    Test,
)

__all__ = []


def _in_test(values: tuple[Any, ...]) -> Test:
    """Strictly typed membership: "1" is not 1 and true is not 1."""
    if isinstance(values[0], bool):
        flag = values[0]
        return lambda actual: actual is flag
    allowed = frozenset(values)
    if isinstance(values[0], str):
        return lambda actual: isinstance(actual, str) and actual in allowed
    return lambda actual: _is_number(actual) and actual in allowed


def _not_in_test(values: tuple[Any, ...]) -> Test:
    """Present scalar (string, number, boolean) equal to none of the values."""
    member = _in_test(values)
    return lambda actual: isinstance(actual, str | int | float) and not member(actual)


def _bound_test(operator: str, bound: int | float) -> Test:
    if operator == "Gt":
        return lambda actual: _is_number(actual) and actual > bound
    if operator == "GtEq":
        return lambda actual: _is_number(actual) and actual >= bound
    if operator == "LtEq":
        return lambda actual: _is_number(actual) and actual <= bound
    return lambda actual: _is_number(actual) and actual < bound


def _exists(actual: Any) -> bool:
    return actual is not _MISSING


def _does_not_exist(actual: Any) -> bool:
    return actual is _MISSING


def _contains_test(operator: str, items: tuple[_Expression, ...]) -> Test:
    """Some element of an array matches all (ContainsAll) / any (ContainsAny) item expression."""

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

    def contains_any(actual: Any) -> bool:
        if not isinstance(actual, list | tuple):
            return False
        for element in actual:
            for item in items:
                if item.test(item.lookup(element)):
                    return True
        return False

    return contains_all if operator == "ContainsAll" else contains_any


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class _Expression:
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
    items: tuple[_Expression, ...] = ()

    def why_not(self, actual: Any) -> str:
        """Why `actual` fails this expression, as the second half of a sentence."""
        if actual is _MISSING:
            return f"the device has no {self.noun}"
        shown = f"the device has {_show(actual)}"
        if self.operator in _CONTAINS_OPERATORS:
            return self._why_not_contains(actual, shown)
        if self.operator == "DoesNotExist" or actual is None:
            return shown
        if isinstance(actual, list | tuple | Mapping):
            hint = "; ContainsAll/ContainsAny test lists" if isinstance(actual, list) else ""
            return f"{shown} ({_kind(actual)}, not a single value{hint})"
        if self.operator in _BOUND_OPERATORS and not _is_number(actual):
            return f"{shown} ({_kind(actual)}, not a number)"
        if self.operator == "In" and _kind(actual) != _kind(self.values[0]):
            return f"{shown} ({_kind(actual)}; the values are {_PLURAL[_kind(self.values[0])]})"
        return shown

    def _why_not_contains(self, actual: Any, shown: str) -> str:
        if not isinstance(actual, list | tuple):
            return f"{shown}, {_kind(actual)}, not a list"
        if not actual:
            return f"{shown}, an empty list"
        which = "all item expressions" if self.operator == "ContainsAll" else "any item expression"
        return f"no element of {_show(actual)} matches {which}"
