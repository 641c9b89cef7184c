"""Parameter values checked against the `configuration.schema` rules of an ApplicationDescription.

The Margo spec says a parameter value "MUST match the dataType and every rule" of the schema
its setting names, but leaves several points open or contradictory. This module settles them
once, so the WFM (when a user configures a deployment) and the device client (when it reads a
desired state) agree:

* **allowEmpty.** The spec text is inverted ("If true, indicates a value must be provided").
  We follow the field's *name* and the official examples (`requiredText` has
  `allowEmpty: false`, `optionalText` has `allowEmpty: true`): `allowEmpty: true` accepts an
  empty value and applies no other rule to it; `allowEmpty: false` **or absent** rejects an
  empty value with "a value is required". Absent defaults to false, i.e. *required*.
* **What "empty" is** (see `is_empty`): the `EMPTY` sentinel (the parameter has no `value`
  at all), `None`, `""` for string-valued rules (and for any rule when `lenient_strings`,
  because stringified documents write a blank field as `""`), and `[]` for rules whose value
  is a list (`array[...]` data types and `multiselect` selects). `allowEmpty` concerns the
  whole value, never the elements of an array. Whitespace is not empty.
* **Types are strict.** `integer` accepts Python ints but not bools and not floats (not even
  `3.0`); `double` accepts ints and finite floats but not bools; `boolean` only True/False;
  `string` only str. With `lenient_strings=True` (older ApplicationDeployment documents wrote
  `"4"` and `"true"`), a string is first converted when it parses cleanly: integers match
  `[+-]?[0-9]+`, doubles are plain decimal/exponent literals (no `nan`, `inf` or `_`),
  booleans are exactly `true`/`false`. Anything else is reported, never guessed.
* **Lengths** count Unicode code points (`len(str)`).
* **Precision** of a double is the number of digits after the decimal point in the shortest
  round-tripping representation: `Decimal(repr(float(v)))` with trailing zeros dropped, so
  `1`, `1.0` and `100.0` have precision 0, `0.25` has 2 and `1e-07` has 7.
  `minPrecision`/`maxPrecision` bound that number.
* **regexMatch** must match the *whole* value (`re.fullmatch`, Python `re` syntax; the
  examples' `^...$` anchors are harmless). Patterns longer than `MAX_PATTERN_LENGTH`
  characters are refused. Matching time is not bounded: a pathological pattern is the
  application author's responsibility, as it is in every other Margo implementation.
* **Selects** are rules with `options`; the `dataType` gives the option type (`string`,
  `integer`, ... or the matching `array[...]`). The value must be one of the options,
  compared strictly by type (`1` is not `true`, `"1"` is not `1`; `1` equals `1.0` for
  doubles). With `multiselect: true`, or an `array[...]` data type, the value is a list of
  distinct options; a select with an `array[...]` data type and `multiselect: false` is
  contradictory and rejected by `check_schema_rule`. A list for a single select is a type
  error.
* **Arrays** `array[T]`: the value is a list and every element must be a `T` satisfying the
  element rules (lengths/pattern for strings, bounds/precision for numbers); element
  problems carry the element index in their path. There is no rule on the array length.
* **Immutable settings** (`check_immutable`) compare values with `same_value`, the same
  strict typing as above: `"4"` and `4` differ. Normalise stringified values first if the
  two documents come from different eras.

`check_schema_rule` validates a rule itself; `validate_value` refuses (with `DocumentError`)
a malformed rule rather than guessing what its author meant, so validate rules first where
their own document path is known.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from functools import lru_cache
from typing import Any, Final

from margo.errors import DocumentError, Path, Problem, short_repr

__all__ = [
    "DATA_TYPES",
    "EMPTY",
    "MAX_PATTERN_LENGTH",
    "SCALAR_TYPES",
    "check_immutable",
    "check_schema_rule",
    "is_empty",
    "precision",
    "same_value",
    "validate_value",
]

SCALAR_TYPES: Final = ("string", "integer", "double", "boolean")
DATA_TYPES: Final = SCALAR_TYPES + tuple(f"array[{t}]" for t in SCALAR_TYPES)
MAX_PATTERN_LENGTH: Final = 1000


class _Empty:
    """Type of `EMPTY`: a falsy singleton that survives copy/deepcopy/pickle as itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "EMPTY"


#: The value of a parameter that has no `value` key at all. Pass
#: `parameter.get("value", EMPTY)` to `validate_value`: it is empty for every rule, just like
#: `None`, `""` for string rules and `[]` for list-valued rules (see `is_empty`).
EMPTY: Final = _Empty()

