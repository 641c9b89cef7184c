"""Intent expressions: literals pass through, expressions see one device, the sandbox holds."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.expression_limits import MAX_RESULT_CHARS, MAX_RESULT_ITEMS
from compiler.expressions import (
    CompiledValue,
    ExpressionError,
    compile_value,
    device_context,
    is_expression,
)

GI = 1024**3

DEVICE = device_context(
    "gw-1",
    properties={
        "cpu": {"cores": 4, "architecture": "amd64"},
        "memory": "59 Gi",
        "storage": "1.5Ti",
        "disks": [{"name": "sda", "size": "10Gi"}, {"name": "sdb", "size": "512Mi"}],
        "items": 7,
        "gpu": None,
    },
    labels={
        "example.com/nodes": "3",
        "example.com/site": "lyon-2",
        "example.com/replicas": 5,
        "tier.v1": "edge",
        "gpu": "true",
        "_private": "underscore",
    },
    extensions={"vendor.io": {"firmware": "1.2.3", "zones": ["a", "b"]}},
)
CONTEXT = {"device": DEVICE}


def render(value: object, context: dict[str, Any] | None = None) -> Any:
    return compile_value(value).render(CONTEXT if context is None else context)


def render_error(value: object) -> ExpressionError:
    with pytest.raises(ExpressionError) as info:
        render(value)
    return info.value


# --------------------------------------------------------------------------------------------
# What counts as an expression


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("{{ x }}", True, id="expression"),
        pytest.param("a {{ x }} b", True, id="mixed"),
        pytest.param("{% if %}", True, id="statement-counts-so-it-is-rejected"),
        pytest.param("color {#fff}", True, id="comment-opener-counts"),
        pytest.param("plain text", False, id="plain"),
        pytest.param("{ single }", False, id="single-brace"),
        pytest.param("50%", False, id="percent"),
        pytest.param(42, False, id="int"),
        pytest.param(["{{ x }}"], False, id="list-is-not-itself-an-expression"),
        pytest.param(None, False, id="none"),
    ],
)
def test_is_expression(value: object, expected: bool) -> None:
    assert is_expression(value) is expected


# --------------------------------------------------------------------------------------------
# Literals


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(42, id="int"),
        pytest.param(1.5, id="float"),
        pytest.param(True, id="bool"),
        pytest.param(None, id="none"),
        pytest.param("plain text", id="str"),
        pytest.param("", id="empty-str"),
        pytest.param("{ not: jinja } 100% }}", id="braces-without-opener"),
        pytest.param([1, "two", {"three": 3}], id="nested-list"),
        pytest.param(
            {"a": {"b": ["c", None]}, "{{ key }}": 1}, id="nested-dict-keys-not-evaluated"
        ),
        pytest.param((1, "x"), id="tuple"),
    ],
)
def test_literals_pass_through_unchanged(value: object) -> None:
    compiled = compile_value(value)
    assert compiled.is_literal
    assert compiled.source is value
    assert compiled.render(CONTEXT) is value
    assert compiled.render({}) is value  # literals need no context at all


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(
            ["{{ device.id }}", 2, "literal"], ["gw-1", 2, "literal"], id="list-with-expression"
        ),
        pytest.param(
            {"site": "{{ device.labels['example.com/site'] }}", "port": 80, "tag": "x"},
            {"site": "lyon-2", "port": 80, "tag": "x"},
            id="dict-with-expression",
        ),
        pytest.param(
            {"outer": [{"cores": "{{ device.properties.cpu.cores }}"}, "keep {x}"]},
            {"outer": [{"cores": 4}, "keep {x}"]},
            id="deeply-nested-native-int",
        ),
        pytest.param(("{{ 1 + 1 }}", "a"), (2, "a"), id="tuple-stays-tuple"),
    ],
)
def test_expressions_inside_literal_structures_are_evaluated(value: object, expected: Any) -> None:
    compiled = compile_value(value)
    assert not compiled.is_literal
    assert compiled.render(CONTEXT) == expected
    assert type(compiled.render(CONTEXT)) is type(expected)


def test_nested_render_does_not_mutate_the_source() -> None:
    source = {"a": ["{{ device.id }}"], "b": {"c": 1}}
    compile_value(source).render(CONTEXT)
    assert source == {"a": ["{{ device.id }}"], "b": {"c": 1}}


def test_compiled_value_constructor_compiles_too() -> None:
    assert CompiledValue("{{ 6 * 7 }}").render(CONTEXT) == 42
    assert CompiledValue("{{ 6 * 7 }}") == compile_value("{{ 6 * 7 }}")


# --------------------------------------------------------------------------------------------
# Native values for single expressions, text for templates


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("{{ 3 }}", 3, id="int"),
        pytest.param("{{ 2.5 }}", 2.5, id="float"),
        pytest.param("{{ true }}", True, id="bool"),
        pytest.param("{{ none }}", None, id="none"),
        pytest.param("{{ 'text' }}", "text", id="str"),
        pytest.param("{{ [1, 'a', [true]] }}", [1, "a", [True]], id="list"),
        pytest.param("{{ {'a': 1, 'b': [2]} }}", {"a": 1, "b": [2]}, id="dict"),
        pytest.param("{{ (1, 2) }}", [1, 2], id="tuple-becomes-list"),
        pytest.param("{{ range(3) }}", [0, 1, 2], id="range-becomes-list"),
        pytest.param("{{ [1, 2] | map('string') }}", ["1", "2"], id="generator-becomes-list"),
        pytest.param("{{ {'a': 1}.items() | list }}", [["a", 1]], id="pairs-become-lists"),
        pytest.param("{{ dict(a=1) }}", {"a": 1}, id="dict-global"),
        pytest.param("  {{ 7 }}\n", 7, id="surrounding-whitespace"),
        pytest.param("{{- 7 -}}", 7, id="whitespace-control"),
        pytest.param("{{ device.properties.cpu.cores }}", 4, id="device-int"),
        pytest.param("{{ device.properties.gpu }}", None, id="device-null"),
        pytest.param("{{ device.extensions['vendor.io'].zones }}", ["a", "b"], id="device-list"),
        pytest.param("{{ device.properties.cpu.cores > 2 }}", True, id="comparison"),
        pytest.param("{{ 7 // 2 }}", 3, id="floordiv"),
        pytest.param("{{ 2 ** 10 }}", 1024, id="power"),
        pytest.param("{{ 2 ** 64 }}", 2**64, id="power-at-the-limit"),
        pytest.param("{{ 'ab' * 3 }}", "ababab", id="repetition"),
        pytest.param("{{ [0] * 3 }}", [0, 0, 0], id="list-repetition"),
        pytest.param("{{ 7 % 3 }}", 1, id="modulo"),
        pytest.param("{{ 'x' if device.id == 'gw-1' else 'y' }}", "x", id="conditional"),
    ],
)
def test_single_expression_renders_native_value(source: str, expected: Any) -> None:
    result = render(source)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("site-{{ device.labels['example.com/site'] }}", "site-lyon-2", id="prefix"),
        pytest.param("{{ 1 }}{{ 2 }}", "12", id="two-expressions-are-text"),
        pytest.param("{{ 1 }} {{ 2 }}", "1 2", id="two-expressions-with-space"),
        pytest.param("n={{ device.properties.cpu.cores }}", "n=4", id="int-in-text"),
        pytest.param("gpu={{ true }}", "gpu=true", id="bool-as-json"),
        pytest.param("x={{ none }}", "x=null", id="none-as-json"),
        pytest.param("zones={{ ['a', 1] }}", 'zones=["a", 1]', id="list-as-json"),
        pytest.param("{{ 'v' ~ true }}", "vtrue", id="tilde-writes-json-too"),
        pytest.param("{{ [1, none] | string }}", "[1, null]", id="string-filter-writes-json"),
        pytest.param("a\n{{ 1 }}\n", "a\n1\n", id="trailing-newline-kept"),
        pytest.param("{{ '{{' }} literal", "{{ literal", id="braces-inside-string"),
        pytest.param("{{ '{%' }} and {{ '{#' }}", "{% and {#", id="delimiters-inside-strings"),
    ],
)
def test_mixed_template_renders_text(source: str, expected: str) -> None:
    assert render(source) == expected


# --------------------------------------------------------------------------------------------
# The device variable


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param(
            "{{ [device.labels['example.com/replicas'], 2] | min }}", 2, id="min-brief-example"
        ),
        pytest.param(
            "{{ [device.labels['example.com/nodes'] | int, 2] | min }}", 2, id="min-of-label-text"
        ),
        pytest.param(
            "{{ [device.labels['example.com/nodes'] | int, 2] | max }}", 3, id="max-of-label-text"
        ),
        pytest.param("{{ device.labels['example.com/site'] }}", "lyon-2", id="slash-key"),
        pytest.param("{{ device.labels['tier.v1'] }}", "edge", id="dotted-key"),
        pytest.param("{{ device.labels['_private'] }}", "underscore", id="underscore-key"),
        pytest.param("{{ device.extensions['vendor.io'].firmware }}", "1.2.3", id="extension"),
        pytest.param("{{ device.id }}", "gw-1", id="id"),
        pytest.param("{{ device.properties.items }}", 7, id="data-wins-over-dict-methods"),
        pytest.param("{{ device.labels.get('nope', 'dflt') }}", "dflt", id="dict-get"),
        pytest.param("{{ device.labels.missing | default('d') }}", "d", id="default"),
        pytest.param("{{ device.labels.missing | d(1) }}", 1, id="d"),
        pytest.param("{{ device.labels.missing is defined }}", False, id="defined-test"),
        pytest.param("{{ device.labels.gpu | bool }}", True, id="bool-filter"),
        pytest.param("{{ device.properties.cpu.cores is even }}", True, id="even-test"),
        pytest.param(
            "{{ 'sda' in device.properties.disks | map(attribute='name') }}", True, id="in-with-map"
        ),
        pytest.param(
            "{{ device.properties.disks | selectattr('name', 'eq', 'sdb') | "
            "map(attribute='size') | first }}",
            "512Mi",
            id="selectattr",
        ),
        pytest.param(
            "{{ device.labels['example.com/site'].split('-') | last }}", "2", id="str-method"
        ),
        pytest.param("{{ device.labels | length }}", 6, id="length"),
    ],
)
def test_device_expressions(source: str, expected: Any) -> None:
    assert render(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("{{ device.properties.memory | quantity }}", 59 * GI, id="59-space-Gi"),
        pytest.param("{{ '59 Gi' | quantity | gib }}", 59.0, id="gib-round-trip"),
        pytest.param("{{ device.properties.storage | quantity }}", 1536 * GI, id="fractional-Ti"),
        pytest.param("{{ '0.5' | quantity }}", 1, id="rounds-up-to-whole-bytes"),
        pytest.param("{{ 1024 | quantity }}", 1024, id="plain-number"),
        pytest.param("{{ '1.5Gi' | quantity | gib }}", 1.5, id="gib-fraction"),
        pytest.param(
            "{{ device.properties.disks | map(attribute='size') | map('quantity') | sum }}",
            10 * GI + 512 * 1024**2,
            id="sum-of-disks",
        ),
        pytest.param(
            "{{ (device.properties.memory | quantity | gib) >= 16 }}", True, id="capacity-check"
        ),
    ],
)
def test_quantity_and_gib_filters(source: str, expected: Any) -> None:
    result = render(source)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        pytest.param("{{ 'lots' | quantity }}", "expected a non-negative quantity", id="bad-text"),
        pytest.param("{{ '4Gb' | quantity }}", "unknown unit", id="bad-unit"),
        pytest.param("{{ '59 Gi' | gib }}", "quantity filter first", id="gib-needs-bytes"),
        pytest.param("{{ true | gib }}", "gib expects a number", id="gib-of-bool"),
    ],
)
def test_quantity_errors(source: str, fragment: str) -> None:
    assert fragment in str(render_error(source))


def test_device_context_is_a_plain_deep_copy() -> None:
    labels = {"a": "1"}
    properties = {"cpu": {"cores": 2}, "list": (1, 2)}
    context = device_context("d", properties, labels, {})
    labels["a"] = "changed"
    properties["cpu"]["cores"] = 99
    assert context == {
        "id": "d",
        "properties": {"cpu": {"cores": 2}, "list": [1, 2]},
        "labels": {"a": "1"},
        "extensions": {},
    }


def test_device_context_needs_mappings() -> None:
    with pytest.raises(ExpressionError, match=r"device\.labels must be a mapping"):
        device_context("d", {}, None, {})  # type: ignore[arg-type]


def test_expression_errors_pickle_with_their_position() -> None:
    error = pickle.loads(pickle.dumps(ExpressionError("boom", 2, 3)))
    assert (str(error), error.line, error.column) == ("boom", 2, 3)


@pytest.mark.parametrize(
    ("properties", "fragment"),
    [
        pytest.param({"x": object()}, "device.properties.x is not JSON-like", id="object"),
        pytest.param({"x": {1: "a"}}, "non-string key 1", id="int-key"),
        pytest.param({"x": [math.nan]}, "device.properties.x[0] is not a finite", id="nan"),
    ],
)
def test_device_context_refuses_non_data(properties: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ExpressionError) as info:
        device_context("d", properties, {}, {})
    assert fragment in str(info.value)


# --------------------------------------------------------------------------------------------
# Missing keys: StrictUndefined, with a message that names what is missing


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        pytest.param(
            "{{ device.labels['example.com/nodez'] }}",
            "device.labels has no key 'example.com/nodez'",
            id="missing-label-subscript",
        ),
        pytest.param(
            "{{ [device.labels['example.com/nodez'], 2] | min }}",
            "device.labels has no key 'example.com/nodez'",
            id="missing-label-inside-filter",
        ),
        pytest.param(
            "{{ device.labels.zone }}", "device.labels has no key 'zone'", id="missing-label-dot"
        ),
        pytest.param(
            "{{ device.properties.cpu.speed }}",
            "device.properties.cpu has no key 'speed'",
            id="missing-nested-key",
        ),
        pytest.param(
            "{{ device.extensions['vendor.io'].zones[5] }}",
            "device.extensions['vendor.io'].zones has no item 5",
            id="missing-index",
        ),
        pytest.param(
            "site-{{ device.labels.zone }}", "device.labels has no key 'zone'", id="in-text"
        ),
        pytest.param(
            "{{ device.labels.zone.name }}", "device.labels has no key 'zone'", id="chained"
        ),
        pytest.param(
            "{{ device.labels.zone | int }}", "device.labels has no key 'zone'", id="into-int"
        ),
        pytest.param(
            "{{ device.labels.zone + 1 }}", "device.labels has no key 'zone'", id="arithmetic"
        ),
        pytest.param(
            "{{ range(device.labels.zone) }}", "device.labels has no key 'zone'", id="into-range"
        ),
        pytest.param(
            "{{ [device.labels.zone] }}", "device.labels has no key 'zone'", id="inside-list"
        ),
        pytest.param("{{ devices.id }}", "unknown name 'devices'", id="unknown-variable"),
        pytest.param("{{ [] | first }}", "sequence was empty", id="first-of-empty"),
    ],
)
def test_missing_keys_are_errors_naming_the_key(source: str, fragment: str) -> None:
    error = render_error(source)
    assert fragment in str(error)


def test_missing_key_message_lists_what_is_there() -> None:
    message = str(render_error("{{ device.properties.cpu.speed }}"))
    assert "'architecture', 'cores'" in message


# --------------------------------------------------------------------------------------------
# The sandbox: forbidden constructs, resource bounds


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        # statements, comments, template machinery
        pytest.param("{% for x in [1] %}{{ x }}{% endfor %}", "only {{ expressions }}", id="for"),
        pytest.param("{% for %}", "only {{ expressions }}", id="for-incomplete"),
        pytest.param("{% include 'x' %}", "only {{ expressions }}", id="include"),
        pytest.param("{% import 'x' as y %}", "only {{ expressions }}", id="import"),
        pytest.param("{% extends 'x' %}", "only {{ expressions }}", id="extends"),
        pytest.param("{% set x = 1 %}{{ x }}", "only {{ expressions }}", id="set"),
        pytest.param("{% raw %}{{ x }}{% endraw %}", "only {{ expressions }}", id="raw"),
        pytest.param("{# note #}{{ 1 }}", "only {{ expressions }}", id="comment"),
        pytest.param("{{ self }}", "'self' is not available", id="self"),
        pytest.param("{{ self._TemplateReference__context }}", "not available", id="self-context"),
        pytest.param("{{ loop }}", "'loop' is not available", id="loop"),
        pytest.param("{{ caller() }}", "'caller' is not available", id="caller"),
        # globals that are gone
        pytest.param("{{ cycler(1, 2) }}", "unknown name 'cycler'", id="cycler"),
        pytest.param("{{ joiner() }}", "unknown name 'joiner'", id="joiner"),
        pytest.param("{{ namespace() }}", "unknown name 'namespace'", id="namespace"),
        pytest.param("{{ lipsum() }}", "unknown name 'lipsum'", id="lipsum"),
        pytest.param("{{ config }}", "unknown name 'config'", id="config"),
        pytest.param("{{ request }}", "unknown name 'request'", id="request"),
        # object internals
        pytest.param("{{ ''.__class__ }}", "'__class__' is not allowed", id="str-class"),
        pytest.param("{{ device.__class__.__mro__ }}", "not allowed", id="mro"),
        pytest.param("{{ device.properties.items.__self__ }}", "not allowed", id="method-self"),
        pytest.param("{{ device.labels.get.__self__ }}", "not allowed", id="get-self"),
        pytest.param("{{ device['__class__'] }}", "'__class__' of a dict", id="subscript-dunder"),
        pytest.param("{{ dict.fromkeys }}", "has no attribute 'fromkeys'", id="dict-type-attr"),
        pytest.param("{{ range.__globals__ }}", "not allowed", id="function-globals"),
        pytest.param("{{ (1).real }}", "'real' of an int value is not allowed", id="int-attr"),
        pytest.param("{{ ''.join(['a']) }}", "'join' of a str value", id="str-join-method"),
        pytest.param("{{ 'x'.center(10) }}", "'center' of a str value", id="str-center"),
        pytest.param("{{ '{:>999999999}'.format(1) }}", "'format' of a str", id="str-format"),
        pytest.param("{{ '{0}'.format_map({}) }}", "'format_map' of a str", id="format-map"),
        pytest.param("{{ device.labels.update({}) }}", "'update' of a dict", id="dict-update"),
        pytest.param("{{ device.labels.pop('gpu') }}", "'pop' of a dict", id="dict-pop"),
        pytest.param("{{ [1].append(2) }}", "'append' of a list", id="list-append"),
        pytest.param("{{ device.labels | attr('x') }}", "filter 'attr'", id="attr-filter"),
        pytest.param("{{ device.labels.get }}", "call it with ()", id="method-is-not-data"),
        pytest.param("{{ dict }}", "not data", id="global-is-not-data"),
        # filters and tests outside the whitelist
        pytest.param("{{ 'x' | center(1000) }}", "filter 'center' is unknown", id="center"),
        pytest.param("{{ 'x' | format(1) }}", "filter 'format'", id="format-filter"),
        pytest.param("{{ 'x' | indent(99999) }}", "filter 'indent'", id="indent-filter"),
        pytest.param("{{ 'x' | wordwrap(5) }}", "filter 'wordwrap'", id="wordwrap-filter"),
        pytest.param("{{ [1] | random }}", "filter 'random'", id="random-filter"),
        pytest.param("{{ 'x' | safe }}", "filter 'safe'", id="safe-filter"),
        pytest.param(
            "{{ ['a'] | map('center', 9) | list }}", "filter 'center'", id="center-via-map"
        ),
        pytest.param("{{ [1] | select('callable') | list }}", "test 'callable'", id="test"),
        pytest.param("{{ 1 is sameas 1 }}", "test 'sameas' is unknown", id="sameas-test"),
        pytest.param("{{ 1 if true else 'x' | center(3) }}", "filter 'center'", id="untaken"),
        pytest.param("{{ 1 if true else 1 is sameas 1 }}", "test 'sameas'", id="untaken-test"),
        # resource bounds
        pytest.param("{{ 'a' * 10**9 }}", "at most 10000", id="string-repetition"),
        pytest.param("{{ 10**9 * 'a' }}", "at most 10000", id="reversed-repetition"),
        pytest.param("{{ [1] * 10**9 }}", "at most 10000", id="list-repetition"),
        pytest.param("{{ [[1] * 5000] * 3 }}", "at most 10000", id="nested-repetition"),
        pytest.param("{{ ['x' * 10000] * 2 }}", "at most 10000", id="repeat-long-strings"),
        pytest.param("{{ range(10**9) }}", "range() may produce at most", id="range"),
        pytest.param("{{ range(2**64) }}", "range() may produce at most", id="range-huge"),
        pytest.param("{{ range(10**9) | list }}", "range() may produce at most", id="range-list"),
        pytest.param("{{ 10**10**10 }}", "power too large", id="power-tower"),
        pytest.param("{{ 2**65 }}", "power too large", id="power-over-2-64"),
        pytest.param("{{ 2**1000000 }}", "power too large", id="big-exponent"),
        pytest.param("{{ 10.0**400 }}", "out of range", id="float-power-overflow"),
        pytest.param("{{ 1e300 ** 2 }}", "out of range", id="float-power-overflow-2"),
        pytest.param("{{ '%0999999999d' % 1 }}", "%-formatting", id="percent-format"),
        pytest.param(
            "{{ ('x' * 10000) | replace('x', 'y' * 10000) }}", "builds too much", id="replace-bomb"
        ),
        pytest.param("{{ range(10000) | join('x' * 10000) }}", "builds too much", id="join-bomb"),
        pytest.param(
            "{{ ('a b ' * 2000).split() | map('replace', 'a', 'x' * 5000) | list }}",
            "builds too much",
            id="replace-via-map",
        ),
        pytest.param(
            "{{ range(5000) | map('abs') | map('abs') | map('abs') | map('abs') | "
            "map('abs') | map('abs') | list }}",
            "too many steps",
            id="map-chain",
        ),
        pytest.param(
            "{{ range(10000) | list | sort | sort | sort | sort }}",
            "too many steps",
            id="sort-chain",
        ),
        pytest.param("{{ 1.5 | round(10**9, 'ceil') }}", "round precision", id="round-bomb"),
        pytest.param("{{ [1] | tojson(10**9) }}", "tojson indent", id="tojson-indent"),
        pytest.param("{{ [[1] * 100] | sum(start=[]) }}", "sum adds numbers", id="sum-lists"),
        pytest.param(
            "{{ range(10000) | list + [1] }}",
            f"more than {MAX_RESULT_ITEMS} items",
            id="result-items",
        ),
        pytest.param(
            "{{ ('x' * 10000) ~ ('x' * 10000) ~ ('x' * 10000) ~ ('x' * 10000) ~ "
            "('x' * 10000) ~ ('x' * 10000) ~ ('x' * 10000) }}",
            f"longer than {MAX_RESULT_CHARS}",
            id="result-chars",
        ),
        pytest.param(
            "x{{ 'y' * 10000 }}" * 7, f"longer than {MAX_RESULT_CHARS}", id="text-result-chars"
        ),
        pytest.param("{{ " + "[" * 100 + "]" * 100 + " }}", "nested", id="deep-nesting"),
        pytest.param("{{ " + "(" * 1000 + "1" + ")" * 1000 + " }}", "", id="paren-bomb"),
        pytest.param("{{ " + "1 + " * 9000 + "1 }}", "characters long", id="too-long"),
        # evaluation errors
        pytest.param("{{ 1 / 0 }}", "division by zero", id="division-by-zero"),
        pytest.param("{{ 1 % 0 }}", "division by zero", id="modulo-by-zero"),
        pytest.param("{{ 3 is divisibleby 0 }}", "division by zero", id="divisibleby-zero"),
        pytest.param("{{ 1 + 'a' }}", "unsupported operand", id="type-error"),
        pytest.param("{{ (-8) ** 0.5 }}", "complex", id="complex-result"),
        pytest.param("{{ 'nan' | float }}", "finite", id="nan"),
        pytest.param("{{ -1e308 - 1e308 }}", "finite", id="infinity"),
        pytest.param("{{ 'abc' | int }}", "cannot convert 'abc' to an integer", id="strict-int"),
        pytest.param("{{ 'abc' | float }}", "cannot convert 'abc'", id="strict-float"),
        pytest.param("{{ 'yes' | bool }}", "bool expects true or false", id="strict-bool"),
        pytest.param("{{ 1 | bool }}", "bool expects true or false", id="bool-of-int"),
        pytest.param("{{ [1].index(2) }}", "2 is not in list", id="method-error"),
        pytest.param("{{ [1, 'a'] | sort }}", "not supported", id="sort-mixed"),
        pytest.param("{{ {1: 2} }}", "mapping keys must be strings", id="int-key"),
    ],
)
def test_forbidden_and_failing_expressions_raise_expression_error(
    source: str, fragment: str
) -> None:
    error = render_error(source)
    assert fragment in str(error)
    assert type(error) is ExpressionError


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("{{ 'abc' | int(7) }}", 7, id="int-explicit-default"),
        pytest.param("{{ '4.7' | int }}", 4, id="int-of-decimal-text"),
        pytest.param("{{ '0x1f' | int(0, 16) }}", 31, id="int-base"),
        pytest.param("{{ 'x' | float(0.5) }}", 0.5, id="float-explicit-default"),
        pytest.param("{{ 'false' | bool }}", False, id="bool-false"),
        pytest.param("{{ 2.567 | round(2) }}", 2.57, id="round"),
        pytest.param("{{ 2.561 | round(1, 'ceil') }}", 2.6, id="round-ceil"),
        pytest.param("{{ [3, 1, 2] | sort | join(',') }}", "1,2,3", id="sort-join"),
        pytest.param("{{ [true, none, 1] | join(' ') }}", "true null 1", id="join-writes-json"),
        pytest.param("{{ 'a-b' | replace('-', '_') }}", "a_b", id="replace"),
        pytest.param("{{ 'aaa' | replace('a', 'b', 2) }}", "bba", id="replace-count"),
        pytest.param("{{ {'b': 1, 'a': [1]} | tojson }}", '{"a": [1], "b": 1}', id="tojson"),
        pytest.param("{{ '<&>' | tojson }}", '"<&>"', id="tojson-is-plain-json"),
        pytest.param("{{ [1, 1, 2] | unique | list }}", [1, 2], id="unique"),
        pytest.param("{{ [1, 2, 3, 4] | select('even') | list }}", [2, 4], id="select"),
        pytest.param("{{ [1, 2, 3] | reject('odd') | list }}", [2], id="reject"),
        pytest.param("{{ [1, 2, 3] | sum }}", 6, id="sum"),
        pytest.param("{{ [-1] | map('abs') | first }}", 1, id="abs-via-map"),
        pytest.param("{{ ' Hi ' | trim | upper }}", "HI", id="trim-upper"),
        pytest.param("{{ 'edge node' | title }}", "Edge Node", id="title"),
        pytest.param("{{ 'edge' | capitalize }}", "Edge", id="capitalize"),
        pytest.param("{{ 'abc' | reverse }}", "cba", id="reverse"),
        pytest.param("{{ 'abc' | list | count }}", 3, id="count"),
        pytest.param("{{ ('x' * 10000) | length }}", 10000, id="repetition-at-the-limit"),
        pytest.param("{{ range(10000) | list | length }}", 10000, id="range-at-the-limit"),
        pytest.param("{{ range(10000) | list | last }}", 9999, id="last"),
        pytest.param("{{ 3 is odd and 4 is number and 'a' is string }}", True, id="tests"),
        pytest.param(
            "{{ [1] is sequence and {} is mapping and none is none }}", True, id="type-tests"
        ),
        pytest.param("{{ [1, 5, 9] | select('>', 4) | list }}", [5, 9], id="operator-test"),
        pytest.param("{{ 2 ** -1 }}", 0.5, id="negative-exponent"),
        pytest.param("{{ (-2) ** 63 }}", -(2**63), id="negative-base"),
        pytest.param("{{ 1 ** 1000000 }}", 1, id="one-to-any-power"),
    ],
)
def test_whitelisted_filters_and_tests(source: str, expected: Any) -> None:
    result = render(source)
    assert result == expected
    assert type(result) is type(expected)


# --------------------------------------------------------------------------------------------
# Syntax errors and positions


@pytest.mark.parametrize(
    ("source", "line", "column", "fragment"),
    [
        pytest.param("{{ 1 +* 2 }}", 1, None, "syntax error", id="operator"),
        pytest.param("{{ (1, 2 }}", 1, None, "syntax error", id="unclosed-paren"),
        pytest.param("{{ 'abc }}", 1, None, "syntax error", id="unclosed-string"),
        pytest.param("{{ x }", 1, None, "syntax error", id="unclosed-braces"),
        pytest.param("line one\nline two\n{{ (1 + }}", 3, None, "syntax error", id="third-line"),
        pytest.param("{{ [1,\n 2,\n 3 +] }}", 3, None, "syntax error", id="multiline-expr"),
        pytest.param("a\n  {% if x %}", 2, 3, "statement blocks", id="block-position"),
        pytest.param("{{ '{%' }} {% if %}", 1, 12, "statement blocks", id="block-after-string"),
        pytest.param("x\n\n {# c #}", 3, 2, "comments", id="comment-position"),
        pytest.param("x\n{{ nope | center }}", 2, None, "filter 'center'", id="filter-line"),
        pytest.param("\n{{ self }}", 2, None, "'self'", id="reserved-name-line"),
        pytest.param("{{ a.__x }}", 1, None, "'__x' is not allowed", id="private-attr-line"),
    ],
)
def test_compile_errors_carry_position(
    source: str, line: int, column: int | None, fragment: str
) -> None:
    with pytest.raises(ExpressionError) as info:
        compile_value(source)
    assert fragment in str(info.value)
    assert (info.value.line, info.value.column) == (line, column)


def test_errors_inside_literal_structures_say_where() -> None:
    with pytest.raises(ExpressionError, match=r"^\[1\]\['k'\]: syntax error") as info:
        compile_value(["ok", {"k": "x\n{{ (1 }}"}])
    assert info.value.line == 2
    compiled = compile_value({"outer": ["{{ 1 }}", "{{ device.labels.zone }}"]})
    with pytest.raises(ExpressionError, match=r"^\['outer'\]\[1\]: device.labels has no key"):
        compiled.render(CONTEXT)


def test_render_errors_have_no_position() -> None:
    error = render_error("{{ 1 / 0 }}")
    assert (error.line, error.column) == (None, None)


# --------------------------------------------------------------------------------------------
# Caching and isolation between renders


def test_compiled_sources_are_cached() -> None:
    # An intent renders for thousands of devices: its sources compile once.
    source = "{{ device.id ~ '-cached' }}"
    first = compile_value(source)
    assert compile_value(source)._renderer is first._renderer
    assert first.render(CONTEXT) == "gw-1-cached"


def test_budget_is_per_render() -> None:
    # Each render may spend almost the whole budget; the next render starts afresh.
    compiled = compile_value("{{ range(3000) | map('abs') | map('abs') | list | length }}")
    for _ in range(3):
        assert compiled.render(CONTEXT) == 3000


def test_renders_for_different_devices() -> None:
    compiled = compile_value("{{ device.id }}:{{ device.labels.get('zone', 'none') }}")
    other = device_context("gw-2", {}, {"zone": "z1"}, {})
    assert compiled.render(CONTEXT) == "gw-1:none"
    assert compiled.render({"device": other}) == "gw-2:z1"


def test_results_do_not_alias_device_data() -> None:
    result = render("{{ device.extensions['vendor.io'].zones }}")
    result.append("c")
    assert DEVICE["extensions"]["vendor.io"]["zones"] == ["a", "b"]


# --------------------------------------------------------------------------------------------
# Nothing but ExpressionError escapes


SMALL_CONTEXT = {"device": device_context("d", {"n": 2, "s": "4Gi"}, {"a/b": "x"}, {"e": [1]})}

_SYNTAX = st.sampled_from(
    [
        "{{",
        "}}",
        "{%",
        "%}",
        "{#",
        "#}",
        " ",
        "\n",
        "(",
        ")",
        "[",
        "]",
        "{",
        "}",
        ",",
        ":",
        ".",
        "|",
        "~",
        "+",
        "-",
        "*",
        "**",
        "/",
        "//",
        "%",
        "==",
        "<",
        "not",
        "and",
        "or",
        "if",
        "else",
        "is",
        "in",
        "'",
        '"',
        "device",
        "labels",
        "properties",
        "extensions",
        "n",
        "s",
        "'a/b'",
        "0",
        "1",
        "10",
        "2.5",
        "true",
        "none",
        "range",
        "dict",
        "self",
        "__class__",
        "_",
        "map",
        "join",
        "quantity",
        "gib",
        "int",
        "bool",
        "first",
        "sum",
        "replace",
        "min",
        "center",
        "defined",
        "even",
        "x",
        "'abc'",
        "'{%'",
        "for",
        "endfor",
        "raw",
    ]
)
RANDOM_TEXT = st.one_of(
    st.lists(_SYNTAX, max_size=25).map("".join),
    st.lists(_SYNTAX, max_size=15).map(lambda parts: "{{ " + " ".join(parts) + " }}"),
    st.text(max_size=40),
)

_ATOMS = st.sampled_from(
    [
        "device",
        "device.properties",
        "device.properties.n",
        "device.properties.s",
        "device.labels['a/b']",
        "device.extensions.e",
        "device.missing",
        "1",
        "0",
        "-3",
        "2.5",
        "'Gi'",
        "'4 Gi'",
        "true",
        "none",
        "[1, 2]",
        "{'k': 1}",
        "range(3)",
        "''",
    ]
)
_FILTERS = st.sampled_from(
    [
        "abs",
        "bool",
        "count",
        "default(1)",
        "first",
        "float",
        "gib",
        "int",
        "join(',')",
        "last",
        "length",
        "list",
        "lower",
        "map('string')",
        "max",
        "min",
        "quantity",
        "replace('a', 'b')",
        "reverse",
        "round(1)",
        "select('odd')",
        "sort",
        "string",
        "sum",
        "tojson",
        "trim",
        "unique",
        "upper",
    ]
)
_OPERATORS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "~", "==", "<", "in", "and"])


def _expressions() -> st.SearchStrategy[str]:
    return st.recursive(
        _ATOMS,
        lambda inner: st.one_of(
            st.tuples(inner, _FILTERS).map(lambda p: f"({p[0]} | {p[1]})"),
            st.tuples(inner, _OPERATORS, inner).map(lambda p: f"({p[0]} {p[1]} {p[2]})"),
            st.lists(inner, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
            st.tuples(inner, inner).map(lambda p: f"{p[0]}[{p[1]}]"),
        ),
        max_leaves=8,
    )


def _only_expression_errors(source: object) -> None:
    try:
        result = compile_value(source).render(SMALL_CONTEXT)
    except ExpressionError as error:
        assert str(error)
        assert error.line is None or error.line >= 1
        assert error.column is None or error.column >= 1
    else:
        json.dumps(result, allow_nan=False)  # every result is plain data


@settings(max_examples=300, deadline=None)
@given(RANDOM_TEXT)
def test_random_text_raises_only_expression_error(source: str) -> None:
    _only_expression_errors(source)


@settings(max_examples=300, deadline=None)
@given(_expressions())
def test_random_expressions_raise_only_expression_error(expression: str) -> None:
    _only_expression_errors("{{ " + expression + " }}")
    _only_expression_errors("v=" + "{{ " + expression + " }}")


@given(st.integers(min_value=-(2**70), max_value=2**70) | st.booleans() | st.none())
def test_literal_numbers_render_natively(value: int | bool | None) -> None:
    assert compile_value(value).render({}) is value
    literal = json.dumps(value).replace("null", "none")
    assert render("{{ " + literal + " }}") == value


@given(st.text().filter(lambda text: not is_expression(text)))
def test_text_without_delimiters_is_literal(text: str) -> None:
    assert compile_value(text).render({}) is text


@pytest.mark.parametrize(
    ("value", "reads"),
    [
        ("{{ device.labels['zone'] }}", {("labels", "zone")}),
        ("{{ [device.labels['n'] | default(1), 3] | min }}", {("labels", "n")}),
        ("{{ (device)['labels']['zone'] }}", {("labels", "zone")}),
        ("{{ device.properties['cpus'][0].cores }}", {("properties", "cpus")}),
        ("{{ device.id }}-{{ device['labels'].site }}", {("id", None), ("labels", None)}),
        ("{{ device.labels.get('zone') }}", {("labels", None)}),
        ("{{ device.labels | tojson }}", {("labels", None)}),
        # A missing key falls back to the mapping's attribute of that name: whole section.
        ("{{ device.labels['items'] }}", {("labels", None)}),
        ("{{ device.labels[device.id] }}", {("id", None), ("labels", None)}),
        ({"a": ["{{ device.labels['x'] }}", 3], "b": "{{ device.id }}"},
         {("labels", "x"), ("id", None)}),
        ("{{ dict(device=1).device }}", set()),
        ("plain text", set()),
        ("{{ device | tojson }}", None),
        ("{{ device.items() | list }}", None),
        ("{{ device['lab' ~ 'els'] }}", None),
        ({"a": "{{ device.labels['x'] }}", "b": "{{ device }}"}, None),
    ],
)
def test_what_an_expression_reads_of_the_device(value: object, reads: set[Any] | None) -> None:
    found = compile_value(value).reads
    assert found == (None if reads is None else frozenset(reads))
