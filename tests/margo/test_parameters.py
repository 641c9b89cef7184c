"""Parameter values against configuration schema rules (margo.parameters)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from margo.errors import DocumentError, Problem
from margo.parameters import (
    DATA_TYPES,
    EMPTY,
    MAX_PATTERN_LENGTH,
    check_immutable,
    check_schema_rule,
    is_empty,
    precision,
    same_value,
    validate_value,
)

SPEC_VALID = Path(__file__).resolve().parents[1] / "fixtures" / "spec-examples" / "valid"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((SPEC_VALID / name).read_text(encoding="utf-8"))


def _rules(description: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["name"]: rule for rule in description["configuration"]["schema"]}


def _settings(description: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        setting["parameter"]: setting
        for section in description["configuration"]["sections"]
        for setting in section["settings"]
    }


def _pairs(problems: list[Problem]) -> list[tuple[tuple, str]]:
    return [(p.path, p.message) for p in problems]


def rule(data_type: str, **fields: Any) -> dict[str, Any]:
    return {"name": "r", "dataType": data_type, **fields}


# --------------------------------------------------------------------------- valid values

VALID = [
    # id, rule, value, lenient
    ("string-plain", rule("string"), "hello", False),
    ("string-length-bounds-inclusive", rule("string", minLength=2, maxLength=5), "abcde", False),
    ("string-length-counts-code-points", rule("string", maxLength=2), "éé", False),
    ("string-regex-fullmatch", rule("string", regexMatch="[a-z]+"), "abc", False),
    ("string-digitron-email", rule("string", regexMatch=".*@[a-z0-9.-]*"), "a@b.com", False),
    ("integer-plain", rule("integer"), 7, False),
    ("integer-bounds-inclusive-low", rule("integer", minValue=30, maxValue=360), 30, False),
    ("integer-bounds-inclusive-high", rule("integer", minValue=30, maxValue=360), 360, False),
    ("integer-huge", rule("integer", minValue=0), 10**40, False),
    ("integer-lenient-text", rule("integer", minValue=30), "120", True),
    ("integer-lenient-signed", rule("integer"), "-4", True),
    ("double-float", rule("double"), 0.5, False),
    ("double-accepts-int", rule("double", minValue=0.5), 4, False),
    ("double-bounds", rule("double", minValue=0.5, maxValue=2.5), 2.5, False),
    ("double-precision-within", rule("double", minPrecision=1, maxPrecision=2), 0.25, False),
    ("double-lenient-text", rule("double", minValue=0.5), "0.75", True),
    ("double-lenient-int-text", rule("double"), "4", True),
    ("double-lenient-exponent", rule("double"), "1e-3", True),
    ("boolean-true", rule("boolean"), True, False),
    ("boolean-false", rule("boolean"), False, False),
    ("boolean-lenient-true", rule("boolean"), "true", True),
    ("boolean-lenient-false", rule("boolean"), "false", True),
    ("lenient-keeps-string-as-string", rule("string", maxLength=3), "4", True),
    ("select-string", rule("string", options=["a", "b"]), "b", False),
    ("select-integer", rule("integer", options=[1, 2]), 2, False),
    ("select-integer-lenient", rule("integer", options=[1, 2]), "2", True),
    ("select-double-int-equals-float", rule("double", options=[0.5, 1.0]), 1, False),
    ("select-boolean", rule("boolean", options=[True]), True, False),
    ("multiselect", rule("string", options=["a", "b", "c"], multiselect=True), ["c", "a"], False),
    ("multiselect-array-type", rule("array[string]", options=["a", "b"]), ["a", "b"], False),
    ("multiselect-single-item", rule("integer", options=[1, 2], multiselect=True), [2], False),
    ("array-string", rule("array[string]", minLength=1, regexMatch="[a-z]+"), ["a", "bc"], False),
    ("array-integer", rule("array[integer]", minValue=0, maxValue=9), [0, 9, 5], False),
    ("array-double", rule("array[double]", maxPrecision=1), [0.5, 1, 2.0], False),
    ("array-boolean", rule("array[boolean]"), [True, False], False),
    ("array-boolean-lenient", rule("array[boolean]"), ["true", False], True),
    ("array-elements-not-empty-rule", rule("array[string]"), [""], False),
]


@pytest.mark.parametrize(("rule_", "value", "lenient"), [c[1:] for c in VALID],
                         ids=[c[0] for c in VALID])
def test_valid_values(rule_: dict, value: Any, lenient: bool) -> None:
    assert check_schema_rule(rule_) == []
    assert validate_value(value, rule_, lenient_strings=lenient) == []


# --------------------------------------------------------------------------- invalid values

INVALID = [
    # id, rule, value, lenient, [(path, message)]
    ("string-too-short", rule("string", minLength=2), "a", False,
     [((), "must be at least 2 characters, found 1")]),
    ("string-too-long", rule("string", maxLength=45), "x" * 52, False,
     [((), "must be at most 45 characters, found 52")]),
    ("string-max-one-character-singular", rule("string", maxLength=1), "ab", False,
     [((), "must be at most 1 character, found 2")]),
    ("string-regex-needs-full-match", rule("string", regexMatch="[a-z]+"), "abc1", False,
     [((), "must match the pattern [a-z]+, found 'abc1'")]),
    ("string-regex-search-is-not-enough", rule("string", regexMatch="b"), "abc", False,
     [((), "must match the pattern b, found 'abc'")]),
    ("string-every-rule-reported", rule("string", minLength=5, regexMatch="[a-z]+"), "AB", False,
     [((), "must be at least 5 characters, found 2"),
      ((), "must match the pattern [a-z]+, found 'AB'")]),
    ("string-rejects-int", rule("string"), 4, False, [((), "expected a string, found 4")]),
    ("string-rejects-int-lenient", rule("string"), 4, True, [((), "expected a string, found 4")]),
    ("string-rejects-bool", rule("string"), True, False,
     [((), "expected a string, found true")]),
    ("string-rejects-list", rule("string"), [], False,
     [((), "expected a string, found an empty list")]),
    ("integer-rejects-bool", rule("integer"), True, False,
     [((), "expected an integer, found true")]),
    ("integer-rejects-integral-float", rule("integer"), 3.0, False,
     [((), "expected an integer, found 3.0")]),
    ("integer-rejects-text-strict", rule("integer"), "4", False,
     [((), "expected an integer, found '4'")]),
    ("integer-rejects-float-text-lenient", rule("integer"), "4.0", True,
     [((), "expected an integer, found '4.0'")]),
    ("integer-rejects-padded-text-lenient", rule("integer"), " 4", True,
     [((), "expected an integer, found ' 4'")]),
    ("integer-rejects-underscore-text-lenient", rule("integer"), "1_000", True,
     [((), "expected an integer, found '1_000'")]),
    ("integer-rejects-bool-text-lenient", rule("integer"), "true", True,
     [((), "expected an integer, found 'true'")]),
    ("integer-empty-text-strict-is-type-error", rule("integer"), "", False,
     [((), "expected an integer, found ''")]),
    ("integer-above-range", rule("integer", minValue=30, maxValue=360), 400, False,
     [((), "expected an integer between 30 and 360, found 400")]),
    ("integer-below-range", rule("integer", minValue=30, maxValue=360), 29, False,
     [((), "expected an integer between 30 and 360, found 29")]),
    ("integer-below-min-only", rule("integer", minValue=16384), 1024, False,
     [((), "expected an integer of at least 16384, found 1024")]),
    ("integer-above-max-only", rule("integer", maxValue=10), 11, False,
     [((), "expected an integer of at most 10, found 11")]),
    ("integer-lenient-text-checked-against-range", rule("integer", maxValue=10), "11", True,
     [((), "expected an integer of at most 10, found 11")]),
    ("double-rejects-bool", rule("double"), False, False,
     [((), "expected a number, found false")]),
    ("double-rejects-nan", rule("double"), math.nan, False,
     [((), "expected a number, found nan")]),
    ("double-rejects-inf", rule("double"), math.inf, False,
     [((), "expected a number, found inf")]),
    ("double-rejects-text-strict", rule("double"), "0.5", False,
     [((), "expected a number, found '0.5'")]),
    ("double-rejects-nan-text-lenient", rule("double"), "nan", True,
     [((), "expected a number, found 'nan'")]),
    ("double-rejects-overflow-text-lenient", rule("double"), "1e999", True,
     [((), "expected a number, found '1e999'")]),
    ("double-below-min", rule("double", minValue=0.5), 0.25, False,
     [((), "expected a number of at least 0.5, found 0.25")]),
    ("double-outside-range", rule("double", minValue=0.5, maxValue=2), 3.5, False,
     [((), "expected a number between 0.5 and 2, found 3.5")]),
    ("double-too-precise", rule("double", maxPrecision=1), 0.25, False,
     [((), "must have at most 1 digit after the decimal point, found 0.25 (2 digits)")]),
    ("double-not-precise-enough", rule("double", minPrecision=1), 1.0, False,
     [((), "must have at least 1 digit after the decimal point, found 1.0 (0 digits)")]),
    ("double-int-has-precision-zero", rule("double", minPrecision=2), 3, False,
     [((), "must have at least 2 digits after the decimal point, found 3 (0 digits)")]),
    ("double-range-and-precision", rule("double", minValue=0.5, maxPrecision=1), 0.25, False,
     [((), "expected a number of at least 0.5, found 0.25"),
      ((), "must have at most 1 digit after the decimal point, found 0.25 (2 digits)")]),
    ("boolean-rejects-int", rule("boolean"), 1, False,
     [((), "expected true or false, found 1")]),
    ("boolean-rejects-text-strict", rule("boolean"), "true", False,
     [((), "expected true or false, found 'true'")]),
    ("boolean-rejects-capitalised-text-lenient", rule("boolean"), "True", True,
     [((), "expected true or false, found 'True'")]),
    ("boolean-rejects-yes-lenient", rule("boolean"), "yes", True,
     [((), "expected true or false, found 'yes'")]),
    ("select-not-an-option", rule("string", options=["a", "b"]), "c", False,
     [((), "expected one of 'a', 'b', found 'c'")]),
    ("select-integer-rejects-bool", rule("integer", options=[1, 2]), True, False,
     [((), "expected one of 1, 2, found true")]),
    ("select-integer-rejects-text-strict", rule("integer", options=[1, 2]), "1", False,
     [((), "expected one of 1, 2, found '1'")]),
    ("select-string-rejects-int", rule("string", options=["1"]), 1, False,
     [((), "expected one of '1', found 1")]),
    ("select-single-rejects-list", rule("string", options=["a"]), ["a"], False,
     [((), "expected one of 'a', found a list of 1 item(s)")]),
    ("multiselect-rejects-scalar", rule("string", options=["a", "b"], multiselect=True), "a",
     False, [((), "expected a list of items from 'a', 'b', found 'a'")]),
    ("multiselect-bad-item-has-index", rule("string", options=["a", "b"], multiselect=True),
     ["a", "z"], False, [((1,), "expected one of 'a', 'b', found 'z'")]),
    ("multiselect-duplicate", rule("string", options=["a", "b"], multiselect=True),
     ["a", "b", "a"], False, [((2,), "option 'a' is selected more than once")]),
    ("multiselect-duplicate-after-lenient", rule("integer", options=[1, 2], multiselect=True),
     [1, "1"], True, [((1,), "option '1' is selected more than once")]),
    ("array-rejects-scalar", rule("array[string]"), "abc", False,
     [((), "expected a list of strings, found 'abc'")]),
    ("array-rejects-empty-text-strict", rule("array[integer]"), "", False,
     [((), "expected a list of integers, found ''")]),
    ("array-integer-bad-elements", rule("array[integer]", minValue=0, maxValue=10),
     [1, True, "3", 400], False,
     [((1,), "expected an integer, found true"),
      ((2,), "expected an integer, found '3'"),
      ((3,), "expected an integer between 0 and 10, found 400")]),
    ("array-string-element-rules", rule("array[string]", maxLength=2, regexMatch="[a-z]*"),
     ["ok", "TOO", None], False,
     [((1,), "must be at most 2 characters, found 3"),
      ((1,), "must match the pattern [a-z]*, found 'TOO'"),
      ((2,), "expected a string, found null")]),
    ("array-double-element-precision", rule("array[double]", maxPrecision=1), [0.5, 0.25],
     False, [((1,), "must have at most 1 digit after the decimal point, found 0.25 (2 digits)")]),
    ("array-boolean-element-type", rule("array[boolean]"), [True, "false"], False,
     [((1,), "expected true or false, found 'false'")]),
]


@pytest.mark.parametrize(("rule_", "value", "lenient", "expected"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_values(rule_: dict, value: Any, lenient: bool,
                        expected: list[tuple[tuple, str]]) -> None:
    assert check_schema_rule(rule_) == []
    assert _pairs(validate_value(value, rule_, lenient_strings=lenient)) == expected


def test_problems_carry_expected_and_found() -> None:
    [problem] = validate_value(400, rule("integer", minValue=30, maxValue=360))
    assert problem.expected == "an integer between 30 and 360"
    assert problem.found == "400"


def test_element_paths_extend_the_given_path() -> None:
    base = ("spec", "parameters", "ports", "value")
    problems = validate_value([1, "x"], rule("array[integer]"), path=base)
    assert [p.path for p in problems] == [(*base, 1)]
    assert problems[0].json_path == "$.spec.parameters.ports.value[1]"


# --------------------------------------------------------------------------- allowEmpty

EMPTY_VALUES = [
    # id, rule, value, lenient
    ("string-missing", rule("string", minLength=5), EMPTY, False),
    ("string-none", rule("string", minLength=5), None, False),
    ("string-blank", rule("string", minLength=5, regexMatch="[a-z]+"), "", False),
    ("integer-missing", rule("integer", minValue=30), EMPTY, False),
    ("integer-none", rule("integer", minValue=30), None, False),
    ("integer-blank-text-lenient", rule("integer", minValue=30), "", True),
    ("double-none", rule("double", minPrecision=2), None, False),
    ("boolean-missing", rule("boolean"), EMPTY, False),
    ("boolean-blank-text-lenient", rule("boolean"), "", True),
    ("select-none", rule("string", options=["a"]), None, False),
    ("select-blank", rule("string", options=["a"]), "", False),
    ("multiselect-empty-list", rule("string", options=["a"], multiselect=True), [], False),
    ("array-empty-list", rule("array[integer]", minValue=3), [], False),
    ("array-none", rule("array[string]"), None, False),
]


@pytest.mark.parametrize(("rule_", "value", "lenient"), [c[1:] for c in EMPTY_VALUES],
                         ids=[c[0] for c in EMPTY_VALUES])
@pytest.mark.parametrize("allow_empty", [True, False, None],
                         ids=["allowEmpty-true", "allowEmpty-false", "allowEmpty-absent"])
def test_allow_empty(rule_: dict, value: Any, lenient: bool, allow_empty: bool | None) -> None:
    if allow_empty is not None:
        rule_ = {**rule_, "allowEmpty": allow_empty}
    assert is_empty(value, rule_, lenient_strings=lenient)
    problems = validate_value(value, rule_, path=("v",), lenient_strings=lenient)
    if allow_empty:
        assert problems == []  # accepted, and no other rule is applied to it
    else:
        assert _pairs(problems) == [(("v",), "a value is required")]


@pytest.mark.parametrize(("value", "rule_", "lenient"), [
    pytest.param(" ", rule("string"), False, id="whitespace-is-a-value"),
    pytest.param(0, rule("integer"), False, id="zero-is-a-value"),
    pytest.param(False, rule("boolean"), False, id="false-is-a-value"),
    pytest.param("", rule("integer"), False, id="blank-integer-strict-is-a-type-error"),
    pytest.param([], rule("string"), False, id="empty-list-for-string"),
    pytest.param("", rule("array[string]"), False, id="blank-for-array-strict"),
    pytest.param([""], rule("array[string]"), False, id="list-of-blank"),
])
def test_not_empty(value: Any, rule_: dict, lenient: bool) -> None:
    assert not is_empty(value, rule_, lenient_strings=lenient)


def test_empty_sentinel_is_a_falsy_singleton() -> None:
    import copy
    import pickle

    assert not EMPTY
    assert repr(EMPTY) == "EMPTY"
    assert copy.deepcopy(EMPTY) is EMPTY
    assert pickle.loads(pickle.dumps(EMPTY)) is EMPTY


def test_missing_value_reports_no_value() -> None:
    [problem] = validate_value(EMPTY, rule("string"))
    assert problem.found == "no value"


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize(("value", "digits"), [
    pytest.param(1, 0, id="int"),
    pytest.param(1.0, 0, id="one-point-zero"),
    pytest.param(100.0, 0, id="trailing-zeros"),
    pytest.param(1e20, 0, id="large-exponent"),
    pytest.param(0.5, 1, id="half"),
    pytest.param(0.25, 2, id="quarter"),
    pytest.param(-2.125, 3, id="negative"),
    pytest.param(0.1, 1, id="shortest-repr-not-binary-expansion"),
    pytest.param(1e-07, 7, id="small-exponent"),
    pytest.param(1 / 3, 16, id="third"),
])
def test_precision(value: float, digits: int) -> None:
    assert precision(value) == digits


# --------------------------------------------------------------------------- schema rules


def _official_rules() -> list[Any]:
    digitron = _rules(_load("ApplicationDescription-002.yaml"))
    hello = _rules(_load("ApplicationDescription-001.yaml"))
    return [pytest.param(r, id=f"digitron-{n}") for n, r in digitron.items()] + [
        pytest.param(r, id=f"hello-world-{n}") for n, r in hello.items()]


@pytest.mark.parametrize("rule_", [
    *_official_rules(),
    *[pytest.param(rule(t), id=f"bare-{t}") for t in DATA_TYPES],
    pytest.param(rule("boolean", allowEmpty=True), id="boolean-allowEmpty"),
    pytest.param(rule("double", minValue=0, maxValue=0.5, minPrecision=0, maxPrecision=0),
                 id="double-all-fields"),
    pytest.param(rule("array[string]", minLength=0, maxLength=0, regexMatch=""),
                 id="array-string-element-fields"),
    pytest.param(rule("array[double]", minValue=1, maxPrecision=2), id="array-double-fields"),
    pytest.param(rule("string", options=["a"], multiselect=False, allowEmpty=True),
                 id="select-all-fields"),
    pytest.param(rule("array[integer]", options=[1, 2], multiselect=True),
                 id="select-array-multiselect"),
    pytest.param(rule("double", options=[1, 0.5]), id="select-double-accepts-int-option"),
    pytest.param(rule("string", **{"x-acme-extensions": {"ui": "slider"}}), id="extension"),
    pytest.param(rule("string", regexMatch="a" * MAX_PATTERN_LENGTH), id="longest-pattern"),
])
def test_well_formed_rules(rule_: dict) -> None:
    assert check_schema_rule(rule_) == []


BAD_RULES = [
    # id, rule, [(path, message)]
    ("not-a-mapping", ["string"],
     [((), "expected a schema rule object, found a list of 1 item(s)")]),
    ("missing-dataType", {"name": "r"}, [(("dataType",), "dataType is required")]),
    ("unknown-dataType", rule("float"),
     [(("dataType",), "unknown dataType 'float'; expected one of " + ", ".join(DATA_TYPES))]),
    ("dataType-not-text", rule(5),  # type: ignore[arg-type]
     [(("dataType",), "unknown dataType 5; expected one of " + ", ".join(DATA_TYPES))]),
    ("unknown-dataType-still-reports-typos", {**rule("map"), "maxlength": 3},
     [(("dataType",), "unknown dataType 'map'; expected one of " + ", ".join(DATA_TYPES)),
      (("maxlength",), "unknown schema rule field 'maxlength'")]),
    ("unknown-field", rule("string", maxlength=3),
     [(("maxlength",), "unknown schema rule field 'maxlength'")]),
    ("minLength-on-integer", rule("integer", minLength=3),
     [(("minLength",), "minLength does not apply to dataType integer")]),
    ("minPrecision-on-string", rule("string", minPrecision=1),
     [(("minPrecision",), "minPrecision does not apply to dataType string")]),
    ("maxValue-on-boolean", rule("boolean", maxValue=1),
     [(("maxValue",), "maxValue does not apply to dataType boolean")]),
    ("regexMatch-on-double", rule("double", regexMatch="x"),
     [(("regexMatch",), "regexMatch does not apply to dataType double")]),
    ("maxPrecision-on-integer", rule("integer", maxPrecision=1),
     [(("maxPrecision",), "maxPrecision does not apply to dataType integer")]),
    ("minLength-on-array-integer", rule("array[integer]", minLength=1),
     [(("minLength",), "minLength does not apply to dataType array[integer]")]),
    ("minLength-on-select", rule("string", options=["a"], minLength=1),
     [(("minLength",), "minLength does not apply to a select rule (a rule with options)")]),
    ("negative-minLength", rule("string", minLength=-1),
     [(("minLength",), "minLength must be a non-negative integer, found -1")]),
    ("float-maxLength", rule("string", maxLength=2.0),
     [(("maxLength",), "maxLength must be a non-negative integer, found 2.0")]),
    ("bool-minLength", rule("string", minLength=True),
     [(("minLength",), "minLength must be a non-negative integer, found true")]),
    ("negative-maxPrecision", rule("double", maxPrecision=-2),
     [(("maxPrecision",), "maxPrecision must be a non-negative integer, found -2")]),
    ("minLength-above-maxLength", rule("string", minLength=5, maxLength=2),
     [(("minLength",), "minLength 5 is greater than maxLength 2")]),
    ("integer-minValue-above-maxValue", rule("integer", minValue=360, maxValue=30),
     [(("minValue",), "minValue 360 is greater than maxValue 30")]),
    ("double-minValue-above-maxValue", rule("double", minValue=1.5, maxValue=0.5),
     [(("minValue",), "minValue 1.5 is greater than maxValue 0.5")]),
    ("minPrecision-above-maxPrecision", rule("double", minPrecision=3, maxPrecision=1),
     [(("minPrecision",), "minPrecision 3 is greater than maxPrecision 1")]),
    ("integer-float-bound", rule("integer", minValue=0.5),
     [(("minValue",), "minValue must be an integer, found 0.5")]),
    ("integer-text-bound", rule("integer", maxValue="10"),
     [(("maxValue",), "maxValue must be an integer, found '10'")]),
    ("integer-bool-bound", rule("integer", minValue=False),
     [(("minValue",), "minValue must be an integer, found false")]),
    ("double-nan-bound", rule("double", minValue=math.nan),
     [(("minValue",), "minValue must be a finite number, found nan")]),
    ("regex-does-not-compile", rule("string", regexMatch="(a"),
     [(("regexMatch",), "regexMatch is not a valid regular expression: missing ), "
       "unterminated subpattern at position 0")]),
    ("regex-too-long", rule("string", regexMatch="a" * (MAX_PATTERN_LENGTH + 1)),
     [(("regexMatch",), f"regexMatch must be at most {MAX_PATTERN_LENGTH} characters, "
       f"found {MAX_PATTERN_LENGTH + 1}")]),
    ("regex-not-text", rule("string", regexMatch=5),
     [(("regexMatch",), "regexMatch must be a string, found 5")]),
    ("options-empty", rule("string", options=[]),
     [(("options",), "options must be a non-empty list, found an empty list")]),
    ("options-not-a-list", rule("string", options="a,b"),
     [(("options",), "options must be a non-empty list, found 'a,b'")]),
    ("option-wrong-type", rule("string", options=["a", 1]),
     [(("options", 1), "option must be a string (the dataType is string), found 1")]),
    ("option-bool-for-integer", rule("integer", options=[1, True]),
     [(("options", 1), "option must be an integer (the dataType is integer), found true")]),
    ("option-float-for-integer", rule("array[integer]", options=[2.0]),
     [(("options", 0), "option must be an integer (the dataType is array[integer]), "
       "found 2.0")]),
    ("duplicate-options", rule("string", options=["a", "b", "a"]),
     [(("options", 2), "duplicate option 'a'")]),
    ("duplicate-double-options", rule("double", options=[1, 1.0]),
     [(("options", 1), "duplicate option 1.0")]),
    ("multiselect-without-options", rule("string", multiselect=True),
     [(("multiselect",), "multiselect needs options (it only applies to selects)")]),
    ("multiselect-not-bool", rule("string", options=["a"], multiselect="yes"),
     [(("multiselect",), "multiselect must be true or false, found 'yes'")]),
    ("allowEmpty-not-bool", rule("string", allowEmpty="false"),
     [(("allowEmpty",), "allowEmpty must be true or false, found 'false'")]),
    ("array-select-multiselect-false", rule("array[string]", options=["a"], multiselect=False),
     [(("multiselect",), "a select with dataType array[string] takes a list, so multiselect "
       "cannot be false")]),
    ("every-problem-reported", rule("integer", minLength=1, minValue=5, maxValue=1, bogus=1),
     [(("bogus",), "unknown schema rule field 'bogus'"),
      (("minLength",), "minLength does not apply to dataType integer"),
      (("minValue",), "minValue 5 is greater than maxValue 1")]),
]


@pytest.mark.parametrize(("rule_", "expected"), [c[1:] for c in BAD_RULES],
                         ids=[c[0] for c in BAD_RULES])
def test_malformed_rules(rule_: Any, expected: list[tuple[tuple, str]]) -> None:
    assert _pairs(check_schema_rule(rule_)) == expected


def test_rule_problem_paths_extend_the_given_path() -> None:
    base = ("configuration", "schema", 3)
    problems = check_schema_rule(rule("string", minLength=-1), path=base)
    assert [p.path for p in problems] == [(*base, "minLength")]
    assert problems[0].json_path == "$.configuration.schema[3].minLength"


def test_validate_value_refuses_malformed_rule() -> None:
    with pytest.raises(DocumentError) as caught:
        validate_value("x", rule("string", regexMatch="("))
    assert [p.path for p in caught.value.problems] == [("regexMatch",)]


# --------------------------------------------------------------------------- official examples


def test_digitron_description_defaults() -> None:
    """The Digitron description's own defaults: set ones pass, unset required ones do not."""
    description = _load("ApplicationDescription-002.yaml")
    rules, settings = _rules(description), _settings(description)
    problems = []
    for name, parameter in sorted(description["parameters"].items()):
        schema = rules[settings[name]["schema"]]
        problems += validate_value(parameter.get("value", EMPTY), schema,
                                   path=("parameters", name, "value"))
    # siteId is optionalText (allowEmpty: true); the identity and admin settings are required.
    assert _pairs(problems) == [
        (("parameters", n, "value"), "a value is required")
        for n in ["adminName", "adminPrincipalName", "idpClientId", "idpName", "idpProvider",
                  "idpUrl"]
    ]


