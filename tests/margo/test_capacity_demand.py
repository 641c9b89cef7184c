"""What a placement takes (`margo.constraints.demand_of`) and what a cluster report already
counts (`margo.cluster_workloads`)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from margo.cluster import device_capabilities_from_cluster, validate_cluster_manifest
from margo.cluster_workloads import usage_of, with_workload_released, workload_requests
from margo.constraints import Usage, compile_constraints, demand_of, matching_view
from margo.errors import DocumentError
from margo.quantity import parse_quantity


def gpu_rule(*items: dict[str, Any], operator: str = "ContainsAll") -> dict[str, Any]:
    return {"propertySelector": {"matchExpressions": [
        {"key": "/peripherals", "operator": operator,
         "itemSelector": {"matchExpressions": list(items)}}]}}


GPU = {"key": "/type", "operator": "In", "values": ["gpu"]}
NVIDIA = {"key": "/manufacturer", "operator": "In", "values": ["NVIDIA"]}


def test_capacity_requirements_become_amounts() -> None:
    compiled = compile_constraints({"capacityRequirements": {
        "cpu": {"cores": 1.5, "architectures": ["x86_64"]}, "memory": "1Gi",
        "storage": "10Gi"}})
    demand = demand_of(compiled)
    assert (demand.cores, demand.architectures, demand.memory, demand.storage, demand.gpus) == (
        Decimal("1.5"), frozenset({"amd64"}), parse_quantity("1Gi"), parse_quantity("10Gi"),
        ())
    assert demand_of(compile_constraints({})).empty


def test_legacy_gpu_peripherals_each_claim_one() -> None:
    compiled = compile_constraints(None, required_resources={"peripherals": [
        {"type": "gpu", "manufacturer": "NVIDIA"}, {"type": "gpu"}, {"type": "camera"}]})
    claims = demand_of(compiled).gpus
    assert [c.text for c in claims] == ["a GPU with manufacturer 'NVIDIA'", "a GPU"]
    assert claims[0].matches({"type": "gpu", "manufacturer": "NVIDIA"})
    assert not claims[0].matches({"type": "gpu", "manufacturer": "AMD"})


def test_the_first_rule_the_device_satisfies_decides_the_gpu() -> None:
    compiled = compile_constraints({"eligibilityRules": [
        gpu_rule(GPU, NVIDIA), {"labelSelector": {"matchExpressions": [
            {"key": "cpu-only", "operator": "Exists"}]}}]})
    with_gpu = {"peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}]}
    assert [c.text for c in demand_of(compiled, with_gpu, {}).gpus] == [
        "a GPU with /manufacturer In ['NVIDIA']"]
    # The second alternative holds instead: no GPU is taken.
    assert demand_of(compiled, {"peripherals": []}, {"cpu-only": "yes"}).gpus == ()


@pytest.mark.parametrize(("rule", "claims"), [
    (gpu_rule(GPU, operator="ContainsAny"), 1),
    (gpu_rule(GPU, NVIDIA, operator="ContainsAny"), 0),  # "a GPU or anything NVIDIA"
    (gpu_rule({"key": "/type", "operator": "In", "values": ["camera"]}), 0),
])
def test_which_expressions_claim_a_gpu(rule: dict[str, Any], claims: int) -> None:
    compiled = compile_constraints({"eligibilityRules": [rule]})
    view = {"peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}, {"type": "camera"}]}
    assert len(demand_of(compiled, view, {}).gpus) == claims


def test_what_the_report_shows_is_not_demanded_again() -> None:
    demand = demand_of(compile_constraints({"capacityRequirements": {
        "cpu": {"cores": 1}, "memory": "512Mi"}}))
    partly = demand.minus(Usage(cores=Decimal("0.25"), memory=parse_quantity("1Gi")))
    assert (partly.cores, partly.memory) == (Decimal("0.75"), Decimal(0))


def node(name: str, cpu: float, available_cpu: float, *,
         workloads: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name, "ready": True, "schedulable": True, "architecture": "amd64",
        "allocatable": {"cpu": cpu, "memory": "4Gi"},
        "requested": {"cpu": cpu - available_cpu, "memory": "1Gi"},
        "available": {"cpu": available_cpu, "memory": "3Gi"}, "gpus": [], "taints": []}
    if workloads is not None:
        entry["workloads"] = workloads
    return entry


def body(*nodes: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"id": "k8s", "kubernetesVersion": "1.36.3"},
            "apiSurface": {"apiGroups": []},
            "resources": {"allocatable": {"cpu": "4", "memory": "8Gi"}, "nodeCount": 2,
                          "nodes": list(nodes)},
            "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True}}


MINE = {"deployment": "dep-1", "pods": 1, "requested": {"cpu": 1, "memory": "1Gi"}}


def test_workloads_are_read_per_deployment_and_node() -> None:
    attributed = body(node("a", 2, 1, workloads=[MINE]), node("b", 2, 2, workloads=[]))
    requests = workload_requests(attributed)
    assert requests == {"dep-1": {"a": {"cpu": 1, "memory": "1Gi"}}}
    assert usage_of(requests["dep-1"]) == Usage(Decimal(1), parse_quantity("1Gi"))
    # One node that does not say: the report says nothing about ownership.
    assert workload_requests(body(node("a", 2, 1, workloads=[MINE]), node("b", 2, 2))) is None


def test_a_deployment_sees_the_report_without_its_own_pods() -> None:
    doc = device_capabilities_from_cluster(body(node("a", 2, 1, workloads=[MINE]),
                                                node("b", 2, 0, workloads=[])))
    assert doc["properties"]["cpus"] == [{"cores": 1, "architecture": "amd64"}]
    view = matching_view(doc["properties"], {"x-margo-gitops-extensions":
                                             doc["x-margo-gitops-extensions"]})
    cluster = doc["x-margo-gitops-extensions"]["cluster"]
    released = with_workload_released(view, cluster, workload_requests(cluster)["dep-1"])
    assert released["cpus"] == [{"cores": 2, "architecture": "amd64"}]
    assert parse_quantity(released["memory"]) == parse_quantity("7Gi")
    assert [n["available"]["cpu"] for n in released["resources"]["nodes"]] == [2, 0]
    assert view["cpus"] == [{"cores": 1, "architecture": "amd64"}]  # (a copy was changed)


def test_bad_workload_and_gpu_entries_are_located() -> None:
    manifest = {"apiVersion": "cluster.margo.org/v1alpha1",
                "kind": "ClusterCapabilitiesManifest",
                **body(node("a", 2, 1, workloads=[{"deployment": "dep-1", "pods": -1,
                                                   "requested": {}}]))}
    manifest["resources"]["gpus"] = [{"node": "a", "resource": "nvidia.com/gpu"}]
    paths = {p.path for p in validate_cluster_manifest(manifest)}
    assert paths == {("resources", "nodes", 0, "workloads", 0, "pods"),
                     ("resources", "gpus", 0)}
    with pytest.raises(DocumentError):
        device_capabilities_from_cluster(manifest)
