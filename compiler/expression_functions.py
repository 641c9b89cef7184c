"""What an intent expression may call (`compiler.expressions`): the whitelisted filters and
tests, the two globals (`range`, `dict`), the operators the sandbox intercepts (`*`, `**`,
`%`, `+`) and the methods of data values. Each is strict (no silent conversions) and
meters its work against the render's budgets (`compiler.expression_limits`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final, cast

from jinja2.filters import FILTERS, make_attrgetter
from jinja2.tests import TESTS
from jinja2.utils import missing, pass_environment

from compiler.expression_limits import (
    MAX_JSON_INDENT,
    MAX_POWER,
    MAX_RANGE,
    MAX_REPEAT,
    MAX_ROUND_DIGITS,
    ExpressionError,
    cost_of,
    fail_if_undefined,
    metered,
    spend_build,
    spend_steps,
    text_of,
)
from margo.quantity import parse_quantity

__all__ = ["BINARY_OPERATORS", "GLOBALS", "TEST_NAMES", "allowed_attributes", "build_filters",
           "build_tests"]


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value == "true" or value == "false":
        answer: bool = value == "true"
        return answer
    raise ValueError(f"bool expects true or false, found {value!r}")


def _strict_int(value: Any, default: Any = missing, base: int = 10) -> Any:
    converted = FILTERS["int"](value, missing, base)
    if converted is missing:
        if default is missing:
            raise ValueError(f"cannot convert {value!r} to an integer")
        return default
    return converted


def _strict_float(value: Any, default: Any = missing) -> Any:
    converted = FILTERS["float"](value, missing)
    if converted is missing or (isinstance(converted, float) and not math.isfinite(converted)):
        if default is missing:
            raise ValueError(f"cannot convert {value!r} to a finite number")
        return default
    return converted


def _quantity(value: Any) -> int:
    """`"59 Gi"` -> 63350767616: bytes as an int, rounded up (`margo.quantity` spellings)."""
    return int(parse_quantity(value).to_integral_value(rounding=ROUND_CEILING))


def _gib(value: Any) -> float:
    """Bytes -> GiB as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise TypeError(
            f"gib expects a number of bytes, found {value!r} (convert text such as '59 Gi' "
            "with the quantity filter first)"
        )
    return value / 1024**3 if isinstance(value, int) else float(value) / 1024**3


@pass_environment
def _join(environment: Any, value: Any, d: Any = "", attribute: Any = None) -> str:
    if attribute is not None:
        value = map(make_attrgetter(environment, attribute), value)
    separator = text_of(d)
    pieces: list[str] = []
    for item in value:
        piece = text_of(item)
        spend_build(len(piece) + (len(separator) if pieces else 0))
        pieces.append(piece)
    return separator.join(pieces)


def _replace(value: Any, old: Any, new: Any, count: int | None = None) -> str:
    text, old, new = text_of(value), text_of(old), text_of(new)
    occurrences = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        occurrences = min(occurrences, count)
    spend_build(max(0, len(text) + occurrences * (len(new) - len(old))))
    return text.replace(old, new, -1 if count is None else count)


@pass_environment
def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    if isinstance(start, bool) or not isinstance(start, int | float):
        raise TypeError(f"sum adds numbers only; start must be a number, found {start!r}")
    return FILTERS["sum"](environment, iterable, attribute, start)


def _round(value: Any, precision: Any = 0, method: str = "common") -> float:
    if isinstance(precision, bool) or not isinstance(precision, int):
        raise TypeError(f"round precision must be an integer, found {precision!r}")
    if abs(precision) > MAX_ROUND_DIGITS:
        raise ValueError(f"round precision must be within +-{MAX_ROUND_DIGITS}")
    rounded: float = FILTERS["round"](value, precision, method)
    return rounded


def _json_default(value: Any) -> Any:
    fail_if_undefined(value)
    if isinstance(value, range | Iterator | KeysView | ValuesView | ItemsView):
        return list(value)
    raise TypeError(f"a {type(value).__name__} value cannot be written as JSON")


def _tojson(value: Any, indent: Any = None) -> str:
    if indent is not None and (
        isinstance(indent, bool)
        or not isinstance(indent, int)
        or not 0 <= indent <= MAX_JSON_INDENT
    ):
        raise ValueError(f"tojson indent must be an integer from 0 to {MAX_JSON_INDENT}")
    text = json.dumps(
        value,
        indent=indent,
        sort_keys=True,
        ensure_ascii=False,
        allow_nan=False,
        default=_json_default,
    )
    spend_build(len(text))
    return text


def _guarded(func: Callable[..., Any], *, undefined_ok: bool = False) -> Callable[..., Any]:
    """Wrap a filter/test: fail on an undefined operand (naming the missing key) and meter
    the call, the size of its operand and every item its lazily produced result yields."""
    pass_arg = getattr(func, "jinja_pass_arg", None)
    position = 0 if pass_arg is None else 1

    def guarded(*args: Any, **kwargs: Any) -> Any:
        value = args[position]
        if not undefined_ok:
            fail_if_undefined(value)
        spend_steps(cost_of(value))
        result = func(*args, **kwargs)
        if isinstance(result, Iterator):
            return metered(result)
        return result

    guarded.__name__ = getattr(func, "__name__", "filter")
    if pass_arg is not None:
        guarded.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    return guarded


