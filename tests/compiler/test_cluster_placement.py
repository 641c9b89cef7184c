"""Placement on Kubernetes clusters through the real compiler: node-aware requirements, the
matching view in selectors, the draft form, and `margo explain` saying why not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.explain import explain_device
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from margo.cluster import cluster_manifest_from_capabilities, device_capabilities_from_cluster
from margo.constraints import DEVICE_CHARACTERISTIC, EXTENSION

ROOT = Path(__file__).resolve().parents[2]
APP = "com-example-vision"
GPU_NODE = {EXTENSION: {"cluster": {"nodes": [{"capacity": {
    "cpu": 2, "memory": "4Gi", "resources": {"nvidia.com/gpu": 1}}}],
    "kubernetesVersion": ">=1.28 <1.33"}}}
NO_GPU = ("needs 1 node with >= 2 cores and 4Gi memory and 1 nvidia.com/gpu available; "
          "no node qualifies; cp-1 is not schedulable, has no nvidia.com/gpu available; "
          "worker-1 has no nvidia.com/gpu available")


def vision_app(constraints: dict[str, Any]) -> dict[str, Any]:
    """A Helm-only application (so clusters are the only candidates) with one parameter."""
    return app(APP, constraints=constraints, compose=False, parameters={"greeting": {
        "value": "hello", "targets": [{"pointer": "config.greeting", "components": ["web"]}]}})


def node(name: str, *, gpus: int = 0, cpu: float = 4, memory: str = "8Gi",
         control_plane: bool = False) -> dict[str, Any]:
    available: dict[str, Any] = {"cpu": cpu, "memory": memory, "ephemeralStorage": "40Gi"}
    if gpus:
        available["nvidia.com/gpu"] = gpus
    return {"name": name, "roles": ["control-plane" if control_plane else "worker"],
            "controlPlane": control_plane, "ready": True, "schedulable": not control_plane,
            "architecture": "amd64", "os": "linux", "kubeletVersion": "v1.31.2",
            "containerRuntime": "containerd://1.7.22", "allocatable": dict(available),
            "requested": {"cpu": 0}, "available": available,
            "gpus": [{"resource": "nvidia.com/gpu", "count": gpus, "manufacturer": "NVIDIA",
                      "model": "NVIDIA-L4"}] if gpus else [],
            "taints": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]
            if control_plane else []}


def cluster_device(cluster_id: str, *workers: dict[str, Any],
                   version: str = "1.31.2+k3s1") -> dict[str, Any]:
    """The rc.3 document a cluster reports (margo.cluster's conversion of its manifest)."""
    nodes = [node("cp-1", control_plane=True), *workers]
    manifest = {
        "apiVersion": "cluster.margo.org/v1alpha1", "kind": "ClusterCapabilitiesManifest",
        "metadata": {"id": cluster_id, "kubernetesVersion": version, "platform": "k3s"},
        "apiSurface": {"apiGroups": [{"name": "", "versions": ["v1"]},
                                     {"name": "apps", "versions": ["v1"]}],
                       "customResourceDefinitions": []},
        "resources": {"allocatable": {"cpu": "16", "memory": "32Gi"}, "nodeCount": len(nodes),
                      "nodes": nodes},
        "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True,
                         "storageClasses": [{"name": "longhorn",
                                             "provisioner": "driver.longhorn.io",
                                             "isDefault": True}]},
        "labels": {"example.com/site": "plant"},
    }
    return device_capabilities_from_cluster(manifest)


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    f = Fleet(tmp_path)
    f.apps[APP] = vision_app(GPU_NODE)
    f.intents["vision"] = intent("vision", APP)
    f.devices["plant-a"] = cluster_device("plant-a", node("worker-1"))
    f.devices["plant-b"] = cluster_device("plant-b", node("worker-1"), node("gpu-1", gpus=1))
    f.devices["edge-box"] = device("edge-box", gpu=True)  # a GPU, but no cluster report
    return f


def explanation(fleet: Fleet, device_id: str) -> Any:
    fleet.write()
    [found] = explain_device(load_source(fleet.source), load_snapshot(fleet.caps), device_id,
                             intent_name="vision")
    return found


