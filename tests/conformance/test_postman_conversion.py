"""The Postman-to-steps conversion of the kit's runner (README section 2.4), on the rc.2 core
collection (B1) it was written for and on small collections for the edge cases."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kits.conformancekit import B1_COLLECTION

from conformance.postman import (
    convert_collection,
    derive_error_behavior,
    derive_step,
    is_postman_collection,
    postman_endpoint,
)
from conformance.runner import load_suite

COLLECTION = json.loads(B1_COLLECTION.read_text())


def b1_steps() -> dict[str, dict[str, Any]]:
    suite = load_suite(B1_COLLECTION, "core")
    assert len(suite.scenarios) == 1
    return {s["id"]: s for s in suite.scenarios[0]["steps"]}


def test_the_core_group_is_31_steps_successes_first() -> None:
    suite = load_suite(B1_COLLECTION, "core")
    steps = suite.scenarios[0]["steps"]
    assert suite.name == "core" and len(steps) == 31
    codes = [s["expected_status"] for s in steps]
    assert codes[:9] == [200, 201, 201, 201, 200, 200, 200, 200, 200]
    assert all(code >= 300 for code in codes[9:])
    assert steps[1]["extract_context"] == {"clientId": "clientId", "deviceId": "clientId"}


def test_paths_placeholders_and_digests() -> None:
    assert postman_endpoint(["api", "v1", "clients", ":clientId", "bundles", ":digest"]) == (
        "/api/v1/clients/{clientId}/bundles/{bundleDigest}")
    assert postman_endpoint(["api", "v1", "clients", ":clientId", "deployments",
                             ":deploymentId", ":digest"]) == (
        "/api/v1/clients/{clientId}/deployments/{deploymentId}/{deploymentDigest}")


def test_success_steps_get_real_margo_bodies_and_checks() -> None:
    steps = b1_steps()
    onboarding = steps["0b95ee4e-dc64-4119-b07e-69c3342da26a"]
    assert onboarding["request_body"]["certificate"] == "./certs/device-cert.pem"
    assert onboarding["request_body"]["apiVersion"] == "onboarding.margo.org/v1alpha1"
    capabilities = steps["0510e725-a124-415f-a9b9-0d369e1d94e2"]["request_body"]
    assert capabilities["properties"]["id"] == "{deviceId}"
    assert "roles" not in capabilities["properties"]  # the lorem-ipsum body is replaced
    status = steps["6283ddb7-ae5b-4602-ae16-fa7b3aff0bc0"]
    assert status["request_body"]["deploymentId"] == "{deploymentId}"
    assert status["request_body"]["status"]["state"] == "installed"  # merged, not replaced
    assert status["accepted_statuses"] == [200, 400, 404]
    certificate = steps["c42f4b7d-992a-4af0-924b-2eb4d787678a"]
    assert certificate["skip_signing"] is True
    manifest = steps["6da61c30-6c27-4090-b345-34eedc8747de"]
    assert manifest["headers"] == {}  # the "no Accept header" item
    assert {"operation": "etag_is_body_digest"} in manifest["validations"]
    bundle = steps["195c5f23-c8c7-491a-b622-3ce29a0aa9c4"]
    assert bundle["validations"] == [{"field": "_headers.content-type", "operation": "contains",
                                      "value": "application/vnd.margo.bundle.v1+tar+gzip"}]


@pytest.mark.parametrize(("step_id", "expected"), [
    ("f9e10c20-8474-47ec-81c0-fc7c0823891d", {"skip_signing": True}),  # onboarding 400
    ("e89bca4b-f257-434a-8397-d604c2b42eb8", {"fresh_cert": True,
                                              "accepted_statuses": [401, 403]}),
    ("f206fb46-f592-45ea-a6f1-6569371ee515", {"skip_content_digest": True}),
    ("5fc47546-2c1a-4956-9b6a-cfdfb31b88f6", {"tamper_signature": True}),
    ("17a2b787-ca67-4dd6-a72b-27cd1290bebc", {"headers": {
        "Accept": "application/vnd.margo.manifest.v1+json", "If-None-Match": "*"}}),
    ("f54748a1-72c1-4fb9-a64f-7e4b2b36ba54", {"headers": {"Accept": "text/plain"}}),
])
def test_error_examples_provoke_their_error(step_id: str, expected: dict[str, Any]) -> None:
    step = b1_steps()[step_id]
    for key, value in expected.items():
        assert step[key] == value
    assert step["validations"] == [] and step["extract_context"] == {}


def test_semantic_and_certificate_errors_get_purpose_built_bodies() -> None:
    steps = b1_steps()
    capabilities = steps["a3f7146c-5c7f-41f1-82d4-9ed75c84ec24"]["request_body"]
    assert capabilities["properties"]["supportedDeploymentTypes"] == [
        "__invalid_deployment_type__"]
    status = steps["6e674338-64ef-434c-9905-3ddff3d14877"]["request_body"]
    assert status["status"]["state"] == "__invalid_state__"
    first = steps["f9e10c20-8474-47ec-81c0-fc7c0823891d"]["request_body"]["certificate"]
    again = b1_steps()["f9e10c20-8474-47ec-81c0-fc7c0823891d"]["request_body"]["certificate"]
    assert first.startswith("INVALID_NOT_A_PEM_CERTIFICATE-") and first != again


@pytest.mark.parametrize(("example", "behavior"), [
    ({"code": 304}, {"add_if_none_match": True}),
    ({"code": 406}, {"wrong_accept": True}),
    ({"code": 400, "name": "Missing content-digest"}, {"skip_content_digest": True}),
    ({"code": 400, "name": "Signature verification failed"}, {"tamper_signature": True}),
    ({"code": 401}, {"tamper_signature": True}),
    ({"code": 400, "name": "Invalid certificate format"}, {"bad_certificate": True,
                                                           "skip_signing": True}),
    ({"code": 403}, {"fresh_cert": True, "accepted_statuses": [401, 403]}),
    ({"code": 409, "name": "Certificate revoked"}, {"fresh_cert": True,
                                                    "accepted_statuses": [401, 403]}),
    ({"code": 422}, {"semantic_error": True}),
    ({"code": 404, "name": "Bundle not found"}, {}),
])
def test_error_behaviors(example: dict[str, Any], behavior: dict[str, Any]) -> None:
    assert derive_error_behavior(example) == behavior


def test_group_selection() -> None:
    item, example = "0dd06053-e16c-419a-a533-f8cddb42471a", "f9e10c20-8474-47ec-81c0-fc7c0823891d"
    by_item = convert_collection(COLLECTION, {item})[0]["steps"]
    assert [s["expected_status"] for s in by_item] == [201, 400, 403]
    by_example = convert_collection(COLLECTION, {example})[0]["steps"]
    assert [s["id"] for s in by_example] == [example]
    assert len(convert_collection(COLLECTION)[0]["steps"]) == 31


def test_small_collections() -> None:
    collection = {"info": {"name": "mini", "_postman_id": "c1"}, "item": [
        {"name": "folder", "item": [
            {"id": "i1", "name": "no examples",
             "request": {"method": "get", "url": {"path": ["api", "v1", "things"]},
                         "header": [{"key": "X-Off", "value": "1", "disabled": True}]}}]},
        {"id": "i2", "name": "string url", "request": {"method": "DELETE",
                                                       "url": "{{baseUrl}}/api/v1/x/:id"},
         "response": [{"id": "r1", "code": 204, "name": "gone"}]}]}
    assert is_postman_collection(collection)
    assert is_postman_collection({"item": [], "_": {"postman_id": "p"}})
    assert not is_postman_collection([{"id": "scenario", "steps": []}])
    (scenario,) = convert_collection(collection)
    assert scenario["id"] == "c1" and scenario["name"] == "mini"
    first, second = scenario["steps"]
    assert (first["method"], first["endpoint"], first["expected_status"], first["headers"]) == (
        "GET", "/api/v1/things", 200, {})
    assert (second["method"], second["endpoint"], second["expected_status"]) == (
        "DELETE", "/api/v1/x/{id}", 204)


def test_validations_from_the_test_scripts() -> None:
    item = {"name": "cert", "request": {"method": "GET", "url": {"path": ["other"]}},
            "event": [{"listen": "test", "script": {"exec": [
                'pm.expect(pm.response.headers.get("Content-Type")).to.include("text/x");\n',
                'const schema = {"type":"object","properties":{"a":{"type":"string"},'
                '"b":{"type":"number"},"c":{"type":["string","null"]}}}\n\n// next\n']}}]}
    assert derive_step(item, {"code": 200})["validations"] == [
        {"field": "_headers.content-type", "operation": "contains", "value": "text/x"},
        {"field": "a", "operation": "is_string"}, {"field": "b", "operation": "is_number"}]
