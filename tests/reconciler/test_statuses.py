"""Status bodies and paths for the three API generations: every body validates against our
schema for its generation (and the official OpenAPI where one exists), and the rules of the
spec (most severe state, error sources) hold. The real server accepting them is tested in
test_state.py, through the journal."""

from __future__ import annotations

from typing import Any

import pytest
from kits.serverkit import assert_matches_openapi

from margo.kinds import Kind, Shape
from margo.validation import validate_value
from reconciler.statuses import GENERATIONS, overall_state, status_body, status_path

DEPLOYMENT_ID = "a3e2f5dc-912e-494f-8395-52cf3769bc06"


def body(generation: str, components: list[tuple[str, str, Any]], **extra: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = {"deployment_id": DEPLOYMENT_ID, "device_id": "edge-01",
                                 "adopted_version": 12, "components": components,
                                 "deployment_name": "orchestrator", **extra}
    return status_body(generation, **arguments)


@pytest.mark.parametrize(("states", "expected"), [
    (["installed", "installed"], "installed"),
    (["installed", "removed"], "removed"),
    (["removed", "pending"], "pending"),
    (["pending", "installing", "installed"], "installing"),
    (["installing", "removing"], "removing"),
    (["removing", "failed", "pending"], "failed"),
    (["removed"], "removed"),
])
def test_the_overall_state_is_the_most_severe(states: list[str], expected: str) -> None:
    assert overall_state(states) == expected


def test_bad_states_and_empty_deployments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown component state 'running'"):
        overall_state(["installed", "running"])
    with pytest.raises(ValueError, match="at least one component"):
        overall_state([])
    with pytest.raises(ValueError, match="unknown API generation"):
        body("rc.4", [("a", "installed", None)])
    with pytest.raises(ValueError, match="adopted manifestVersion"):
        body("rc.3", [("a", "installed", None)], adopted_version=None)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_bodies_validate_for_their_generation(generation: str) -> None:
    components = [("database", "installed", None),
                  ("orchestrator", "failed", ("INSTALL_FAILED", "image pull back-off")),
                  ("ui", "pending", ("WAITING", "waits for orchestrator"))]
    doc = body(generation, components)
    model = validate_value(doc, expect=Kind.DEPLOYMENT_STATUS)
    assert model.shape == Shape(generation)
    assert [c.name for c in model.components] == ["database", "orchestrator", "ui"]
    if generation in ("rc.3", "rc.2"):
        assert_matches_openapi(generation, "DeploymentStatusManifest", doc)
    failed = "Failed" if generation == "oct-2024" else "failed"
    assert doc["status"] == {"state": failed, "error": {
        "code": "INSTALL_FAILED", "source": "orchestrator", "message": "image pull back-off"}}
    assert doc["components"][1]["error"]["source"] == "orchestrator"  # the component's name
    assert doc["components"][2]["error"] == {"code": "WAITING", "source": "ui",
                                             "message": "waits for orchestrator"}
    assert "error" not in doc["components"][0]


def test_generation_specific_fields() -> None:
    components = [("web", "installed", None)]
    rc3 = body("rc.3", components)
    assert rc3["adoptedManifestVersion"] == 12
    assert "apiVersion" not in rc3 and "kind" not in rc3
    rc2 = body("rc.2", components)
    assert (rc2["apiVersion"], rc2["kind"]) == ("deployment.margo.org/v1alpha1",
                                                "DeploymentStatusManifest")
    assert "adoptedManifestVersion" not in rc2
    old = body("oct-2024", [("web", "installing", None), ("db", "removed", None)])
    assert old["status"] == {"state": "Installing"}
    assert [c["state"] for c in old["components"]] == ["Installing", "Removed"]
    no_device = body("rc.3", components, device_id=None)
    assert "deviceId" not in no_device
    validate_value(no_device, expect=Kind.DEPLOYMENT_STATUS)


def test_an_invalid_body_is_caught_by_the_schema() -> None:
    """The validation the tests rely on can fail: a status with a bad deviceId does."""
    doc = body("rc.3", [("web", "installed", None)], device_id="not a valid id")
    with pytest.raises(ValueError, match="deviceId"):
        validate_value(doc, expect=Kind.DEPLOYMENT_STATUS)


def test_errors_as_pairs_or_dicts_and_numeric_codes() -> None:
    doc = body("rc.3", [("web", "failed", (103, "autonomous placement not supported"))])
    assert doc["status"]["error"]["code"] == "103"
    as_dict = body("rc.3", [("web", "failed", {"code": 103,
                                               "message": "autonomous placement not supported"})])
    assert as_dict == doc
    assert_matches_openapi("rc.3", "DeploymentStatusManifest", doc)


def test_status_paths() -> None:
    common = {"deployment_id": DEPLOYMENT_ID, "device_id": "gw-1/child 2", "client_id": "site a"}
    assert status_path("rc.3", **common) == f"/api/v1/deployments/{DEPLOYMENT_ID}/status"
    assert status_path("rc.2", **common) == (
        f"/api/v1/clients/site%20a/deployments/{DEPLOYMENT_ID}/status")
    assert status_path("oct-2024", **common) == (
        f"/device/gw-1/child%202/deployment/{DEPLOYMENT_ID}/status")
    assert status_path("rc.3", deployment_id="a/b", device_id=None, client_id=None) == (
        "/api/v1/deployments/a%2Fb/status")
    with pytest.raises(ValueError, match="clientId"):
        status_path("rc.2", deployment_id=DEPLOYMENT_ID, device_id=None, client_id=None)
    with pytest.raises(ValueError, match="device id"):
        status_path("oct-2024", deployment_id=DEPLOYMENT_ID, device_id=None, client_id="c")
    with pytest.raises(ValueError, match="unknown API generation"):
        status_path("v2", **common)