_PLAIN_FILTERS: Final = (
    *("abs", "capitalize", "count", "first", "last", "length", "list", "lower", "map", "max"),
    *("min", "reject", "rejectattr", "reverse", "select", "selectattr", "sort", "title"),
    *("trim", "unique", "upper"),
)
_CUSTOM_FILTERS: Final[dict[str, Callable[..., Any]]] = {
    "bool": _strict_bool,
    "float": _strict_float,
    "gib": _gib,
    "int": _strict_int,
    "join": _join,
    "quantity": _quantity,
    "replace": _replace,
    "round": _round,
    "string": text_of,
    "sum": _sum,
    "tojson": _tojson,
}
TEST_NAMES: Final = (
    *("defined", "undefined", "none", "boolean", "integer", "float", "number", "string"),
    *("sequence", "mapping", "even", "odd", "divisibleby", "in"),
    *("eq", "==", "ne", "!=", "lt", "<", "le", "<=", "gt", ">", "ge", ">="),
)


def build_filters() -> dict[str, Callable[..., Any]]:
    """Every allowed filter by name, guarded and metered."""
    filters = {name: _guarded(FILTERS[name]) for name in _PLAIN_FILTERS}
    filters.update({name: _guarded(func) for name, func in _CUSTOM_FILTERS.items()})
    filters["default"] = filters["d"] = _guarded(FILTERS["default"], undefined_ok=True)
    return dict(sorted(filters.items()))


def build_tests() -> dict[str, Callable[..., Any]]:
    """Every allowed test by name, guarded and metered."""
    return {
        name: _guarded(cast(Callable[..., Any], TESTS[name]),
                       undefined_ok=name in ("defined", "undefined"))
        for name in TEST_NAMES
    }


def _range(*args: Any) -> range:
    for arg in args:
        fail_if_undefined(arg)
    numbers = range(*args)
    try:
        size = len(numbers)
    except OverflowError:
        size = MAX_RANGE + 1
    if size > MAX_RANGE:
        raise ValueError(f"range() may produce at most {MAX_RANGE} items, not {size}")
    spend_build(size)
    return numbers


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    for arg in args:
        fail_if_undefined(arg)
    result = dict(*args, **kwargs)
    spend_build(1 + len(result))
    return result


_range.__name__ = "range"
_dict.__name__ = "dict"
#: The names an expression may call besides its filters and tests.
GLOBALS: Final[dict[str, Callable[..., Any]]] = {"range": _range, "dict": _dict}


# --------------------------------------------------------------------------------------------
# Operators


def _content_size(value: Any, limit: int) -> int:
    """Characters plus items of a (nested) value; stops counting once past `limit`."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list | tuple):
            total += len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, Mapping):
            total += len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        if total > limit:
            break
    return total


def _is_int(value: Any) -> bool:
    return isinstance(value, int)


def _repeat(left: Any, right: Any) -> Any:
    sequence, times = (left, right) if _is_int(right) else (right, left)
    if isinstance(sequence, str | list | tuple) and _is_int(times) and times > 0:
        size = _content_size(sequence, MAX_REPEAT)
        if size > MAX_REPEAT or size * times > MAX_REPEAT:
            total = f"{size * times}" if times < 10**9 else "far more"
            raise ExpressionError(
                f"repetition with * would produce {total} characters/items; "
                f"at most {MAX_REPEAT} are allowed"
            )
        spend_build(size * times)
    return left * right


def _power(base: Any, exponent: Any) -> Any:
    too_big = ExpressionError("power too large: ** results are limited to 2**64 in magnitude")
    # |base| >= 2**(bits-1), so bits * exponent > 130 means the result exceeds 2**64.
    if (
        _is_int(base)
        and _is_int(exponent)
        and abs(base) > 1
        and (exponent > 64 or abs(base).bit_length() * exponent > 130)
    ):
        raise too_big
    result = base**exponent
    if isinstance(result, int | float) and abs(result) > MAX_POWER:
        raise too_big
    return result


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        raise ExpressionError(
            "%-formatting of strings is not allowed; concatenate with ~ or use join"
        )
    return left % right


def _add(left: Any, right: Any) -> Any:
    result = left + right
    if isinstance(result, str | list | tuple):
        spend_build(len(result))
    return result


BINARY_OPERATORS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "*": _repeat,
    "**": _power,
    "%": _modulo,
    "+": _add,
}

_STR_METHODS: Final = frozenset(
    {
        *("capitalize", "casefold", "count", "endswith", "find", "isalnum", "isalpha"),
        *("isdecimal", "isdigit", "islower", "isnumeric", "isspace", "istitle", "isupper"),
        *("lower", "lstrip", "partition", "removeprefix", "removesuffix", "rfind"),
        *("rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip"),
        *("swapcase", "title", "upper"),
    }
)
_MAPPING_METHODS: Final = frozenset({"get", "items", "keys", "values"})
_SEQUENCE_METHODS: Final = frozenset({"count", "index"})


def allowed_attributes(obj: Any) -> frozenset[str]:
    """The methods an expression may call on `obj` (none but of strings, mappings, lists)."""
    if isinstance(obj, str):
        return _STR_METHODS
    if isinstance(obj, Mapping):
        return _MAPPING_METHODS
    if isinstance(obj, list | tuple):
        return _SEQUENCE_METHODS
    return frozenset()
