"""`margo serve` taking the cluster proposal's ClusterCapabilitiesManifest on the rc.3 and
rc.2 capabilities endpoints: validated, converted, stored and compiled like a device."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.serverkit import add_client, check_response, running_server

from margo.cluster import device_capabilities_from_cluster
from tools.polling import poll_until

APP = "com-example-vision"
GPU_NODE = {"x-margo-gitops-extensions": {"cluster": {"nodes": [
    {"capacity": {"cpu": 2, "resources": {"nvidia.com/gpu": 1}}}]}}}
ADMIN = {"Authorization": "Bearer operator-token"}


def write_source(root: Path) -> Path:
    """A fleet source: a Helm application needing one GPU node, deployed everywhere."""
    source = root / "fleet"
    (source / "apps" / APP).mkdir(parents=True)
    (source / "deployments").mkdir()
    description = {
        "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription", "id": APP,
        "metadata": {"name": "Vision", "version": "1.0.0",
                     "catalog": {"organization": [{"name": "Example"}]}},
        "deploymentProfiles": [{"type": "helm", "id": f"{APP}-helm", "deviceConstraints": GPU_NODE,
                                "components": [{"name": "vision", "properties": {
                                    "repository": "oci://registry.example.com/charts/vision",
                                    "revision": "1.0.0"}}]}]}
    (source / "apps" / APP / "margo.yaml").write_text(yaml.safe_dump(description))
    intent = {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
              "metadata": {"name": "vision"}, "spec": {"application": {"id": APP}}}
    (source / "deployments" / "vision.yaml").write_text(yaml.safe_dump(intent))
    return source


def node(name: str, gpus: int = 0) -> dict[str, Any]:
    available: dict[str, Any] = {"cpu": 4, "memory": "8Gi", "ephemeralStorage": "40Gi"}
    if gpus:
        available["nvidia.com/gpu"] = gpus
    return {"name": name, "roles": ["worker"], "controlPlane": False, "ready": True,
            "schedulable": True, "architecture": "amd64", "allocatable": dict(available),
            "available": available,
            "gpus": [{"resource": "nvidia.com/gpu", "count": gpus, "manufacturer": "NVIDIA",
                      "model": "NVIDIA-L4"}] if gpus else []}


def manifest(cluster_id: str, *nodes: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "cluster.margo.org/v1alpha1", "kind": "ClusterCapabilitiesManifest",
        "metadata": {"id": cluster_id, "name": f"Cluster {cluster_id}",
                     "kubernetesVersion": "1.31.2", "platform": "rke2"},
        "apiSurface": {"apiGroups": [{"name": "", "versions": ["v1"]},
                                     {"name": "apps", "versions": ["v1"]}]},
        "resources": {"allocatable": {"cpu": "8", "memory": "16Gi"}, "nodeCount": len(nodes),
                      "nodes": list(nodes)},
        "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True},
        "labels": {"example.com/site": "plant-a"},
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("clusters")
    source = write_source(root)
    data = root / "data"
    tokens = {name: add_client(data, name) for name in ("site-a", "site-b")}
    (root / "admin").write_text("operator-token")
    with running_server(data, "--source", str(source), "--admin-token-file",
                        str(root / "admin")) as base:
        yield {"base": base, "tokens": tokens}


def client(server: dict[str, Any], name: str) -> httpx.Client:
    return httpx.Client(base_url=server["base"], timeout=10,
                        headers={"Authorization": f"Bearer {server['tokens'][name]}"},
                        event_hooks={"response": [check_response]})


def fleet_device(server: dict[str, Any], device_id: str,
                 ready: Any = lambda body: True) -> dict[str, Any]:
    """The read API's view of a device, once `ready` holds (compiles run in the background)."""
    deadline = time.monotonic() + 20
    while True:
        body: dict[str, Any] = httpx.get(f"{server['base']}/api/fleet/devices/{device_id}",
                                         headers=ADMIN, timeout=10).json()
        if ready(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def has_history(body: dict[str, Any]) -> bool:
    return bool(body.get("history"))


def test_rc3_put_stores_a_cluster_like_a_device_and_compiles_for_it(
        server: dict[str, Any]) -> None:
    body = manifest("plant-a", node("worker-1"), node("gpu-1", gpus=1))
    with client(server, "site-a") as http:
        assert http.put("/api/v1/capabilities/plant-a", json=body).status_code == 201
        assert http.put("/api/v1/capabilities/plant-a", json=body).status_code == 200
        poll_until("a deployment compiled for the cluster",
                   lambda: http.get("/api/v1/deployments").json()["deployments"], timeout=20,
                   interval=0.2)
        [ref] = http.get("/api/v1/deployments").json()["deployments"]
        deployment = yaml.safe_load(http.get(ref["url"]).content)
    assert deployment["metadata"]["deviceId"] == "plant-a"
    assert deployment["spec"]["deploymentProfile"]["deviceConstraints"] == GPU_NODE
    detail = fleet_device(server, "plant-a")
    # Stored and shown exactly as the rc.3 document the device client would have sent.
    assert detail["capabilities"] == device_capabilities_from_cluster(body)
    assert detail["vendor"] == "unknown" and detail["shape"] == "rc.3"
    assert detail["labels"]["k8s.margo-gitops.dev/gpus"] == 1
    assert detail["labels"]["example.com/site"] == "plant-a"
    assert [(e["intent"], e["status"]) for e in detail["eligibility"]] == [("vision", "eligible")]


def test_a_cluster_without_a_gpu_node_is_stored_but_not_eligible(server: dict[str, Any]) -> None:
    body = manifest("plant-b", node("worker-1"))
    del body["apiVersion"], body["kind"]  # recognised by apiSurface + kubernetesVersion
    with client(server, "site-b") as http:
        assert http.put("/api/v1/capabilities/plant-b", json=body).status_code == 201
    detail = fleet_device(server, "plant-b", has_history)
    [vision] = detail["eligibility"]
    assert vision["status"] == "not eligible"
    assert [f["message"] for a in vision["attempts"] for f in a["failures"]] == [
        "needs 1 node with >= 2 cores and 1 nvidia.com/gpu available; no node qualifies; "
        "worker-1 has no nvidia.com/gpu available"]
    assert detail["deployments"] == []


def test_rc2_routes_accept_a_cluster_manifest(server: dict[str, Any]) -> None:
    with client(server, "site-b") as http:
        path = "/api/v1/clients/site-b/capabilities"
        by_path = http.put(f"{path}/plant-c", json=manifest("plant-c", node("gpu", gpus=2)))
        assert by_path.status_code == 201
        by_body = http.post(path, json=manifest("plant-d", node("gpu", gpus=1)))
        assert by_body.status_code == 201
        nameless = manifest("plant-e", node("gpu"))
        del nameless["metadata"]["id"]
        response = http.post(path, json=nameless)
        assert response.status_code == 400
        assert response.json()["detail"] == "metadata.id is required"
    for device_id in ("plant-c", "plant-d"):
        detail = fleet_device(server, device_id, lambda b: b.get("deployments"))
        assert [d["intent"] for d in detail["deployments"]] == ["vision"]
        assert detail["capabilities"]["x-margo-gitops-extensions"]["cluster"]["metadata"][
            "id"] == device_id


def test_an_invalid_manifest_is_refused_with_every_problem(server: dict[str, Any]) -> None:
    body = manifest("plant-x", node("worker-1"))
    body["metadata"]["kubernetesVersion"] = ""
    body["capabilities"]["otelCollector"] = "yes"
    with client(server, "site-a") as http:
        response = http.put("/api/v1/capabilities/plant-x", json=body)
        assert response.status_code == 422
        problem = response.json()
        assert problem["type"].endswith("#semantic-error")
        fields = sorted(e["field"] for e in problem["errors"])
        assert fields == ["$.capabilities.otelCollector", "$.metadata.kubernetesVersion"]
        body = manifest("plant-x", node("worker-1"))
        body["resources"]["allocatable"]["memory"] = "lots"
        del body["apiSurface"]
        problem = http.put("/api/v1/capabilities/plant-x", json=body).json()
        assert sorted(e["field"] for e in problem["errors"]) == [
            "$.apiSurface", "$.resources.allocatable.memory"]
    missing = httpx.get(f"{server['base']}/api/fleet/devices/plant-x", headers=ADMIN)
    assert missing.status_code == 404  # nothing was stored


def test_the_cluster_id_must_be_the_device_id_of_the_path(server: dict[str, Any]) -> None:
    with client(server, "site-a") as http:
        response = http.put("/api/v1/capabilities/plant-y", json=manifest("plant-z"))
        assert response.status_code == 422
        problem = response.json()
        assert problem["errors"] == [{"field": "metadata.id",
                                      "message": "must equal the deviceId in the path"}]
        assert "'plant-z' does not match the deviceId 'plant-y'" in problem["detail"]
        owned = manifest("plant-g", node("worker-1"))
        assert http.put("/api/v1/capabilities/plant-g", json=owned).status_code == 201
    with client(server, "site-b") as http:  # another client may never report for it
        taken = http.put("/api/v1/capabilities/plant-g", json=copy.deepcopy(owned))
        assert taken.status_code == 403


def test_both_bodies_of_one_cluster_are_one_stored_document(server: dict[str, Any]) -> None:
    body = manifest("plant-f", node("gpu-1", gpus=1))
    with client(server, "site-a") as http:
        assert http.put("/api/v1/capabilities/plant-f", json=body).status_code == 201
        converted = device_capabilities_from_cluster(body)
        # The same facts as an rc.3 document: an update of nothing (200, same digest).
        assert http.put("/api/v1/capabilities/plant-f", json=converted).status_code == 200
    detail = fleet_device(server, "plant-f", lambda b: b.get("deployments"))
    assert detail["capabilities"] == converted
    assert [d["intent"] for d in detail["deployments"]] == ["vision"]
