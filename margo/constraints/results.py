"""What an evaluation returns (`Failure`, `MatchResult`) and how values are written in its
sentences, shared by every dialect's explanations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, TypeGuard

__all__ = ["ELIGIBLE", "Failure", "MatchResult", "display_number", "is_number", "kind_of",
           "show"]


def _jsonable(value: Any) -> Any:
    """Tuples and mappings from callers become plain lists and dicts for `json.dumps`."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Decimal):
        return format(value, "f")
    return value


@dataclass(frozen=True, slots=True)
class Failure:
    """One unmet clause, with enough detail to fix either the device or the constraint."""

    stage: str
    key: str
    operator: str
    required: Any
    actual: Any
    rule: int | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "key": self.key,
            "operator": self.operator,
            "required": _jsonable(self.required),
            "actual": _jsonable(self.actual),
            "rule": self.rule,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The verdict; `failures` is empty exactly when `eligible` is true."""

    eligible: bool
    failures: tuple[Failure, ...]

    def to_json(self) -> dict[str, Any]:
        return {"eligible": self.eligible, "failures": [f.to_json() for f in self.failures]}


#: The one "eligible" answer, shared so the common verdict allocates nothing.
ELIGIBLE: Final = MatchResult(True, ())


# --------------------------------------------------------------------------- rendering


def _render(value: Any) -> str:
    """JSON-ish text for messages: strings quoted, true/false/null, nested lists and objects."""
    if isinstance(value, bool) or value is None:
        return "true" if value is True else "false" if value is False else "null"
    if isinstance(value, str | int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return repr(value)


def show(value: Any, limit: int = 120) -> str:
    """A value as written in an explanation, cut to `limit` characters."""
    text = _render(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind_of(value: Any) -> str:
    """The JSON type of a value, with an article, for type-mismatch hints."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "a list"
    return "an object" if isinstance(value, Mapping) else type(value).__name__


def display_number(value: int | float) -> int | float:
    """2.0 cores reads as 2 in messages and JSON."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def is_number(value: Any) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, never a boolean."""
    return isinstance(value, int | float) and not isinstance(value, bool)