_COMMON_FIELDS = frozenset({"name", "dataType", "allowEmpty", "sensitive"})  # sensitive: #145
_FIELDS_BY_KIND: Final[Mapping[str, frozenset[str]]] = {
    "string": frozenset({"minLength", "maxLength", "regexMatch"}),
    "boolean": frozenset(),
    "integer": frozenset({"minValue", "maxValue"}),
    "double": frozenset({"minValue", "maxValue", "minPrecision", "maxPrecision"}),
    "select": frozenset({"multiselect", "options"}),
}
_RULE_FIELDS = _COMMON_FIELDS.union(*_FIELDS_BY_KIND.values())
_EXTENSION = re.compile(r"x-[a-z][a-z0-9-]*-extensions")

_NOUNS = {"string": "a string", "integer": "an integer", "double": "a number",
          "boolean": "true or false"}
_PLURALS = {"string": "strings", "integer": "integers", "double": "numbers",
            "boolean": "booleans"}

_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_DOUBLE_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NOT_PARSED = object()


# --------------------------------------------------------------------------- small helpers


def _element_type(data_type: str) -> str:
    """`array[T]` -> `T`; scalar types are their own element type."""
    return data_type[6:-1] if data_type.startswith("array[") else data_type


def _is_array_type(data_type: Any) -> bool:
    return isinstance(data_type, str) and data_type.startswith("array[")


def _takes_list(rule: Mapping[str, Any]) -> bool:
    """Whether the rule's value is a list: array data types and multiselect selects."""
    return _is_array_type(rule.get("dataType")) or rule.get("multiselect") is True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """Int (any size) or finite float, never bool: what a `double` value may be."""
    if _is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _matches_type(value: Any, scalar_type: str) -> bool:
    if scalar_type == "string":
        return isinstance(value, str)
    if scalar_type == "boolean":
        return isinstance(value, bool)
    if scalar_type == "integer":
        return _is_int(value)
    return _is_number(value)


def _parse_text(text: str, scalar_type: str) -> Any:
    """Lenient conversion of stringified values; `_NOT_PARSED` unless the text is clean."""
    if scalar_type == "integer" and _INTEGER_TEXT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # past sys.get_int_max_str_digits(): not a sensible setting value
            return _NOT_PARSED
    if scalar_type == "double" and _DOUBLE_TEXT.fullmatch(text):
        number = float(text)
        return number if math.isfinite(number) else _NOT_PARSED
    if scalar_type == "boolean" and text in ("true", "false"):
        return text == "true"
    return _NOT_PARSED


def _coerce(value: Any, scalar_type: str, lenient: bool) -> tuple[bool, Any]:
    """(True, typed value) when `value` is a `scalar_type`, possibly after lenient parsing."""
    if _matches_type(value, scalar_type):
        return True, value
    if lenient and isinstance(value, str) and scalar_type != "string":
        parsed = _parse_text(value, scalar_type)
        if parsed is not _NOT_PARSED:
            return True, parsed
    return False, value


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _num(value: int | float) -> str:
    return str(value)


def same_value(a: Any, b: Any) -> bool:
    """Equality under the module's strict typing: bools only equal bools, numbers compare by
    value (`1 == 1.0`), strings only equal strings; lists and mappings compare recursively."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if _is_number(a) or _is_number(b):
        return _is_number(a) and _is_number(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def precision(value: int | float) -> int:
    """Digits after the decimal point in the shortest repr: 1.0 -> 0, 0.25 -> 2, 1e-07 -> 7."""
    if _is_int(value):
        return 0
    exponent = Decimal(repr(float(value))).normalize().as_tuple().exponent
    return max(0, -int(exponent))


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _compile_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be used as a regexMatch, or None when it compiles."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        return f"must be at most {MAX_PATTERN_LENGTH} characters, found {len(pattern)}"
    try:
        _compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        return f"is not a valid regular expression: {exc}"
    return None


# --------------------------------------------------------------------------- rule checking


def _field_problem(path: Path, field: str, message: str, value: Any) -> Problem:
    return Problem(path=(*path, field), message=message, found=short_repr(value))


def _rule_kind(rule: Mapping[str, Any]) -> str:
    """`select` for rules with options, otherwise the element type of the dataType."""
    return "select" if "options" in rule else _element_type(rule["dataType"])


def _check_data_type(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    if "dataType" not in rule:
        return [Problem(path=(*path, "dataType"), message="dataType is required",
                        expected=", ".join(DATA_TYPES))]
    data_type = rule["dataType"]
    if isinstance(data_type, str) and data_type in DATA_TYPES:
        return []
    return [_field_problem(path, "dataType",
                           f"unknown dataType {short_repr(data_type)}; expected one of "
                           + ", ".join(DATA_TYPES), data_type)]


def _check_field_names(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    """Unknown fields (typos such as `maxlength` would otherwise silently disable a rule)."""
    return [
        _field_problem(path, key, f"unknown schema rule field {key!r}", rule[key])
        for key in rule
        if key not in _RULE_FIELDS and not (isinstance(key, str) and _EXTENSION.fullmatch(key))
    ]


def _check_applicable(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    """Rule fields that exist but do not apply to this rule's dataType (or to a select)."""
    kind = _rule_kind(rule)
    allowed = _COMMON_FIELDS | _FIELDS_BY_KIND[kind] | {"multiselect"}
    target = "a select rule (a rule with options)" if kind == "select" else (
        f"dataType {rule['dataType']}")
    return [
        _field_problem(path, key, f"{key} does not apply to {target}", rule[key])
        for key in rule
        if key in _RULE_FIELDS and key not in allowed
    ]


