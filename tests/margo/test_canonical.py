"""Canonical serialization is byte-stable: serialize(parse(serialize(x))) == serialize(x)."""

from __future__ import annotations

import json
import math
import uuid

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from margo.canonical import (
    Slot,
    _yaml_string,
    _yaml_string_slow,
    canonical_json,
    canonical_yaml,
    format_number,
    pretty_json,
    yaml_template,
)
from margo.loading import load_document

# JSON-compatible data, including strings that look like other YAML types.
tricky_strings = st.sampled_from(["yes", "no", "on", "off", "true", "False", "null", "~", "",
                                  "0o17", "0x1F", "012", "1e3", ".inf", ".nan", "1.0", "-1",
                                  "2024-01-01", "a: b", "- x", "#c", "&a", "*a", "!t", "'q'",
                                  '"d"', "multi\nline", " lead", "trail ", "tab\there", "ü✓",
                                  "@at", "`tick`", "%pct", "{x}", "[y]", "a,b", "?", "|", ">"])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20), tricky_strings,
)
json_data = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.text(max_size=8), tricky_strings),
                                               children, max_size=4)),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(json_data)
def test_yaml_round_trip_is_byte_identical(value: object) -> None:
    once = canonical_yaml(value)
    parsed = load_document(once).value
    assert parsed == value or _nan_free_equal(parsed, value)
    assert canonical_yaml(parsed) == once


@settings(max_examples=300, deadline=None)
@given(json_data)
def test_json_round_trip_is_byte_identical(value: object) -> None:
    once = canonical_json(value)
    assert canonical_json(json.loads(once)) == once


def _nan_free_equal(a: object, b: object) -> bool:
    # -0.0 == 0.0 and 1 == 1.0 already compare equal; nothing else may differ
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize(
    ("number", "text"),
    [(0.0, "0"), (-0.0, "0"), (1.0, "1"), (1.5, "1.5"), (1e21, "1e+21"),
     (1e20, "100000000000000000000"),
     (1e-7, "1e-7"), (0.000001, "0.000001"), (123e-20, "1.23e-18"), (-2.5e30, "-2.5e+30"),
     (2**64 - 1, "18446744073709551615"), (0.1 + 0.2, "0.30000000000000004")],
)
def test_numbers_are_formatted_like_ecmascript(number: float, text: str) -> None:
    assert format_number(number) == text


def test_json_keys_are_sorted_by_utf16_code_units() -> None:
    assert canonical_json({"b": 1, "a": [True, None], "é": "x", "\U0001f600": 0, "\ufb01": 1}) == (
        '{"a":[true,null],"b":1,"é":"x","\U0001f600":0,"\ufb01":1}'.encode())


def test_non_finite_numbers_are_refused() -> None:
    with pytest.raises(ValueError):
        canonical_json({"a": math.inf})
    with pytest.raises(ValueError):
        canonical_yaml({"a": math.nan})


def test_yaml_keeps_document_order_and_quotes_ambiguous_strings() -> None:
    text = canonical_yaml({"id": "x", "metadata": {"name": "n", "version": "1.0"},
                           "flags": ["yes", "0o17", True, 1e20, "oci://r/c", "a: b"],
                           "empty": {}, "none": []}).decode()
    assert text == ('id: x\nmetadata:\n  name: n\n  version: "1.0"\nflags:\n  - "yes"\n'
                    '  - "0o17"\n  - true\n  - 1.0e+20\n  - oci://r/c\n  - "a: b"\n'
                    'empty: {}\nnone: []\n')


@settings(max_examples=300, deadline=None)
@given(json_data)
def test_yaml_1_1_readers_see_the_same_data(value: object) -> None:
    """PyYAML (YAML 1.1) must read our YAML exactly as our 1.2 reader does."""
    assert yaml.safe_load(canonical_yaml(value)) == load_document(canonical_yaml(value)).value


def test_long_strings_are_never_folded() -> None:
    long = "word " * 200
    assert canonical_yaml({"a": long.strip()}).count(b"\n") == 1


def test_pretty_json_is_stable() -> None:
    assert pretty_json({"b": 1, "a": {"d": 2, "c": 3}}) == (
        '{\n  "a": {\n    "c": 3,\n    "d": 2\n  },\n  "b": 1\n}\n')


#: The document's own keys: a generated body must not replace the slots they hold.
_TEMPLATE_KEYS = ("id", "meta", "list")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(
           lambda key: key not in _TEMPLATE_KEYS), json_data, max_size=4),
       st.one_of(st.text(max_size=20), tricky_strings, st.uuids().map(str)),
       st.one_of(st.text(max_size=20), tricky_strings, st.uuids().map(str)))
def test_a_filled_template_is_the_document_serialized_afresh(
        body: dict[str, object], first: str, second: str) -> None:
    def document(a: object, b: object) -> dict[str, object]:
        # Open strings at the root, inside a nested mapping, as a list's first item and as
        # the first key of a mapping inside a list (the line a "- " shares).
        return {"id": a, **body, "meta": {"device": b, "n": 1},
                "list": [a, {"device": b, "x": [b]}]}

    template = yaml_template(document(Slot("a"), Slot("b")))
    assert template.fill({"a": first, "b": second}) == canonical_yaml(document(first, second))
    assert template.slots == ("a", "b", "a", "b", "b")


def test_templates_refuse_what_cannot_be_filled() -> None:
    template = yaml_template({"id": Slot("id")})
    with pytest.raises(TypeError, match="needs a string"):
        template.fill({"id": 7})  # type: ignore[dict-item]
    with pytest.raises(KeyError):
        template.fill({})
    with pytest.raises(TypeError):
        yaml_template({})
    with pytest.raises(TypeError):  # a slot outside a template is not serialized silently
        canonical_yaml({"id": Slot("id")})


@settings(max_examples=500, deadline=None)
@given(st.uuids())
def test_uuids_take_the_shortcut_to_the_same_text(value: uuid.UUID) -> None:
    text = str(value)
    assert _yaml_string(text) == _yaml_string_slow(text) == text
    upper = text.upper()  # not the shortcut's form: decided the long way
    assert _yaml_string(upper) == _yaml_string_slow(upper)


@pytest.mark.parametrize("value", [{"a": "A\n"}, {"A\n": None}, {"": None, "A\n": None},
                                   ["x\n"], {"k": {"deep\n": "line\n"}}])
def test_a_string_ending_in_a_newline_keeps_it(value: object) -> None:
    """Python's `$` also matches before a final newline: such a string was written plain,
    which dropped the newline of a value and made a key unreadable (found by the property
    test above)."""
    text = canonical_yaml(value)
    assert yaml.safe_load(text) == load_document(text).value == value