@pytest.mark.parametrize("example", ["ApplicationDeployment-helm.yaml",
                                     "ApplicationDeployment-compose.yaml"])
def test_stringified_deployment_values_need_lenient_mode(example: str) -> None:
    """Older deployments write "4" and "120": fine when lenient, type errors when strict."""
    description = _load("ApplicationDescription-002.yaml")
    rules, settings = _rules(description), _settings(description)
    parameters = _load(example)["spec"]["parameters"]
    strict, lenient = [], []
    for name, parameter in sorted(parameters.items()):
        schema = rules[settings[name]["schema"]]
        strict += validate_value(parameter["value"], schema, path=(name,))
        lenient += validate_value(parameter["value"], schema, path=(name,),
                                  lenient_strings=True)
    assert lenient == []
    stringified = {"cpuLimit", "memoryLimit", "pollFrequency"} & set(parameters)
    assert {p.path[0] for p in strict} == stringified
    assert all(p.message.startswith(("expected an integer, found '", "expected a number, found '"))
               for p in strict)


@pytest.mark.parametrize(("value", "ok"), [
    pytest.param("Hello", True, id="example-value"),
    pytest.param("x" * 45, True, id="at-max-length"),
    pytest.param("x" * 46, False, id="over-max-length"),
    pytest.param("", False, id="blank-is-required"),
])
def test_hello_world_greeting(value: str, ok: bool) -> None:
    [schema] = _rules(_load("ApplicationDescription-001.yaml")).values()
    assert (validate_value(value, schema) == []) is ok