def test_only_the_cluster_with_a_gpu_node_gets_the_deployment(fleet: Fleet) -> None:
    report = fleet.compile()
    assert not report.errors
    assert fleet.tree("plant-a") == {} and fleet.tree("edge-box") == {}
    deployment = fleet.deployment("plant-b", "vision")
    # deviceConstraints, extension included, reach the device verbatim.
    assert deployment["spec"]["deploymentProfile"]["deviceConstraints"] == GPU_NODE
    explained = explanation(fleet, "plant-a")
    assert explained.status == "not eligible"
    assert explained.lines()[1:] == [f"  - profile {APP}-helm: {NO_GPU}"]
    [failure] = explained.attempts[0].failures
    assert (failure.stage, failure.key) == ("cluster", "cluster.nodes[0]")
    plain = explanation(fleet, "edge-box")
    assert [f.message for f in plain.attempts[0].failures] == [
        "needs 1 node with >= 2 cores and 4Gi memory and 1 nvidia.com/gpu available, but the "
        "device reported no Kubernetes cluster data",
        "needs Kubernetes >=1.28 <1.33, but the device reported no Kubernetes cluster data"]
    assert explanation(fleet, "plant-b").status == "eligible"


def test_margo_explain_says_why_a_cluster_is_not_eligible(fleet: Fleet) -> None:
    fleet.write()
    result = subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "explain", "--source", str(fleet.source),
         "--capabilities", str(fleet.caps), "--device", "plant-a"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "device plant-a:", f"  vision: not eligible (application {APP} 1.0.0)",
        f"    - profile {APP}-helm: {NO_GPU}"]


def test_a_gpu_node_joining_and_leaving_moves_the_deployment(fleet: Fleet) -> None:
    fleet.intents["vision"]["spec"]["gracePeriod"] = "10m"
    fleet.compile(now=1_000_000)
    fleet.devices["plant-a"] = cluster_device("plant-a", node("worker-1"), node("gpu-1", gpus=1))
    report = fleet.compile(now=1_000_100)
    assert [(r.device_id, [(c.action, c.reasons) for c in r.changes]) for r in report.results] \
        == [("plant-a", [("add", ("device became eligible",))])]
    # The GPU is taken by another workload: the node is still there, nothing is available.
    fleet.devices["plant-a"] = cluster_device("plant-a", node("worker-1"), node("gpu-1"))
    report = fleet.compile(now=1_000_200)
    assert "vision.yaml" in fleet.tree("plant-a")  # kept for the grace period
    assert "kept for the grace period, 600s left" in report.results[0].notes[0]
    report = fleet.compile(now=1_000_900)
    [change] = report.results[0].changes
    assert change.action == "remove" and fleet.tree("plant-a") == {}
    assert "gpu-1 has no nvidia.com/gpu available" in change.reasons[0]
    assert "grace period of 600s expired" in change.reasons[0]


def test_a_kubernetes_upgrade_out_of_range_removes_the_deployment(fleet: Fleet) -> None:
    fleet.compile()
    fleet.devices["plant-b"] = cluster_device("plant-b", node("gpu-1", gpus=1),
                                              version="v1.33.0")
    report = fleet.compile(now=2_000_000)
    [change] = report.results[0].changes
    assert change.action == "remove"
    assert "needs Kubernetes >=1.28 <1.33, but the cluster runs v1.33.0" in change.reasons[0]


