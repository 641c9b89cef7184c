"""Parameters to per-component configuration (margo.component_values)."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from margo.component_values import (
    MAX_HELM_INDEX,
    compose_environment,
    compose_variable_name,
    env_string,
    format_helm_pointer,
    helm_values,
    parse_helm_pointer,
    set_helm_value,
)

SPEC_VALID = Path(__file__).resolve().parents[1] / "fixtures" / "spec-examples" / "valid"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((SPEC_VALID / name).read_text(encoding="utf-8"))


def _param(value: Any, *targets: tuple[str, list[str]]) -> dict[str, Any]:
    return {"value": value,
            "targets": [{"pointer": p, "components": list(c)} for p, c in targets]}


def _read(tree: Any, path: tuple[str | int, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


# --------------------------------------------------------------------------- Helm pointers

POINTERS = [
    # id, pointer, parsed
    ("single-key", "replicas", ("replicas",)),
    ("dotted", "global.config.appGreeting", ("global", "config", "appGreeting")),
    ("escaped-dot", r"nodeSelector.kubernetes\.io/role", ("nodeSelector", "kubernetes.io/role")),
    ("list-index", "servers[0]", ("servers", 0)),
    ("list-index-then-key", "servers[0].port", ("servers", 0, "port")),
    ("nested-lists", "matrix[1][2]", ("matrix", 1, 2)),
    ("leading-zero-index", "a[007]", ("a", 7)),
    ("max-index", f"a[{MAX_HELM_INDEX}]", ("a", MAX_HELM_INDEX)),
    ("escaped-backslash", r"a\\b", ("a\\b",)),
    ("escaped-comma-equals", r"args\,x\=1", ("args,x=1",)),
    ("escaped-brackets", r"a\[0\]", ("a[0]",)),
    ("dash-slash-space", "my-chart.some key/x", ("my-chart", "some key/x")),
    ("unicode", "ünï.cödé", ("ünï", "cödé")),
]


@pytest.mark.parametrize(("pointer", "parsed"), [c[1:] for c in POINTERS],
                         ids=[c[0] for c in POINTERS])
def test_parse_helm_pointer(pointer: str, parsed: tuple) -> None:
    assert parse_helm_pointer(pointer) == parsed
    assert parse_helm_pointer(format_helm_pointer(parsed)) == parsed


BAD_POINTERS = [
    # id, pointer, message fragment
    ("empty", "", "it is empty"),
    ("double-dot", "a..b", "empty key at position 2"),
    ("leading-dot", ".a", "empty key at position 0"),
    ("trailing-dot", "a.", "empty key at position 2"),
    ("index-without-key", "[0]", "empty key at position 0"),
    ("unclosed-bracket", "a[0", "unbalanced '[' at position 1"),
    ("stray-close-bracket", "a]", "unbalanced ']' at position 1"),
    ("negative-index", "a[-1]", "list index must be a non-negative integer, found '-1'"),
    ("non-numeric-index", "a[x]", "list index must be a non-negative integer, found 'x'"),
    ("empty-index", "a[]", "list index must be a non-negative integer, found ''"),
    ("index-too-large", f"a[{MAX_HELM_INDEX + 1}]", f"greater than the maximum {MAX_HELM_INDEX}"),
    ("text-after-index", "a[0]b", "expected '.' or '[' after ']', found 'b' at position 4"),
    ("trailing-backslash", "a\\", "trailing lone backslash at position 1"),
    ("unknown-escape", r"a\n", "unknown escape '\\n'"),
    ("unescaped-comma", "a,b", "unescaped ','"),
    ("unescaped-equals", "a=b", "unescaped '='"),
    ("not-text", 5, "must be a string"),
]


@pytest.mark.parametrize(("pointer", "fragment"), [c[1:] for c in BAD_POINTERS],
                         ids=[c[0] for c in BAD_POINTERS])
def test_parse_helm_pointer_errors(pointer: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match="Helm pointer") as caught:
        parse_helm_pointer(pointer)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("path", [
    pytest.param((), id="empty"),
    pytest.param((0, "a"), id="starts-with-index"),
    pytest.param(("a", ""), id="empty-key"),
    pytest.param(("a", -1), id="negative-index"),
    pytest.param(("a", True), id="bool-index"),
])
def test_format_helm_pointer_errors(path: tuple) -> None:
    with pytest.raises(ValueError):
        format_helm_pointer(path)


# --------------------------------------------------------------------------- set_helm_value


def test_set_creates_maps_and_lists_padded_with_none() -> None:
    tree: dict = {}
    set_helm_value(tree, "servers[2].port", 8080)
    set_helm_value(tree, "servers[0].host", "a")
    set_helm_value(tree, r"nodeSelector.kubernetes\.io/role", "edge")
    assert tree == {
        "servers": [{"host": "a"}, None, {"port": 8080}],
        "nodeSelector": {"kubernetes.io/role": "edge"},
    }


@pytest.mark.parametrize("value", [
    pytest.param("4", id="text-stays-text"),
    pytest.param(4, id="int-stays-int"),
    pytest.param(0.5, id="float"),
    pytest.param(True, id="bool"),
    pytest.param(None, id="null"),
    pytest.param(["a", 1], id="list"),
])
def test_set_keeps_values_typed(value: Any) -> None:
    tree: dict = {}
    set_helm_value(tree, "settings.limits.cpu", value)
    assert tree["settings"]["limits"]["cpu"] == value
    assert type(tree["settings"]["limits"]["cpu"]) is type(value)


def test_set_copies_the_value() -> None:
    value = {"ports": [1, 2]}
    tree: dict = {}
    set_helm_value(tree, "a", value)
    value["ports"].append(3)
    assert tree == {"a": {"ports": [1, 2]}}


def test_set_overwrites_a_scalar_like_a_repeated_set() -> None:
    tree: dict = {"a": {"b": 1}}
    set_helm_value(tree, "a.b", 2)
    assert tree == {"a": {"b": 2}}


@pytest.mark.parametrize(("tree", "pointer", "fragment"), [
    pytest.param({"a": 1}, "a.b", "needs a to be a map, but it holds 1", id="through-scalar"),
    pytest.param({"a": {}}, "a[0]", "needs a to be a list", id="map-where-list-needed"),
    pytest.param({"a": []}, "a.b", "needs a to be a map", id="list-where-map-needed"),
    pytest.param({"a": {"b": 1}}, "a", "would replace an object", id="replace-map"),
    pytest.param({"a": [1]}, "a", "would replace a list", id="replace-list"),
])
def test_set_refuses_to_destroy_structure(tree: dict, pointer: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="Helm pointer") as caught:
        set_helm_value(tree, pointer, 5)
    assert fragment in str(caught.value)


# --------------------------------------------------------------------------- helm_values


def test_helm_values_digitron_deployment() -> None:
    parameters = _load("ApplicationDeployment-helm.yaml")["spec"]["parameters"]
    assert helm_values(parameters, "digitron-orchestrator") == {
        "administrator": {"name": "Some One", "userPrincipalName": "someone@somewhere.com"},
        "idp": {"clientId": "123-ABC", "name": "Azure AD", "provider": "aad",
                "providerMetadata": "https://123-abc.com", "providerUrl": "https://123-abc.com"},
        "settings": {"limits": {"cpu": "4", "memory": "16384"}, "pollFrequency": "120",
                     "siteId": "SID-123-ABC"},
    }
    assert helm_values(parameters, "database-services") == {
        "settings": {"pollFrequency": "120", "siteId": "SID-123-ABC"}}
    assert helm_values(parameters, "not-a-component") == {}


def test_helm_values_digitron_description_defaults_are_typed() -> None:
    """Parameters without a value are skipped; the rest keep their YAML types."""
    parameters = _load("ApplicationDescription-002.yaml")["parameters"]
    values = helm_values(parameters, "digitron-orchestrator")
    assert values == {"settings": {"limits": {"cpu": 1, "memory": 16384}, "pollFrequency": 30}}
    assert helm_values(parameters, "database-services") == {"settings": {"pollFrequency": 30}}
    # the Compose target of the same parameter does not leak into a Helm component
    assert "POLL_FREQUENCY" not in json.dumps(values)


def test_helm_values_hello_world() -> None:
    parameters = _load("ApplicationDescription-001.yaml")["parameters"]
    assert helm_values(parameters, "hello-world") == {
        "global": {"config": {"appGreeting": "Hello", "appGreetingAddressee": "World"}}}


def test_helm_values_do_not_depend_on_parameter_order() -> None:
    parameters = _load("ApplicationDeployment-helm.yaml")["spec"]["parameters"]
    reversed_ = dict(reversed(list(parameters.items())))
    first = helm_values(parameters, "digitron-orchestrator")
    second = helm_values(reversed_, "digitron-orchestrator")
    assert json.dumps(first) == json.dumps(second)


def test_helm_values_same_value_twice_is_fine() -> None:
    parameters = {
        "a": _param("x", ("shared.name", ["c"])),
        "b": _param("x", ("shared.name", ["c"]), ("other", ["c"])),
    }
    assert helm_values(parameters, "c") == {"shared": {"name": "x"}, "other": "x"}


def test_helm_values_lists() -> None:
    parameters = {
        "first": _param("a", ("hosts[0].name", ["c"])),
        "third": _param("c", ("hosts[2].name", ["c"])),
        "ports": _param([80, 443], ("service.ports", ["c"])),
    }
    assert helm_values(parameters, "c") == {
        "hosts": [{"name": "a"}, None, {"name": "c"}], "service": {"ports": [80, 443]}}


CONFLICTS = [
    # id, parameters, fragment (both pointers are always named)
    ("scalar-then-deeper",
     {"a": _param(1, ("x.y", ["c"])), "b": _param(2, ("x.y.z", ["c"]))},
     "'x.y' (parameter 'a') and 'x.y.z' (parameter 'b') at x.y: one sets it to a value"),
    ("deeper-then-scalar",
     {"a": _param(1, ("x.y.z", ["c"])), "b": _param(2, ("x.y", ["c"]))},
     "'x.y.z' (parameter 'a') and 'x.y' (parameter 'b') at x.y: one writes inside it"),
    ("list-value-then-index",
     {"a": _param([1], ("x", ["c"])), "b": _param(2, ("x[0]", ["c"]))},
     "'x' (parameter 'a') and 'x[0]' (parameter 'b') at x: one sets it to a value, "
     "the other uses it as a list"),
    ("list-versus-map",
     {"a": _param(1, ("x[0]", ["c"])), "b": _param(2, ("x.y", ["c"]))},
     "'x[0]' (parameter 'a') and 'x.y' (parameter 'b') at x: one uses it as a list, "
     "the other as a map"),
    ("different-values",
     {"a": _param(1, ("x.y", ["c"])), "b": _param(True, ("x.y", ["c"]))},
     "'x.y' (parameter 'a') and 'x.y' (parameter 'b') at x.y: they set different values "
     "(1 and true)"),
    ("within-one-parameter",
     {"a": _param(1, ("x", ["c"]), ("x.y", ["c"]))},
     "'x' (parameter 'a') and 'x.y' (parameter 'a')"),
]


@pytest.mark.parametrize(("parameters", "fragment"), [c[1:] for c in CONFLICTS],
                         ids=[c[0] for c in CONFLICTS])
def test_helm_values_conflicts_name_both_pointers(parameters: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="conflicting Helm pointers") as caught:
        helm_values(parameters, "c")
    assert fragment in str(caught.value)


def test_helm_values_conflict_only_within_a_component() -> None:
    parameters = {"a": _param(1, ("x", ["one"])), "b": _param(2, ("x.y", ["two"]))}
    assert helm_values(parameters, "one") == {"x": 1}
    assert helm_values(parameters, "two") == {"x": {"y": 2}}


def test_helm_values_bad_pointer_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"parameter 'greeting': invalid Helm pointer 'a\.\.b'"):
        helm_values({"greeting": _param("hi", ("a..b", ["c"]))}, "c")


def test_helm_values_bad_targets() -> None:
    with pytest.raises(ValueError, match="each target needs a string pointer"):
        helm_values({"p": {"value": 1, "targets": [{"components": ["c"]}]}}, "c")
    with pytest.raises(ValueError, match="targets must be a list"):
        helm_values({"p": {"value": 1, "targets": "x"}}, "c")


# --------------------------------------------------------------------------- Compose


@pytest.mark.parametrize(("pointer", "name"), [
    pytest.param("ADMIN_NAME", "ADMIN_NAME", id="plain"),
    pytest.param("ENV.ADMIN_NAME", "ADMIN_NAME", id="old-ENV-prefix"),
    pytest.param("_private1", "_private1", id="underscore-and-digit"),
    pytest.param("lower", "lower", id="lower-case"),
])
def test_compose_variable_name(pointer: str, name: str) -> None:
    assert compose_variable_name(pointer) == name


@pytest.mark.parametrize("pointer", [
    pytest.param("", id="empty"),
    pytest.param("1ABC", id="leading-digit"),
    pytest.param("ENV.", id="bare-prefix"),
    pytest.param("env.X", id="lower-case-prefix-is-not-special"),
    pytest.param("ENV.ENV.X", id="prefix-stripped-once"),
    pytest.param("A-B", id="dash"),
    pytest.param("A B", id="space"),
    pytest.param("settings.pollFrequency", id="helm-pointer"),
    pytest.param(None, id="not-text"),
])
def test_compose_variable_name_errors(pointer: Any) -> None:
    with pytest.raises(ValueError, match="Compose pointer"):
        compose_variable_name(pointer)


@pytest.mark.parametrize(("value", "text"), [
    pytest.param(True, "true", id="true"),
    pytest.param(False, "false", id="false"),
    pytest.param(0, "0", id="zero"),
    pytest.param(-3, "-3", id="negative"),
    pytest.param(10**20, "100000000000000000000", id="big-int"),
    pytest.param(0.5, "0.5", id="float"),
    pytest.param(1.0, "1.0", id="integral-float"),
    pytest.param(0.1, "0.1", id="shortest-repr"),
    pytest.param(1e-07, "1e-07", id="exponent"),
    pytest.param("Some One", "Some One", id="text-as-is"),
    pytest.param("", "", id="blank"),
    pytest.param(None, "", id="null"),
    pytest.param([1, "a", True, None, 0.5], '[1,"a",true,null,0.5]', id="list-as-json"),
    pytest.param(["é"], '["é"]', id="list-keeps-unicode"),
    pytest.param({"b": 1, "a": [2]}, '{"a":[2],"b":1}', id="mapping-sorted-json"),
])
def test_env_string(value: Any, text: str) -> None:
    assert env_string(value) == text


@pytest.mark.parametrize(("value", "error"), [
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(-math.inf, ValueError, id="infinity"),
    pytest.param([math.nan], ValueError, id="nan-in-list"),
    pytest.param("a\x00b", ValueError, id="nul-character"),
    pytest.param(b"bytes", TypeError, id="bytes"),
    pytest.param(datetime.date(2024, 1, 1), TypeError, id="yaml-date"),
])
def test_env_string_errors(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        env_string(value)


def test_compose_environment_digitron_deployment() -> None:
    parameters = _load("ApplicationDeployment-compose.yaml")["spec"]["parameters"]
    env = compose_environment(parameters, "digitron-orchestrator-docker")
    assert env == {
        "ADMIN_NAME": "Some One",
        "ADMIN_PRINCIPALNAME": "someone@somewhere.com",
        "IDP_CLIENT_ID": "123-ABC",
        "IDP_NAME": "Azure AD",
        "IDP_PROVIDER": "aad",
        "IDP_URL": "https://123-abc.com",
        "POLL_FREQUENCY": "120",
        "SITE_ID": "SID-123-ABC",
    }
    assert list(env) == sorted(env)


def test_compose_environment_digitron_description_defaults() -> None:
    parameters = _load("ApplicationDescription-002.yaml")["parameters"]
    assert compose_environment(parameters, "digitron-orchestrator-docker") == {
        "POLL_FREQUENCY": "30"}


def test_compose_environment_stringifies_typed_values() -> None:
    parameters = {
        "debug": _param(True, ("DEBUG", ["app"])),
        "ratio": _param(0.25, ("RATIO", ["app"])),
        "tags": _param(["a", "b"], ("TAGS", ["app"])),
        "unset": {"targets": [{"pointer": "UNSET", "components": ["app"]}]},
        "elsewhere": _param("x", ("OTHER", ["db"])),
    }
    assert compose_environment(parameters, "app") == {
        "DEBUG": "true", "RATIO": "0.25", "TAGS": '["a","b"]'}


def test_compose_environment_same_text_twice_is_fine() -> None:
    parameters = {"a": _param(4, ("ENV.N", ["app"])), "b": _param("4", ("N", ["app"]))}
    assert compose_environment(parameters, "app") == {"N": "4"}


def test_compose_environment_conflict_names_both_parameters() -> None:
    parameters = {"a": _param("x", ("ENV.N", ["app"])), "b": _param("y", ("N", ["app"]))}
    with pytest.raises(ValueError, match="environment variable N gets 'x' from parameter 'a' "
                                         "and 'y' from parameter 'b'"):
        compose_environment(parameters, "app")


@pytest.mark.parametrize(("parameters", "fragment"), [
    pytest.param({"p": _param("x", ("settings.poll", ["app"]))},
                 "parameter 'p': invalid Compose pointer 'settings.poll'", id="bad-name"),
    pytest.param({"p": _param(math.inf, ("X", ["app"]))}, "parameter 'p': inf", id="bad-value"),
    pytest.param({"p": _param(b"x", ("X", ["app"]))}, "parameter 'p': cannot render bytes",
                 id="bad-type"),
])
def test_compose_environment_errors_name_the_parameter(parameters: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        compose_environment(parameters, "app")
    assert fragment in str(caught.value)


# --------------------------------------------------------------------------- properties

# Keys from a safe alphabet plus the characters that need escaping in a --set key.
_KEYS = st.text(alphabet="abcXYZ019_-/ .\\,=[]", min_size=1, max_size=8)
_PATHS = st.tuples(_KEYS).flatmap(
    lambda head: st.lists(st.one_of(_KEYS, st.integers(0, 4)), max_size=5).map(
        lambda rest: head + tuple(rest)))
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10),
                    st.floats(allow_nan=False), st.lists(st.integers(), max_size=3))


def _escape(key: str) -> str:
    """Escape a key by hand, independently of format_helm_pointer."""
    for char in "\\.,=[]":
        key = key.replace(char, "\\" + char)
    return key


def _pointer(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + _escape(part)
    return text


@given(_PATHS, _VALUES)
def test_set_then_read_back(path: tuple[str | int, ...], value: Any) -> None:
    pointer = _pointer(path)
    assert parse_helm_pointer(pointer) == path
    assert format_helm_pointer(path) == pointer
    tree: dict = {}
    set_helm_value(tree, pointer, value)
    assert _read(tree, parse_helm_pointer(pointer)) == value


@given(st.lists(st.tuples(_PATHS, st.integers()), min_size=1, max_size=6))
def test_helm_values_either_conflicts_or_keeps_every_value(
        writes: list[tuple[tuple[str | int, ...], int]]) -> None:
    parameters = {f"p{i:02d}": _param(v, (_pointer(p), ["c"])) for i, (p, v) in
                  enumerate(writes)}
    try:
        tree = helm_values(parameters, "c")
    except ValueError as exc:
        assert "conflicting Helm pointers" in str(exc)
        return
    for path, value in writes:
        assert _read(tree, path) == value