@pytest.mark.parametrize(("value", "ok"), [
    pytest.param("https://123-abc.com", True, id="https"),
    pytest.param("http://123-abc.com", False, id="http-not-allowed-by-the-pattern"),
    pytest.param("https://123-abc.com trailing", False, id="must-match-whole-value"),
])
def test_digitron_url_pattern(value: str, ok: bool) -> None:
    schema = _rules(_load("ApplicationDescription-002.yaml"))["url"]
    assert (validate_value(value, schema) == []) is ok


# --------------------------------------------------------------------------- immutability

IMMUTABLE = [
    # id, previous, new, immutable, [(path, message)]
    ("unchanged", {"idpName": "Azure AD"}, {"idpName": "Azure AD"}, ["idpName"], []),
    ("changed", {"idpName": "Azure AD"}, {"idpName": "Okta"}, ["idpName"],
     [(("idpName",), "immutable parameter 'idpName' cannot change after installation: "
       "was 'Azure AD', found 'Okta'")]),
    ("removed", {"idpName": "Azure AD"}, {}, ["idpName"],
     [(("idpName",), "immutable parameter 'idpName' cannot be removed after installation "
       "(it was 'Azure AD')")]),
    ("removed-as-EMPTY", {"idpName": "Azure AD"}, {"idpName": EMPTY}, ["idpName"],
     [(("idpName",), "immutable parameter 'idpName' cannot be removed after installation "
       "(it was 'Azure AD')")]),
    ("set-to-null", {"idpName": "Azure AD"}, {"idpName": None}, ["idpName"],
     [(("idpName",), "immutable parameter 'idpName' cannot change after installation: "
       "was 'Azure AD', found null")]),
    ("first-value-may-be-set", {}, {"idpName": "Okta"}, ["idpName"], []),
    ("previous-EMPTY-may-be-set", {"idpName": EMPTY}, {"idpName": "Okta"}, ["idpName"], []),
    ("mutable-may-change", {"pollFrequency": 30}, {"pollFrequency": 60}, ["idpName"], []),
    ("int-equals-float", {"cpu": 1}, {"cpu": 1.0}, ["cpu"], []),
    ("int-is-not-bool", {"flag": 1}, {"flag": True}, ["flag"],
     [(("flag",), "immutable parameter 'flag' cannot change after installation: "
       "was 1, found true")]),
    ("text-is-not-number", {"cpu": "4"}, {"cpu": 4}, ["cpu"],
     [(("cpu",), "immutable parameter 'cpu' cannot change after installation: "
       "was '4', found 4")]),
    ("list-changed", {"ports": [1, 2]}, {"ports": [2, 1]}, ["ports"],
     [(("ports",), "immutable parameter 'ports' cannot change after installation: "
       "was a list of 2 item(s), found a list of 2 item(s)")]),
    ("several-sorted", {"b": 1, "a": 1}, {"b": 2, "a": 2}, ("b", "a", "b"),
     [(("a",), "immutable parameter 'a' cannot change after installation: was 1, found 2"),
      (("b",), "immutable parameter 'b' cannot change after installation: was 1, found 2")]),
]