def test_the_first_profile_the_cluster_satisfies_wins(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    description = vision_app(GPU_NODE)
    cpu_profile = {**description["deploymentProfiles"][0], "id": f"{APP}-cpu"}
    del cpu_profile["deviceConstraints"]
    description["deploymentProfiles"].append(cpu_profile)
    fleet.apps[APP] = description
    fleet.intents["vision"] = intent("vision", APP)
    fleet.devices["plant-a"] = cluster_device("plant-a", node("worker-1"))
    fleet.devices["plant-b"] = cluster_device("plant-b", node("gpu-1", gpus=1))
    fleet.compile()
    assert fleet.deployment("plant-a", "vision")["spec"]["deploymentProfile"].get(
        "deviceConstraints") is None
    assert fleet.deployment("plant-b", "vision")["spec"]["deploymentProfile"][
        "deviceConstraints"] == GPU_NODE
    explained = explanation(fleet, "plant-a")
    assert (explained.status, explained.profile) == ("eligible", f"{APP}-cpu")
    assert [f.message for a in explained.attempts for f in a.failures] == [NO_GPU]


def test_selectors_and_intent_constraints_reach_cluster_sections_and_labels(
        fleet: Fleet) -> None:
    fleet.devices["plant-c"] = cluster_device("plant-c", node("gpu-1", gpus=2))
    fleet.intents["vision"]["spec"].update({
        "targets": {"selectors": [{
            "propertySelector": {"matchExpressions": [
                {"key": "/capabilities/storageClasses", "operator": "ContainsAny",
                 "itemSelector": {"matchExpressions": [
                     {"key": "/provisioner", "operator": "In", "values": ["driver.longhorn.io"]}
                 ]}}]},
            "labelSelector": {"matchExpressions": [
                {"key": "k8s.margo-gitops.dev/gpus", "operator": "Gt", "values": [1]}]}}]},
        "constraints": {EXTENSION: {"cluster": {"nodes": [{"selector": {"matchExpressions": [
            {"key": "/available/nvidia.com~1gpu", "operator": "GtEq", "values": [2]}]}}]}}}})
    fleet.compile()
    assert {d for d in fleet.store.device_ids() if fleet.tree(d)} == {"plant-c"}
    explained = explanation(fleet, "plant-b")
    assert explained.status == "not targeted"
    assert [f.message for f in explained.targeting] == [
        "selector rule 0: label 'k8s.margo-gitops.dev/gpus' Gt 1 but the device has 1"]
    fleet.intents["vision"]["spec"]["targets"] = {"devices": ["plant-b"]}
    fleet.compile(now=2_000_000)
    explained = explanation(fleet, "plant-b")
    assert [(f.stage, f.message) for a in explained.attempts for f in a.failures] == [(
        "intent cluster",
        "needs 1 node matching /available/nvidia.com~1gpu GtEq 2; no node qualifies; cp-1 is "
        "not schedulable, fails /available/nvidia.com~1gpu GtEq 2 (has nothing there); "
        "worker-1 fails /available/nvidia.com~1gpu GtEq 2 (has nothing there); "
        "gpu-1 fails /available/nvidia.com~1gpu GtEq 2 (has 1)")]


def test_the_draft_form_places_through_the_same_engine(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.apps[APP] = vision_app({EXTENSION: {"deviceCharacteristics": [
        {"matchExpressions": [
            {"key": DEVICE_CHARACTERISTIC, "property": "/resources/nodes",
             "operator": "ContainsAny", "itemSelector": {"matchExpressions": [
                 {"key": "/available/cpu", "operator": "GtEq", "values": [8]}]}},
            {"key": "example.com/site", "operator": "In", "values": ["plant"]}]}]}})
    fleet.intents["vision"] = intent("vision", APP)
    fleet.devices["big"] = cluster_device("big", node("w", cpu=8))
    fleet.devices["small"] = cluster_device("small", node("w", cpu=7.5))
    fleet.compile()
    assert fleet.tree("small") == {} and "vision.yaml" in fleet.tree("big")
    [failure] = explanation(fleet, "small").attempts[0].failures
    assert failure.stage == "characteristics"
    assert failure.message.startswith(
        "deviceCharacteristics 0 (draft): characteristic 'margo-gitops.dev/capabilities' "
        "/resources/nodes ContainsAny [/available/cpu GtEq 8] but no element of ")


def test_a_cluster_manifest_file_compiles_like_its_rc3_document(fleet: Fleet) -> None:
    converted = fleet.devices["plant-b"]
    manifest = cluster_manifest_from_capabilities(converted)
    fleet.devices["plant-b"] = manifest
    fleet.write()
    snapshot = load_snapshot(fleet.caps)
    assert snapshot.devices["plant-b"].capabilities.properties == converted["properties"]
    fleet.compile()
    assert fleet.deployment("plant-b", "vision")["metadata"]["deviceId"] == "plant-b"
    fleet.devices["plant-b"] = converted  # the other body of the same facts: nothing changes
    report = fleet.compile(now=2_000_000)
    assert report.commits == 0 and report.unchanged == 3


def test_a_broken_cluster_manifest_file_is_a_located_problem(fleet: Fleet) -> None:
    manifest = cluster_manifest_from_capabilities(fleet.devices["plant-b"])
    manifest["resources"]["nodes"][0]["available"]["cpu"] = "lots"
    fleet.devices["plant-b"] = manifest
    fleet.write()
    snapshot = load_snapshot(fleet.caps)
    assert "plant-b" not in snapshot.devices and snapshot.broken == {"plant-b"}
    [problem] = snapshot.problems
    assert problem.path == ("resources", "nodes", 0, "available", "cpu")
    assert problem.file is not None and problem.file.endswith("plant-b.json")
    assert problem.line is not None
