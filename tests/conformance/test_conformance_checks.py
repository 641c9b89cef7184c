"""Every validation operation of the kit's step schema, field paths and context substitution,
with the kit runner's JavaScript semantics where they differ from Python's (so a verdict here
means what it means there)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from conformance.checks import OPERATIONS, Response, field_value, substitute, validate

BODY = {"manifestVersion": 3, "flag": True, "name": "abc", "empty": "", "zero": 0,
        "list": [], "items": [{"id": "a"}, {"id": "b"}],
        "bundle": {"mediaType": "application/vnd.margo.bundle.v1+tar+gzip"},
        "deployments": [{"deploymentId": "d1"}], "ratio": 1.0}
RAW = json.dumps(BODY).encode()
DIGEST = "sha256:" + hashlib.sha256(RAW).hexdigest()


def response(body: bytes = RAW, **headers: str) -> Response:
    return Response("GET", "/x", 200, {k.replace("_", "-"): v for k, v in headers.items()}, body)


def check(operation: str, field: str | None = None, value: Any = None,
          answer: Response | None = None, context: dict[str, Any] | None = None) -> str:
    validation: dict[str, Any] = {"operation": operation}
    if field is not None:
        validation["field"] = field
    if value is not None:
        validation["value"] = value
    return validate(answer or response(etag=f'"{DIGEST}"'), validation, context or {})


@pytest.mark.parametrize(("operation", "field", "value", "holds"), [
    ("exists", "name", None, True), ("exists", "nothing", None, False),
    ("exists", "zero", None, True),
    ("is_string", "name", None, True), ("is_string", "zero", None, False),
    ("is_number", "manifestVersion", None, True), ("is_number", "ratio", None, True),
    ("is_number", "flag", None, False),  # a boolean is not a number in JavaScript
    ("is_array", "list", None, True), ("is_array", "name", None, False),
    ("not_empty", "name", None, True), ("not_empty", "empty", None, False),
    ("not_empty", "list", None, False), ("not_empty", "zero", None, True),
    ("equals", "manifestVersion", 3, True), ("equals", "ratio", 1, True),
    ("equals", "flag", 1, False), ("equals", "zero", False, False),
    ("equals", "items.1.id", "b", True), ("equals", "name", "ABC", False),
    ("equals", "list", [], True),
    ("contains", "name", "b", True), ("contains", "manifestVersion", 3, True),
    ("contains", "nothing", "x", False),
    ("not_contains", "name", "z", True), ("not_contains", "nothing", "x", True),
    ("not_contains", "name", "a", False),
    ("one_of", "name", ["x", "abc"], True), ("one_of", "manifestVersion", [True, "3"], False),
    ("greater_than", "manifestVersion", 2, True), ("greater_than", "manifestVersion", 3, False),
    ("greater_than", "name", 0, False),
    ("array_length_gte", "items", 2, True), ("array_length_gte", "items", 3, False),
    ("array_length_equals", "list", 0, True), ("array_length_equals", "name", 3, False),
    ("matches_regex", "_headers.etag", '^"sha256:[0-9a-f]{64}"$', True),
    ("matches_regex", "name", "^b", False), ("matches_regex", "name", "(", False),
])
def test_field_operations(operation: str, field: str, value: Any, holds: bool) -> None:
    assert (check(operation, field, value) == "") is holds


def test_every_operation_of_the_schema_is_implemented() -> None:
    schema = {"exists", "is_string", "is_number", "is_array", "not_empty", "equals",
              "contains", "not_contains", "one_of", "greater_than", "array_length_gte",
              "array_length_equals", "etag_is_body_digest", "body_sha256_equals",
              "bundle_null_when_no_deployments", "bundle_media_type",
              "has_application_description_layer", "layer_media_types_are_margo_specific"}
    assert schema <= set(OPERATIONS) | {"matches_regex"}
    assert check("frobnicate", "name") == "unsupported validation operation: frobnicate"


def test_failure_messages_name_the_field_and_the_values() -> None:
    assert check("equals", "manifestVersion", 1) == "manifestVersion expected 1, got 3"
    assert check("array_length_equals", "items", 1) == (
        "items expected length == 1, got 2: [{'id': 'a'}, {'id': 'b'}]")


def test_regexes_are_not_substituted_but_values_are() -> None:
    """`{64}` is a quantifier, not a context variable; `{want}` in a value is one."""
    assert check("matches_regex", "_headers.etag", '^"sha256:[0-9a-f]{64}"$',
                 context={"64": "x"}) == ""
    assert check("equals", "name", "{want}", context={"want": "abc"}) == ""


@pytest.mark.parametrize(("etag", "holds"), [(f'"{DIGEST}"', True), (f'W/"{DIGEST}"', True),
                                             (DIGEST, True), ('"sha256:00"', False),
                                             (None, False)])
def test_etag_is_body_digest(etag: str | None, holds: bool) -> None:
    answer = response() if etag is None else response(etag=etag)
    assert (check("etag_is_body_digest", answer=answer) == "") is holds


def test_digests_are_over_the_exact_bytes_even_binary_ones() -> None:
    blob = bytes(range(256))
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    answer = response(blob, etag=f'"{digest}"')
    assert check("etag_is_body_digest", answer=answer) == ""
    assert check("body_sha256_equals", value=digest, answer=answer) == ""
    assert check("body_sha256_equals", value=digest[7:].upper(), answer=answer) == ""
    assert "does not match the manifest digest" in check("body_sha256_equals", value=DIGEST,
                                                         answer=answer)
    assert check("body_sha256_equals", value="{unset}", answer=answer) == (
        "the expected digest is empty")


@pytest.mark.parametrize(("manifest", "holds"), [
    ({"deployments": [], "bundle": None}, True),
    ({"deployments": []}, False),  # MI-009: present and null, not omitted
    ({"deployments": [], "bundle": {"digest": "x"}}, False),
    ({"deployments": [{"deploymentId": "d"}], "bundle": {"digest": "x"}}, True),
])
def test_bundle_null_when_no_deployments(manifest: dict[str, Any], holds: bool) -> None:
    answer = response(json.dumps(manifest).encode())
    assert (check("bundle_null_when_no_deployments", answer=answer) == "") is holds


@pytest.mark.parametrize(("bundle", "holds"), [
    (None, True), ({"mediaType": "application/vnd.margo.bundle.v1+tar+gzip"}, True),
    ({"mediaType": "application/gzip"}, False), ("a string", False)])
def test_bundle_media_type(bundle: Any, holds: bool) -> None:
    answer = response(json.dumps({"bundle": bundle}).encode())
    assert (check("bundle_media_type", answer=answer) == "") is holds


def test_package_layer_operations() -> None:
    good = {"layers": [{"mediaType": "application/vnd.margo.app.description.v1+yaml"},
                       {"mediaType": "application/vnd.margo.app.icon.v1+png"}]}
    bad = {"layers": [{"mediaType": "application/octet-stream", "digest": "sha256:1",
                       "annotations": {"org.opencontainers.image.title": "icon.png"}}]}
    for operation in ("has_application_description_layer",
                      "layer_media_types_are_margo_specific"):
        assert check(operation, answer=response(json.dumps(good).encode())) == ""
    assert "no layer has mediaType" in check("has_application_description_layer",
                                             answer=response(json.dumps(bad).encode()))
    assert check("layer_media_types_are_margo_specific",
                 answer=response(json.dumps(bad).encode())) == (
        "layer(s) without a Margo media type: icon.png: 'application/octet-stream'")


def test_field_paths() -> None:
    answer = response(etag='"e"', content_type="application/json")
    assert field_value(answer, "_headers.ETag") == '"e"'
    assert field_value(answer, "_headers.Content-Type") == "application/json"
    assert field_value(answer, "_body") == RAW.decode()
    assert field_value(answer, "items.1.id") == "b"
    assert field_value(answer, "items.5.id") is None
    assert field_value(answer, "name.length") is None
    text = response(b"plain words")
    assert field_value(text, "_body") == "plain words"
    assert field_value(text, "anything") is None
    assert field_value(response(b""), "x") is None


def test_substitution() -> None:
    context = {"id": "d1", "n": 3, "empty": "", "flag": True}
    assert substitute({"a": ["/x/{id}/{n}", 5, None], "b": "{flag}"}, context) == {
        "a": ["/x/d1/3", 5, None], "b": "true"}
    assert substitute("/{deploymentId}/{bundleDigest}/{empty}/{other}", context) == (
        "/deployment-none-00000000/sha256:" + "0" * 64 + "//")