def _check_boolean_fields(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    return [
        _field_problem(path, key, f"{key} must be true or false, found {short_repr(rule[key])}",
                       rule[key])
        for key in ("allowEmpty", "multiselect")
        if key in rule and not isinstance(rule[key], bool)
    ]


def _check_bounds(rule: Mapping[str, Any], path: Path, low: str, high: str,
                  valid: Any, what: str) -> list[Problem]:
    """Type-check a min/max field pair with `valid`, then require min <= max."""
    problems = [
        _field_problem(path, key, f"{key} must be {what}, found {short_repr(rule[key])}",
                       rule[key])
        for key in (low, high)
        if key in rule and not valid(rule[key])
    ]
    if not problems and low in rule and high in rule and rule[low] > rule[high]:
        problems.append(_field_problem(
            path, low, f"{low} {_num(rule[low])} is greater than {high} {_num(rule[high])}",
            rule[low]))
    return problems


def _is_count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _check_pattern(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    if "regexMatch" not in rule:
        return []
    pattern = rule["regexMatch"]
    if not isinstance(pattern, str):
        return [_field_problem(path, "regexMatch",
                               f"regexMatch must be a string, found {short_repr(pattern)}",
                               pattern)]
    reason = _compile_problem(pattern)
    return [] if reason is None else [_field_problem(path, "regexMatch",
                                                     f"regexMatch {reason}", pattern)]


def _check_options(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    options = rule["options"]
    if not isinstance(options, list) or not options:
        return [_field_problem(path, "options", "options must be a non-empty list, found "
                               + short_repr(options), options)]
    element = _element_type(rule["dataType"])
    problems: list[Problem] = []
    seen: list[Any] = []
    for index, option in enumerate(options):
        where = (*path, "options", index)
        if not _matches_type(option, element):
            problems.append(Problem(
                path=where, message=f"option must be {_NOUNS[element]} (the dataType is "
                f"{rule['dataType']}), found {short_repr(option)}",
                expected=_NOUNS[element], found=short_repr(option)))
        elif any(same_value(option, earlier) for earlier in seen):
            problems.append(Problem(path=where, message=f"duplicate option {short_repr(option)}",
                                    found=short_repr(option)))
        else:
            seen.append(option)
    if _is_array_type(rule["dataType"]) and rule.get("multiselect") is False:
        problems.append(_field_problem(
            path, "multiselect", f"a select with dataType {rule['dataType']} takes a list, "
            "so multiselect cannot be false", False))
    return problems


def _check_kind_fields(rule: Mapping[str, Any], path: Path) -> list[Problem]:
    """Value checks for the fields that apply to the rule's kind."""
    kind = _rule_kind(rule)
    if kind == "select":
        return _check_options(rule, path)
    problems: list[Problem] = []
    if "multiselect" in rule:
        problems.append(_field_problem(path, "multiselect",
                                       "multiselect needs options (it only applies to selects)",
                                       rule["multiselect"]))
    if kind == "string":
        problems += _check_bounds(rule, path, "minLength", "maxLength", _is_count,
                                  "a non-negative integer")
        problems += _check_pattern(rule, path)
    elif kind == "integer":
        problems += _check_bounds(rule, path, "minValue", "maxValue", _is_int, "an integer")
    elif kind == "double":
        problems += _check_bounds(rule, path, "minValue", "maxValue", _is_number,
                                  "a finite number")
        problems += _check_bounds(rule, path, "minPrecision", "maxPrecision", _is_count,
                                  "a non-negative integer")
    return problems


def check_schema_rule(rule: Mapping[str, Any], *, path: Path = ()) -> list[Problem]:
    """Every reason the configuration schema rule `rule` is not usable, paths under `path`.

    Checks: known dataType; no unknown fields (besides `x-...-extensions`); no fields that
    do not apply to the dataType (minLength on an integer, minPrecision on a string, ...);
    field types; min <= max; non-negative lengths and precisions; regexMatch compiles and is
    at most `MAX_PATTERN_LENGTH` long; options non-empty, typed by the dataType, distinct;
    multiselect only with options.
    """
    path = tuple(path)
    if not isinstance(rule, Mapping):
        return [Problem(path=path, message=f"expected a schema rule object, found "
                        f"{short_repr(rule)}", expected="an object", found=short_repr(rule))]
    type_problems = _check_data_type(rule, path)
    problems = type_problems + _check_field_names(rule, path) + _check_boolean_fields(rule, path)
    if type_problems:  # applicability depends on the dataType: nothing more to say safely
        return problems
    return problems + _check_applicable(rule, path) + _check_kind_fields(rule, path)


# --------------------------------------------------------------------------- value checking


def is_empty(value: Any, rule: Mapping[str, Any], *, lenient_strings: bool = False) -> bool:
    """Whether `value` counts as "no value" for `rule` (see the module docstring)."""
    if value is EMPTY or value is None:
        return True
    if isinstance(value, str) and value == "":
        string_rule = _element_type(str(rule.get("dataType", ""))) == "string"
        return lenient_strings or (string_rule and not _takes_list(rule))
    if isinstance(value, list) and not value:
        return _takes_list(rule)
    return False


#: (rule field, whether a value's measure is too far for the field's bound, "least"/"most").
_Bounds = tuple[tuple[str, Callable[[Any], bool], str], ...]


def _type_problem(value: Any, expected: str, path: Path) -> Problem:
    found = short_repr(value)
    return Problem(path=path, message=f"expected {expected}, found {found}",
                   expected=expected, found=found)


def _check_text(value: str, rule: Mapping[str, Any], path: Path) -> list[Problem]:
    problems: list[Problem] = []
    length = len(value)
    bounds: _Bounds = (("minLength", lambda n: length < n, "least"),
                       ("maxLength", lambda n: length > n, "most"))
    for field, too_far, word in bounds:
        if field in rule and too_far(rule[field]):
            expected = f"at {word} {_plural(rule[field], 'character')}"
            problems.append(Problem(path=path, message=f"must be {expected}, found {length}",
                                    expected=expected, found=short_repr(value)))
    pattern = rule.get("regexMatch")
    if pattern is not None and _compile(pattern).fullmatch(value) is None:
        shown = pattern if len(pattern) <= 100 else pattern[:97] + "..."
        problems.append(Problem(
            path=path, message=f"must match the pattern {shown}, found {short_repr(value)}",
            expected=f"a full match for the pattern {shown}", found=short_repr(value)))
    return problems


def _range_text(rule: Mapping[str, Any]) -> str | None:
    low, high = rule.get("minValue"), rule.get("maxValue")
    if low is not None and high is not None:
        return f"between {_num(low)} and {_num(high)}"
    if low is not None:
        return f"of at least {_num(low)}"
    if high is not None:
        return f"of at most {_num(high)}"
    return None


def _check_range(value: int | float, noun: str, rule: Mapping[str, Any],
                 path: Path) -> list[Problem]:
    low, high = rule.get("minValue"), rule.get("maxValue")
    if (low is None or value >= low) and (high is None or value <= high):
        return []
    return [_type_problem(value, f"{noun} {_range_text(rule)}", path)]


def _check_precision(value: int | float, rule: Mapping[str, Any],
                     path: Path) -> list[Problem]:
    digits = precision(value)
    problems: list[Problem] = []
    bounds: _Bounds = (("minPrecision", lambda n: digits < n, "least"),
                       ("maxPrecision", lambda n: digits > n, "most"))
    for field, too_far, word in bounds:
        if field in rule and too_far(rule[field]):
            expected = f"at {word} {_plural(rule[field], 'digit')} after the decimal point"
            problems.append(Problem(
                path=path, message=f"must have {expected}, found {_num(value)} "
                f"({_plural(digits, 'digit')})", expected=expected, found=short_repr(value)))
    return problems


def _check_scalar_rules(value: Any, scalar_type: str, rule: Mapping[str, Any],
                        path: Path) -> list[Problem]:
    if scalar_type == "string":
        return _check_text(value, rule, path)
    if scalar_type == "integer":
        return _check_range(value, "an integer", rule, path)
    if scalar_type == "double":
        return _check_range(value, "a number", rule, path) + _check_precision(value, rule, path)
    return []


def _validate_scalar(value: Any, scalar_type: str, rule: Mapping[str, Any], path: Path,
                     lenient: bool) -> list[Problem]:
    ok, typed = _coerce(value, scalar_type, lenient)
    if not ok:
        return [_type_problem(value, _NOUNS[scalar_type], path)]
    return _check_scalar_rules(typed, scalar_type, rule, path)


def _options_text(options: list[Any]) -> str:
    """The options for messages, bounded: `'a', 'b', 'c'` (then `...` past ten)."""
    shown = ", ".join(short_repr(option, 40) for option in options[:10])
    return shown + (", ..." if len(options) > 10 else "")


def _select_item_problem(value: Any, rule: Mapping[str, Any], path: Path,
                         lenient: bool) -> tuple[Problem | None, Any]:
    """(problem, typed value): a problem unless `value` is one of the rule's options."""
    ok, typed = _coerce(value, _element_type(rule["dataType"]), lenient)
    if ok and any(same_value(typed, option) for option in rule["options"]):
        return None, typed
    return _type_problem(value, "one of " + _options_text(rule["options"]), path), typed


def _validate_select(value: Any, rule: Mapping[str, Any], path: Path,
                     lenient: bool) -> list[Problem]:
    if not _takes_list(rule):
        problem, _ = _select_item_problem(value, rule, path, lenient)
        return [] if problem is None else [problem]
    if not isinstance(value, list):
        return [_type_problem(value, f"a list of items from {_options_text(rule['options'])}",
                              path)]
    problems: list[Problem] = []
    chosen: list[Any] = []
    for index, item in enumerate(value):
        problem, typed = _select_item_problem(item, rule, (*path, index), lenient)
        if problem is None and any(same_value(typed, earlier) for earlier in chosen):
            problem = Problem(path=(*path, index), message=f"option {short_repr(item)} is "
                              "selected more than once", expected="distinct options",
                              found=short_repr(item))
        chosen.append(typed)
        if problem is not None:
            problems.append(problem)
    return problems


def _validate_array(value: Any, rule: Mapping[str, Any], path: Path,
                    lenient: bool) -> list[Problem]:
    element = _element_type(rule["dataType"])
    if not isinstance(value, list):
        return [_type_problem(value, f"a list of {_PLURALS[element]}", path)]
    problems: list[Problem] = []
    for index, item in enumerate(value):
        problems += _validate_scalar(item, element, rule, (*path, index), lenient)
    return problems


def validate_value(value: Any, rule: Mapping[str, Any], *, path: Path = (),
                   lenient_strings: bool = False) -> list[Problem]:
    """Every way `value` violates `rule` (empty list when it is valid), paths under `path`.

    Raises `DocumentError` when `rule` itself is malformed (see `check_schema_rule`).
    """
    rule_problems = check_schema_rule(rule)
    if rule_problems:
        raise DocumentError(rule_problems)
    path = tuple(path)
    if is_empty(value, rule, lenient_strings=lenient_strings):
        if rule.get("allowEmpty") is True:
            return []
        return [Problem(path=path, message="a value is required",
                        expected="a value (the schema rule has allowEmpty false)",
                        found="no value" if value is EMPTY else short_repr(value))]
    if "options" in rule:
        return _validate_select(value, rule, path, lenient_strings)
    if _is_array_type(rule["dataType"]):
        return _validate_array(value, rule, path, lenient_strings)
    return _validate_scalar(value, rule["dataType"], rule, path, lenient_strings)


# --------------------------------------------------------------------------- immutability


def check_immutable(previous: Mapping[str, Any], new: Mapping[str, Any],
                    immutable_parameters: Iterable[str], *, path: Path = ()) -> list[Problem]:
    """Immutable parameters whose value changed since installation (spec: MUST NOT change).

    `previous`/`new` map parameter name -> value. A parameter without a previous value
    (absent or `EMPTY`) may be set freely; one that had a value may neither change (compared
    with `same_value`) nor disappear.
    """
    problems: list[Problem] = []
    for name in sorted(set(immutable_parameters)):
        before = previous.get(name, EMPTY)
        if before is EMPTY:
            continue
        after = new.get(name, EMPTY)
        if after is EMPTY:
            problems.append(Problem(
                path=(*path, name), message=f"immutable parameter {name!r} cannot be removed "
                f"after installation (it was {short_repr(before)})",
                expected=short_repr(before), found="no value"))
        elif not same_value(before, after):
            problems.append(Problem(
                path=(*path, name), message=f"immutable parameter {name!r} cannot change after "
                f"installation: was {short_repr(before)}, found {short_repr(after)}",
                expected=short_repr(before), found=short_repr(after)))
    return problems
