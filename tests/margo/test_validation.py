"""Validation beyond the official examples: semantic checks, located messages, leniency."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from kits.serverkit import assert_deployment_in_generation

from margo.canonical import canonical_yaml
from margo.emit import (
    CONSTRAINTS_EXTENSION,
    deployment_document,
    deployment_yaml,
    emitted_shape,
    profile_type_spelling,
)
from margo.kinds import Kind, Shape
from margo.models import (
    ApplicationDeployment,
    ApplicationDescription,
    DeploymentState,
    DeviceCapabilities,
    ProfileType,
)
from margo.validation import validate_document

DESCRIPTION: dict[str, Any] = {
    "apiVersion": "margo.org/v1-alpha1",
    "kind": "ApplicationDescription",
    "id": "com-example-app",
    "metadata": {"name": "App", "version": "1.0.0",
                 "catalog": {"organization": [{"name": "Example"}]}},
    "deploymentProfiles": [
        {"type": "helm", "id": "helm-a",
         "components": [{"name": "db", "properties": {"repository": "oci://r/db",
                                                      "revision": "1.0.0"}},
                        {"name": "web", "properties": {"repository": "oci://r/web",
                                                       "revision": "2.0.0", "wait": True,
                                                       "timeout": "5m0s"},
                         "x-acme-extensions": {"tier": "gold"}}],
         "deviceConstraints": {"capacityRequirements": {"memory": "1Gi"}},
         "x-acme-extensions": {"profile": 1}},
        {"type": "compose", "id": "compose-a",
         "components": [{"name": "web-compose", "properties": {"repository": "oci://r/c",
                                                               "revision": "2.0.0"}}]},
    ],
    "parameters": {
        "greeting": {"value": "hi", "targets": [
            {"pointer": "config.greeting", "components": ["web"]},
            {"pointer": "GREETING", "components": ["web-compose"]}]},
        "replicas": {"value": 2, "targets": [{"pointer": "replicaCount", "components": ["web"]}]},
    },
    "configuration": {
        "sections": [{"name": "General", "settings": [
            {"parameter": "greeting", "name": "Greeting", "schema": "text"},
            {"parameter": "replicas", "name": "Replicas", "schema": "count", "immutable": True}]}],
        "schema": [{"name": "text", "dataType": "string", "maxLength": 10},
                   {"name": "count", "dataType": "integer", "minValue": 1, "maxValue": 5}],
    },
    "x-acme-extensions": {"wfm": "only"},
}


def validate(doc: Any) -> Any:
    return validate_document(canonical_yaml(doc), file="app.yaml")


def messages(doc: Any) -> list[str]:
    return [p.format() for p in validate(doc).problems]


def mutated(change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(DESCRIPTION)
    change(doc)
    return doc


def test_the_reference_description_is_valid_rc3() -> None:
    report = validate(DESCRIPTION)
    assert report.problems == []
    assert (report.kind, report.shape) == (Kind.APPLICATION_DESCRIPTION, Shape.RC3)
    model = report.model
    assert model.id == "com-example-app"
    assert model.profiles[0].extensions == {"x-acme-extensions": {"profile": 1}}
    assert model.profiles[0].components[1].extensions == {"x-acme-extensions": {"tier": "gold"}}
    assert model.profiles[1].type is ProfileType.COMPOSE
    assert model.settings()["replicas"].immutable


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["deploymentProfiles"][1].update(id="helm-a"),
         "$.deploymentProfiles[1].id: duplicate deployment profile id 'helm-a'"),
        (lambda d: d["deploymentProfiles"][0]["components"][1].update(name="db"),
         "$.deploymentProfiles[0].components[1].name: duplicate component name 'db'"),
        (lambda d: d["deploymentProfiles"][0]["components"][0]["properties"].update(
            revision="1.0.0+build"),
         "properties.revision: expected a SemVer 2.0 revision"),
        (lambda d: d["deploymentProfiles"][0]["components"][0]["properties"].update(
            timeout="5 minutes"), "properties.timeout: expected a timeout written as ##m##s"),
        (lambda d: d["parameters"]["greeting"]["targets"][0].update(components=["nope"]),
         "$.parameters.greeting.targets[0].components[0]: parameter 'greeting' targets unknown "
         "component 'nope'"),
        (lambda d: d["parameters"]["greeting"]["targets"][1].update(pointer="NOT-AN-ENV"),
         "$.parameters.greeting.targets[1].pointer: invalid compose parameter pointer"),
        (lambda d: d["parameters"]["greeting"]["targets"][0].update(pointer="a..b"),
         "$.parameters.greeting.targets[0].pointer: invalid helm parameter pointer"),
        (lambda d: d["configuration"]["sections"][0]["settings"][0].update(parameter="ghost"),
         "settings[0].parameter: setting refers to unknown parameter 'ghost'"),
        (lambda d: d["configuration"]["sections"][0]["settings"][0].update(schema="ghost"),
         "settings[0].schema: setting refers to unknown schema 'ghost'"),
        (lambda d: d["parameters"]["replicas"].update(value=9),
         "$.parameters.replicas.value:"),
        (lambda d: d["parameters"]["greeting"].update(value="far too long a greeting"),
         "$.parameters.greeting.value:"),
        (lambda d: d["configuration"]["schema"][1].update(minLength=3),
         "$.configuration.schema[1]"),
        (lambda d: d["deploymentProfiles"][0]["deviceConstraints"].update(eligibilityRules=[
            {"propertySelector": {"matchExpressions": [
                {"key": "/cpus", "operator": "Gt", "values": [1, 2]}]}}]),
         "$.deploymentProfiles[0].deviceConstraints.eligibilityRules[0].propertySelector"
         ".matchExpressions[0]"),
        (lambda d: d.update(extra=1), "$.extra: unknown field 'extra'"),
        (lambda d: d["metadata"].update(nmae="x"), "$.metadata.nmae: unknown field 'nmae' "
                                                   "(did you mean 'name'?)"),
        (lambda d: d.update({"x-Bad-extensions": {}}), "extensions must be named"),
        (lambda d: d["deploymentProfiles"][0].update(type="helm.v3"),
         "$.deploymentProfiles[0].type: expected one of 'helm', 'compose', 'custom', "
         "found 'helm.v3'"),
        (lambda d: d["metadata"].pop("catalog"), "$.metadata: missing required field 'catalog'"),
        (lambda d: d["deploymentProfiles"].clear(),
         "$.deploymentProfiles: expected at least 1 item(s), found 0"),
    ],
    ids=["dup-profile", "dup-component", "plus-build", "timeout", "unknown-target",
         "compose-pointer", "helm-pointer", "unknown-parameter", "unknown-schema",
         "default-out-of-range", "default-too-long", "rule-field-wrong-type", "malformed-Gt",
         "unknown-top", "typo-hint", "bad-extension-name", "rc3-type", "missing", "empty-list"],
)
def test_semantic_and_schema_problems_are_located(change: Any, expected: str) -> None:
    found = messages(mutated(change))
    assert any(expected in m for m in found), found
    assert all(m.startswith("app.yaml:") and ":0:0:" not in m for m in found), found


def test_every_problem_is_reported_not_just_the_first() -> None:
    def break_things(d: dict[str, Any]) -> None:
        d["metadata"].update(nmae="x")
        d["deploymentProfiles"][0]["components"][0]["properties"]["revision"] = "v1"
        d["deploymentProfiles"][1]["type"] = "kubernetes"
    assert len(messages(mutated(break_things))) == 3


def test_problem_positions_point_into_the_file() -> None:
    text = canonical_yaml(mutated(lambda d: d["metadata"].update(nmae="x"))).decode()
    [problem] = validate_document(text, file="app.yaml").problems
    line = text.splitlines()[problem.line - 1]
    assert line[problem.column - 1:].startswith("nmae:")


def test_not_a_margo_document() -> None:
    [problem] = validate_document(b"hello: world\n").problems
    assert "cannot tell which Margo document this is" in problem.message
    [problem] = validate_document(b"- a\n- b\n").problems
    assert "a Margo document is a mapping, found a list" in problem.message


def test_wrong_types_are_reported_with_what_was_found() -> None:
    found = messages(mutated(lambda d: d["metadata"].update(catalog="none")))
    assert any("$.metadata.catalog: expected an object, found a string ('none')" in m
               for m in found), found


CAPABILITIES_RC3 = {
    "properties": {"id": "dev-1", "vendor": "V", "modelNumber": "M", "serialNumber": "S",
                   "cpus": [{"cores": 4, "architecture": "amd64"}], "memory": "59 Gi",
                   "storage": "1Ti", "otelCollector": True, "supportedRuntimes": ["oci"],
                   "supportedDeploymentTypes": ["helm"]},
    "labels": {"example.com/zone": "a", "example.com/gpus": 2, "example.com/tags": ["x", "y"]},
    "x-acme-extensions": {"anything": [1, {"deep": True}]},
}


def test_rc3_capabilities_accept_apiversion_and_kind_and_keep_extensions() -> None:
    report = validate({"apiVersion": "device.margo.org/v1alpha1",
                       "kind": "DeviceCapabilitiesManifest", **CAPABILITIES_RC3})
    assert report.problems == []
    model: DeviceCapabilities = report.model
    assert report.shape is Shape.RC3
    assert model.extensions == {"x-acme-extensions": {"anything": [1, {"deep": True}]}}
    assert model.labels["example.com/gpus"] == 2


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["properties"].update(memory="lots"), "$.properties.memory: not a quantity"),
        (lambda d: d["labels"].update({"k": {"nested": 1}}), "$.labels.k: a label value must be"),
        (lambda d: d["labels"].update({"k": [1, "a"]}), "$.labels.k: a label value must be"),
        (lambda d: d["properties"].update(roles=["Standalone Cluster"]), "unknown field"),
        (lambda d: d.update(extra=True), "$.extra: unknown field 'extra'"),
        (lambda d: d["properties"]["cpus"][0].update(architecture="x86"),
         "$.properties.cpus[0].architecture: expected one of 'amd64', 'arm64', 'arm'"),
        (lambda d: d["properties"].update(id="bad id"), "$.properties.id: expected a device id"),
    ],
    ids=["memory", "label-object", "label-mixed", "roles-with-rc3", "unknown", "arch", "id"],
)
def test_bad_capabilities(change: Any, expected: str) -> None:
    doc = copy.deepcopy(CAPABILITIES_RC3)
    change(doc)
    found = messages(doc)
    assert any(expected in m for m in found), found


def test_oct_2024_capabilities_are_normalised_for_matching() -> None:
    doc = {"apiVersion": "device.margo.org/v1alpha1", "kind": "DeviceCapabilitiesManifest",
           "properties": {"id": "old", "vendor": "V", "modelNumber": "M", "serialNumber": "S",
                          "roles": ["Standalone Device"],
                          "resources": {"cpu": {"cores": 2, "architectures": ["x86_64"]},
                                        "memory": "4Gi", "storage": "32Gi"}}}
    model: DeviceCapabilities = validate(doc).model
    assert model.properties["cpus"] == [{"cores": 2, "architecture": "amd64"}]
    assert model.properties["supportedDeploymentTypes"] == ["compose"]
    assert model.roles == ("Standalone Device",)


def test_status_shapes_normalise_to_lower_case_states() -> None:
    old = {"deploymentId": "d1", "status": {"state": "Installed"},
           "components": [{"name": "a", "state": "Installing"}]}
    report = validate(old)
    assert report.shape is Shape.OCT_2024
    assert report.model.components[0].state is DeploymentState.INSTALLING
    new = {"deploymentId": "d1", "adoptedManifestVersion": 3, "status": {"state": "failed",
           "error": {"code": "E1", "source": "x", "message": "m"}},
           "components": [{"name": "a", "state": "failed"}, {"name": "a", "state": "pending"}]}
    assert "duplicate component name 'a'" in messages(new)[0]
    new_missing = {"deploymentId": "d1", "status": {"state": "failed"}, "components": []}
    assert "missing required field 'adoptedManifestVersion'" in messages(new_missing)[0]


def _digest(c: str) -> str:
    return "sha256:" + c * 64


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        ({"manifestVersion": 1, "bundle": None, "deployments": []}, None),
        ({"manifestVersion": 1, "bundle": {"mediaType": "application/vnd.margo.bundle.v1+tar+gzip",
                                           "digest": _digest("a"), "url": "/api/v1/bundles/"
                                           + _digest("a")}, "deployments": []},
         "bundle must be null"),
        ({"manifestVersion": 2, "bundle": None, "deployments": [
            {"deploymentId": "d", "digest": _digest("b"),
             "url": "/api/v1/deployments/d/" + _digest("b")}]}, "bundle must describe"),
        ({"manifestVersion": 2, "bundle": {"mediaType": "application/vnd.margo.bundle.v1+tar+gzip",
                                           "digest": _digest("a"), "url": "/api/v1/bundles/"
                                           + _digest("c")}, "deployments": [
            {"deploymentId": "d", "digest": "md5:" + "0" * 32,
             "url": "/api/v1/deployments/d/md5:" + "0" * 32}]},
         "unsupported digest algorithm"),
        ({"manifestVersion": 2**64, "bundle": None, "deployments": []}, "maximum"),
    ],
    ids=["empty", "bundle-without-deployments", "deployments-without-bundle", "bad-urls",
         "too-big"],
)
def test_state_manifest_rules(manifest: dict[str, Any], expected: str | None) -> None:
    found = messages(manifest)
    if expected is None:
        assert found == []
    else:
        assert any(expected in m for m in found), found


def test_deployments_emit_newest_rc2_and_oct_2024_shapes_that_validate() -> None:
    old = {"apiVersion": "application.margo.org/v1alpha1", "kind": "ApplicationDeployment",
           "metadata": {"annotations": {"id": "a3e2f5dc-912e-494f-8395-52cf3769bc06",
                                        "applicationId": "com-example-app"},
                        "name": "app", "namespace": "margo"},
           "spec": {"deploymentProfile": {"type": "helm.v3", "components": [
               {"name": "web", "properties": {"repository": "oci://r/web", "revision": "1.0.0",
                                              "wait": "true"}}]},
               "parameters": {"n": {"value": "4", "targets": [
                   {"pointer": "a.b", "components": ["web"]}]}}}}
    model: ApplicationDeployment = validate(old).model
    assert model.id == "a3e2f5dc-912e-494f-8395-52cf3769bc06"
    assert model.profile.components[0].properties.wait is True
    newest = deployment_document(model)
    assert list(newest) == ["id", "metadata", "spec"]
    assert newest["spec"]["applicationId"] == "com-example-app"
    assert newest["spec"]["deploymentProfile"]["type"] == "helm"
    again = validate({**newest, "metadata": {**newest["metadata"], "deviceId": "dev-1"}})
    assert again.problems == [] and again.shape is Shape.RC3
    oct_doc = deployment_document(model, shape="oct-2024")
    assert oct_doc["metadata"]["annotations"] == {"id": model.id,
                                                  "applicationId": "com-example-app"}
    assert oct_doc["spec"]["deploymentProfile"]["type"] == "helm.v3"
    assert validate(oct_doc).shape is Shape.OCT_2024 and validate(oct_doc).valid
    placed = dataclasses.replace(model, device_id="dev-1")
    assert deployment_yaml(placed) == deployment_yaml(validate(deployment_document(placed)).model)
    assert deployment_yaml(placed) == canonical_yaml(deployment_document(placed))
    # rc.2: the official OpenAPI's appDeploymentManifest and our rc.2 schema alike; read
    # back, it is the same deployment.
    rc2 = deployment_yaml(placed, shape="rc.2")
    rc2_doc = assert_deployment_in_generation("rc.2", rc2)
    assert list(rc2_doc) == ["apiVersion", "kind", "id", "metadata", "spec"]
    assert rc2_doc["apiVersion"] == "application.margo.org/v1alpha1"
    assert rc2_doc["metadata"]["annotations"] == {"applicationId": "com-example-app"}
    assert rc2_doc["spec"]["applicationId"] == "com-example-app"
    assert rc2_doc["spec"]["deploymentProfile"]["type"] == "helm"
    assert dataclasses.replace(validate(rc2_doc).model, shape=placed.shape) == placed
    assert emitted_shape(rc2) is Shape.RC2 and emitted_shape(deployment_yaml(placed)) is Shape.RC3
    assert emitted_shape(canonical_yaml(oct_doc)) is Shape.OCT_2024


def test_each_shape_says_what_it_cannot_hold_and_rc2_keeps_constraints_in_an_extension(
        ) -> None:
    description: ApplicationDescription = validate(DESCRIPTION).model
    helm = description.profile("helm-a")
    assert helm is not None
    placed = ApplicationDeployment(
        id="a3e2f5dc-912e-494f-8395-52cf3769bc06", name="app", namespace="margo",
        application_id=description.id, profile=helm, parameters={}, device_id="dev-1")
    rc2 = deployment_document(placed, shape="rc.2")
    profile = rc2["spec"]["deploymentProfile"]
    assert "deviceConstraints" not in profile  # the rc.2 OpenAPI closes the profile
    assert profile[CONSTRAINTS_EXTENSION[0]] == {CONSTRAINTS_EXTENSION[1]: {
        "capacityRequirements": {"memory": "1Gi"}}}
    assert profile["x-acme-extensions"] == {"profile": 1}  # the application's own, kept
    assert_deployment_in_generation("rc.2", canonical_yaml(rc2))
    custom = dataclasses.replace(placed, profile=dataclasses.replace(
        helm, type=ProfileType.CUSTOM))
    for shape in ("rc.2", "oct-2024"):
        assert profile_type_spelling(shape, ProfileType.CUSTOM) is None
        with pytest.raises(ValueError, match=f"no {shape} spelling"):
            deployment_document(custom, shape=shape)
    assert deployment_document(custom)["spec"]["deploymentProfile"]["type"] == "custom"
    with pytest.raises(ValueError, match=r"shape 'rc\.1'"):
        deployment_document(placed, shape="rc.1")


def test_problem_detail_formats_are_checked() -> None:
    good = {"type": "https://docs.margo.org/specification/problem-types#invalid-request",
            "title": "Invalid Request", "status": 400, "vendor_code": "E1"}
    assert validate(good).valid
    found = messages({**good, "type": "http://a b"})
    assert any("$.type" in m and "uri-reference" in m for m in found), found