@pytest.mark.parametrize(("previous", "new", "immutable", "expected"),
                         [c[1:] for c in IMMUTABLE], ids=[c[0] for c in IMMUTABLE])
def test_check_immutable(previous: dict, new: dict, immutable: list[str],
                         expected: list[tuple[tuple, str]]) -> None:
    assert _pairs(check_immutable(previous, new, immutable)) == expected


def test_immutable_paths_extend_the_given_path() -> None:
    problems = check_immutable({"x": 1}, {"x": 2}, ["x"], path=("spec", "parameters"))
    assert [p.path for p in problems] == [("spec", "parameters", "x")]


def test_digitron_immutable_settings() -> None:
    settings = _settings(_load("ApplicationDescription-002.yaml"))
    immutable = [name for name, s in settings.items() if s.get("immutable")]
    installed = {"idpName": "Azure AD", "idpUrl": "https://a.com", "pollFrequency": 30}
    update = {"idpName": "Azure AD", "idpUrl": "https://b.com", "pollFrequency": 60}
    assert [p.path for p in check_immutable(installed, update, immutable)] == [("idpUrl",)]


@pytest.mark.parametrize(("a", "b", "same"), [
    pytest.param(1, 1.0, True, id="int-float"),
    pytest.param(True, 1, False, id="bool-int"),
    pytest.param(False, False, True, id="bool-bool"),
    pytest.param("1", 1, False, id="text-int"),
    pytest.param(None, None, True, id="null"),
    pytest.param([1, [True]], [1.0, [True]], True, id="nested-list"),
    pytest.param([1], [1, 2], False, id="list-length"),
    pytest.param({"a": [1]}, {"a": [1.0]}, True, id="mapping"),
    pytest.param({"a": 1}, {"b": 1}, False, id="mapping-keys"),
])
def test_same_value(a: Any, b: Any, same: bool) -> None:
    assert same_value(a, b) is same
    assert same_value(b, a) is same


# --------------------------------------------------------------------------- properties


@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_lenient_integer_text_matches_typed_value(number: int) -> None:
    schema = rule("integer", minValue=-1000, maxValue=1000)
    typed = validate_value(number, schema)
    assert validate_value(str(number), schema, lenient_strings=True) == typed


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_lenient_double_text_matches_typed_value(number: float) -> None:
    schema = rule("double", minValue=-1.5, maxValue=1e6, maxPrecision=3)
    typed = validate_value(number, schema)
    assert validate_value(repr(number), schema, lenient_strings=True) == typed
