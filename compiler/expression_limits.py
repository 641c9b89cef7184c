"""The bounds an intent expression runs within (`compiler.expressions`): the limits, the
per-render budgets of steps and of data built, the rendered value turned into plain data
within the result limits, and `ExpressionError`, the one error every failure becomes.

Kept apart from the sandbox so that the functions an expression may call
(`compiler.expression_functions`) and the sandbox itself meter their work against the same
budgets.
"""

from __future__ import annotations

import json
import math
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from contextvars import ContextVar
from typing import Any, Final

from jinja2.runtime import Undefined

__all__ = [
    "MAX_BUILD", "MAX_DEPTH", "MAX_JSON_INDENT", "MAX_POWER", "MAX_RANGE", "MAX_REPEAT",
    "MAX_RESULT_CHARS", "MAX_RESULT_ITEMS", "MAX_ROUND_DIGITS", "MAX_SOURCE_CHARS",
    "MAX_STEPS", "RENDER_STATE", "ExpressionError", "RenderState", "cost_of",
    "fail_if_undefined", "kind_of", "metered", "spend_build", "spend_steps", "text_of",
    "to_data",
]

#: Longest expression source accepted (characters).
MAX_SOURCE_CHARS: Final = 16 * 1024
#: Most characters/items a single `*` repetition may produce (nested content counts).
MAX_REPEAT: Final = 10_000
#: Most items `range()` may produce.
MAX_RANGE: Final = 10_000
#: Largest magnitude `**` may produce.
MAX_POWER: Final = 2**64
#: Most items (list elements and mapping entries, all levels) in a rendered value.
MAX_RESULT_ITEMS: Final = 10_000
#: Most characters (all strings and keys together) in a rendered value.
MAX_RESULT_CHARS: Final = 64 * 1024
#: Steps one render may take: filter/test/method calls plus the items they process.
MAX_STEPS: Final = 25_000
#: Characters/items one render may build with range, *, +, join, replace, tojson, dict.
MAX_BUILD: Final = 256 * 1024
#: Deepest nesting of rendered values, literals and device data.
MAX_DEPTH: Final = 64
MAX_JSON_INDENT: Final = 8
MAX_ROUND_DIGITS: Final = 20


class ExpressionError(ValueError):
    """An intent expression failed to compile or render.

    `str(error)` says what went wrong; `line`/`column` are 1-based positions within the
    expression text, or None when unknown (most evaluation errors).
    """

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self._detail = message
        self._location = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (ExpressionError, (self.message, self.line, self.column))

    def _at(self, segment: str) -> ExpressionError:
        """The same error, located inside a literal list/mapping (`[2]['name']: ...`)."""
        location = segment + self._location
        located = ExpressionError(f"{location}: {self._detail}", self.line, self.column)
        located._detail, located._location = self._detail, location
        return located


# --------------------------------------------------------------------------------------------
# Per-render state: the work budget and the context


class RenderState:
    """One render's budgets, and its context (for "device.labels has no key" messages)."""

    __slots__ = ("build", "context", "steps")

    def __init__(self, context: Mapping[str, Any] | None) -> None:
        self.context = context
        self.steps = MAX_STEPS
        self.build = MAX_BUILD


RENDER_STATE: ContextVar[RenderState | None] = ContextVar("margo_expression_state", default=None)
_TOO_SLOW: Final = (
    f"expression takes too many steps (more than {MAX_STEPS} filter/method calls and items "
    "processed per device)"
)
_TOO_BIG: Final = (
    f"expression builds too much data (more than {MAX_BUILD} characters/items per device)"
)


def spend_steps(amount: int) -> None:
    """Spend steps (time budget). Outside a render nothing is metered."""
    state = RENDER_STATE.get()
    if state is not None:
        state.steps -= amount
        if state.steps < 0:
            raise ExpressionError(_TOO_SLOW)


def spend_build(amount: int) -> None:
    """Spend build units (space budget); outside a render only one operation is capped."""
    state = RENDER_STATE.get()
    if state is None:
        if amount > MAX_BUILD:
            raise ExpressionError(_TOO_BIG)
        return
    state.build -= amount
    if state.build < 0:
        raise ExpressionError(_TOO_BIG)


def metered(iterator: Iterator[Any]) -> Iterator[Any]:
    """The items of `iterator`, each spending one step."""
    for item in iterator:
        spend_steps(1)
        yield item


_SIZED: Final = (list, tuple, dict, range)
#: Characters per step: string work runs in C loops, far cheaper than per-item Python work.
_CHARS_PER_STEP: Final = 64


def cost_of(value: Any) -> int:
    """Steps for one call on `value`: 1, plus its length for the O(n) work most calls do."""
    if isinstance(value, str):
        return 1 + len(value) // _CHARS_PER_STEP
    if isinstance(value, _SIZED):
        return 1 + len(value)
    return 1


def fail_if_undefined(value: Any) -> None:
    """Raise the undefined error (naming the missing key) if `value` is undefined."""
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()


def kind_of(value: Any) -> str:
    """`a dict value`, `an int value`."""
    kind = type(value).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} value"


# --------------------------------------------------------------------------------------------
# Results


def text_of(value: Any) -> str:
    """Text of a value as templates write it: strings as they are, anything else as JSON."""
    if type(value) is str:
        return value
    data = to_data(value)
    if isinstance(data, str):
        return data
    return json.dumps(data, ensure_ascii=False)


class _Tally:
    __slots__ = ("chars", "items")

    def __init__(self) -> None:
        self.items = 0
        self.chars = 0

    def add(self, items: int, chars: int) -> None:
        self.items += items
        self.chars += chars
        if self.items > MAX_RESULT_ITEMS:
            raise ExpressionError(f"result has more than {MAX_RESULT_ITEMS} items")
        if self.chars > MAX_RESULT_CHARS:
            raise ExpressionError(f"result is longer than {MAX_RESULT_CHARS} characters")


def _describe(value: Any) -> str:
    if callable(value):
        return f"{kind_of(value)} (a function: call it with ())"
    return kind_of(value)


def to_data(value: Any, tally: _Tally | None = None, depth: int = 0) -> Any:
    """The rendered value as plain JSON-like data, within the result limits."""
    if value is None or isinstance(value, bool):
        return value
    if tally is None:
        tally = _Tally()
    if isinstance(value, str):
        tally.add(0, len(value))
        return value if type(value) is str else str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ExpressionError(f"result {value!r} is not a finite number")
        return value
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()
    if depth >= MAX_DEPTH:
        raise ExpressionError(f"result is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        mapping: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ExpressionError(f"mapping keys must be strings, found {key!r}")
            tally.add(1, len(key))
            mapping[key] = to_data(item, tally, depth + 1)
        return mapping
    if isinstance(value, list | tuple | range | Iterator | KeysView | ValuesView | ItemsView):
        items: list[Any] = []
        for item in value:
            tally.add(1, 0)
            items.append(to_data(item, tally, depth + 1))
        return items
    raise ExpressionError(f"the expression produced {_describe(value)}, which is not data")
