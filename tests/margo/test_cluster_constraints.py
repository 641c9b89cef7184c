"""Node-aware cluster requirements, the matching view and the schema-agnostic draft form:
every clause passing and failing with its explanation, compile errors located, GtEq/LtEq."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from margo import cluster as cluster_module
from margo.constraints import (
    CLUSTER_SECTIONS,
    DEVICE_CHARACTERISTIC,
    EXTENSION,
    CompiledConstraints,
    MatchResult,
    compile_constraints,
    matching_view,
    parse_version_range,
)
from margo.errors import DocumentError
from margo.kinds import Kind
from margo.validation import validate_value

SCHEMAS = Path(__file__).resolve().parents[2] / "margo" / "schemas"
NO_CLUSTER = "the device reported no Kubernetes cluster data"


def node(name: str, cpu: float | str = 4, memory: str = "8Gi", *, gpus: int = 0,
         arch: str = "amd64", ready: bool = True, schedulable: bool = True,
         control_plane: bool = False, **extra: Any) -> dict[str, Any]:
    """One node object as contract A describes it (available = allocatable - requested)."""
    available: dict[str, Any] = {"cpu": cpu, "memory": memory, "ephemeralStorage": "40Gi"}
    if gpus:
        available["nvidia.com/gpu"] = gpus
    doc: dict[str, Any] = {
        "name": name, "roles": ["control-plane"] if control_plane else ["worker"],
        "controlPlane": control_plane, "ready": ready, "schedulable": schedulable,
        "architecture": arch, "os": "linux", "kubeletVersion": "v1.31.2",
        "containerRuntime": "containerd://1.7.22",
        "allocatable": dict(available), "requested": {"cpu": 0}, "available": available,
        "gpus": [{"resource": "nvidia.com/gpu", "count": gpus, "manufacturer": "NVIDIA",
                  "model": "NVIDIA-A2"}] if gpus else [],
        "taints": [], "labels": {}}
    doc.update(extra)
    return doc


def cluster(nodes: list[dict[str, Any]] | None = None, **overrides: Any) -> dict[str, Any]:
    """A cluster body (the extension's `cluster` object); override or drop (None) sections."""
    body: dict[str, Any] = {
        "metadata": {"id": "plant-a", "kubernetesVersion": "1.31.2+k3s1", "platform": "k3s"},
        "apiSurface": {
            "apiGroups": [{"name": "", "versions": ["v1"]},
                          {"name": "apps", "versions": ["v1"]},
                          {"name": "networking.k8s.io", "versions": ["v1"]},
                          {"name": "monitoring.coreos.com", "versions": ["v1", "v1alpha1"]}],
            "customResourceDefinitions": [
                {"group": "monitoring.coreos.com", "kind": "ServiceMonitor", "versions": ["v1"]},
                {"group": "monitoring.coreos.com", "kind": "PodMonitor", "versions": ["v1"]},
                {"group": "networking.istio.io", "kind": "Gateway", "versions": ["v1"]},
                {"group": "example.com", "kind": "Policy", "versions": ["v1"]}]},
        "resources": {"allocatable": {"cpu": "8", "memory": "16Gi"},
                      "nodeCount": 1 if nodes is None else len(nodes),
                      "nodes": [node("worker-1")] if nodes is None else nodes},
        "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True,
                         "storageClasses": [
                             {"name": "local-path", "provisioner": "rancher.io/local-path",
                              "isDefault": True},
                             {"name": "longhorn", "provisioner": "driver.longhorn.io",
                              "isDefault": False}]},
    }
    for key, value in overrides.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def view_of(body: dict[str, Any] | None, **properties: Any) -> Any:
    props = {"id": "plant-a", "cpus": [{"cores": 4, "architecture": "amd64"}], **properties}
    return matching_view(props, None if body is None else {EXTENSION: {"cluster": body}})


def needs(**requirements: Any) -> dict[str, Any]:
    return {EXTENSION: {"cluster": requirements}}


def evaluate(constraints: dict[str, Any], view: Any,
             labels: dict[str, Any] | None = None) -> MatchResult:
    compiled = compile_constraints(constraints)
    result = compiled.evaluate(view, labels or {})
    assert compiled.is_eligible(view, labels or {}) is result.eligible
    json.dumps(result.to_json())  # explanations are plain JSON
    return result


def messages(result: MatchResult) -> list[str]:
    return [f.message for f in result.failures]


def compile_problems(constraints: Any) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(DocumentError) as caught:
        compile_constraints(constraints, path=("deploymentProfiles", 0, "deviceConstraints"))
    return [(p.path[3:], p.message) for p in caught.value.problems]


# --------------------------------------------------------------------------- matching view


def test_matching_view_merges_extensions_and_cluster_sections_once() -> None:
    body = cluster()
    properties = {"id": "plant-a", "cpus": [{"cores": 4}]}
    extensions = {EXTENSION: {"cluster": body}, "x-acme-extensions": {"rack": 7}}
    view = matching_view(properties, extensions)
    assert view["cpus"] == [{"cores": 4}]
    assert view["x-acme-extensions"] == {"rack": 7}
    assert view[EXTENSION]["cluster"] is body
    assert all(view[section] is body[section] for section in CLUSTER_SECTIONS)
    assert matching_view(properties, {}) is properties  # no copy for plain devices
    assert matching_view(properties, None) is properties


def test_cluster_sections_cannot_collide_with_reported_properties() -> None:
    """rc.3/rc.2 `properties` are closed key sets; none is a cluster section or extension."""
    for shape in ("rc.3", "rc.2"):
        schema = json.loads((SCHEMAS / f"DeviceCapabilitiesManifest.{shape}.schema.json")
                            .read_text())
        names = set(schema["properties"]["properties"]["properties"])
        assert schema["properties"]["properties"]["additionalProperties"] is False
        assert not names & set(CLUSTER_SECTIONS)
        assert not any(name.startswith("x-") for name in names)
    assert cluster_module.CLUSTER_SECTIONS == CLUSTER_SECTIONS
    assert cluster_module.EXTENSION_KEY == EXTENSION


@pytest.mark.parametrize("pointer", [
    "/apiSurface/customResourceDefinitions",
    "/x-margo-gitops-extensions/cluster/apiSurface/customResourceDefinitions",
])
def test_proposal_style_pointers_resolve_in_the_view(pointer: str) -> None:
    """S1's example rule: pointers start at the cluster's sections, or at our extension."""
    rule = {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
        {"key": pointer, "operator": "ContainsAll", "itemSelector": {"matchExpressions": [
            {"key": "/group", "operator": "In", "values": ["monitoring.coreos.com"]}]}},
        {"key": "/capabilities/storageClasses", "operator": "ContainsAny", "itemSelector": {
            "matchExpressions": [
                {"key": "/provisioner", "operator": "In", "values": ["driver.longhorn.io"]}]}},
    ]}}]}
    assert evaluate(rule, view_of(cluster())).eligible
    without_crds = cluster(apiSurface={"apiGroups": []})
    result = evaluate(rule, view_of(without_crds))
    assert messages(result) == [f"rule 0: {pointer} ContainsAll [/group In "
                                "['monitoring.coreos.com']] but the device has no property "
                                f"{pointer}"]
    assert not evaluate(rule, {"id": "plain"}).eligible  # plain properties reach nothing


def test_root_extensions_of_any_vendor_are_reachable() -> None:
    rule = {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
        {"key": "/x-acme-extensions/rack", "operator": "Gt", "values": [5]}]}}]}
    view = matching_view({"id": "d"}, {"x-acme-extensions": {"rack": 7}})
    assert evaluate(rule, view).eligible
    view = matching_view({"id": "d"}, {"x-acme-extensions": {"rack": 3}})
    assert messages(evaluate(rule, view)) == [
        "rule 0: /x-acme-extensions/rack Gt 5 but the device has 3"]


def test_a_converted_cluster_manifest_is_matched_through_its_extension() -> None:
    """Contract B end to end: margo.cluster's rc.3 document, validated and normalised,
    gives the view the node requirements read."""
    manifest = {"apiVersion": "cluster.margo.org/v1alpha1", "kind": "ClusterCapabilitiesManifest",
                **cluster([node("gpu-1", 8, "30Gi", gpus=1), node("cpu-1", 2, "4Gi")])}
    document = cluster_module.device_capabilities_from_cluster(manifest)
    caps = validate_value(document, expect=Kind.DEVICE_CAPABILITIES)
    view = matching_view(caps.properties, caps.extensions)
    gpu_node = needs(nodes=[{"capacity": {"cpu": 4, "resources": {"nvidia.com/gpu": 1}}}],
                     kubernetesVersion=">=1.30")
    assert evaluate(gpu_node, view, dict(caps.labels)).eligible
    two_gpus = needs(nodes=[{"capacity": {"resources": {"nvidia.com/gpu": 2}}}])
    assert messages(evaluate(two_gpus, view)) == [
        "needs 1 node with >= 2 nvidia.com/gpu available; no node qualifies; "
        "gpu-1 has 1 nvidia.com/gpu available; cpu-1 has no nvidia.com/gpu available"]


# --------------------------------------------------------------------------- nodes


WORKERS = [node("cp-1", 3.8, "6Gi", schedulable=False, control_plane=True),
           node("worker-1", 2.5, "8Gi"), node("worker-2", 1.5, "8Gi"),
           node("worker-3", 4, "2Gi", ready=False)]


def test_node_count_and_capacity_explained_per_node() -> None:
    requirement = needs(nodes=[{"count": 2, "capacity": {"cpu": 2, "memory": "4Gi"}}])
    result = evaluate(requirement, view_of(cluster(WORKERS)))
    assert not result.eligible
    (failure,) = result.failures
    assert failure.message == (
        "needs 2 nodes with >= 2 cores and 4Gi memory available; 1 node qualifies (worker-1); "
        "cp-1 is not schedulable; worker-2 has 1.5 cores available; "
        "worker-3 is not Ready, has 2Gi memory available")
    assert (failure.stage, failure.key, failure.operator) == ("cluster", "cluster.nodes[0]", ">=")
    assert failure.required == {"count": 2, "capacity": {"cpu": 2, "memory": "4Gi"}}
    assert failure.actual == {"qualifying": ["worker-1"], "nodes": {
        "cp-1": ["is not schedulable"], "worker-2": ["has 1.5 cores available"],
        "worker-3": ["is not Ready", "has 2Gi memory available"]}}
    healthy = [*WORKERS, node("worker-4", 2, "4Gi")]  # exactly the required amounts
    assert evaluate(requirement, view_of(cluster(healthy))).eligible


def test_one_node_with_an_nvidia_gpu_by_capacity_or_by_selector() -> None:
    by_capacity = needs(nodes=[{"capacity": {"resources": {"nvidia.com/gpu": 1}}}])
    by_selector = needs(nodes=[{"selector": {"matchExpressions": [
        {"key": "/gpus", "operator": "ContainsAny", "itemSelector": {"matchExpressions": [
            {"key": "/manufacturer", "operator": "In", "values": ["NVIDIA"]}]}}]}}])
    cpu_only = view_of(cluster([node("worker-1"), node("worker-2")]))
    assert messages(evaluate(by_capacity, cpu_only)) == [
        "needs 1 node with >= 1 nvidia.com/gpu available; no node qualifies; "
        "worker-1 has no nvidia.com/gpu available; worker-2 has no nvidia.com/gpu available"]
    assert messages(evaluate(by_selector, cpu_only)) == [
        "needs 1 node matching /gpus ContainsAny [/manufacturer In ['NVIDIA']]; "
        "no node qualifies; worker-1 fails /gpus ContainsAny [/manufacturer In ['NVIDIA']] "
        "(has []); worker-2 fails /gpus ContainsAny [/manufacturer In ['NVIDIA']] (has [])"]
    with_gpu = view_of(cluster([node("worker-1"), node("gpu-1", gpus=1)]))
    assert evaluate(by_capacity, with_gpu).eligible
    assert evaluate(by_selector, with_gpu).eligible
    busy = node("gpu-1", gpus=1)
    busy["available"]["nvidia.com/gpu"] = 0  # allocatable, but requested by a running pod
    assert messages(evaluate(by_capacity, view_of(cluster([busy])))) == [
        "needs 1 node with >= 1 nvidia.com/gpu available; no node qualifies; "
        "gpu-1 has 0 nvidia.com/gpu available"]


def test_only_ready_schedulable_nodes_count_unless_the_selector_says_otherwise() -> None:
    nodes = [node("cp-1", 8, schedulable=False, control_plane=True),
             node("worker-1", 8, ready=False)]
    default = needs(nodes=[{"capacity": {"cpu": 4}}])
    assert messages(evaluate(default, view_of(cluster(nodes)))) == [
        "needs 1 node with >= 4 cores available; no node qualifies; cp-1 is not schedulable; "
        "worker-1 is not Ready"]
    any_schedulability = needs(nodes=[{"capacity": {"cpu": 4}, "selector": {"matchExpressions": [
        {"key": "/schedulable", "operator": "Exists"}]}}])
    assert evaluate(any_schedulability, view_of(cluster(nodes))).eligible
    any_readiness = needs(nodes=[{"count": 2, "selector": {"matchExpressions": [
        {"key": "/ready", "operator": "In", "values": [False]},
        {"key": "/schedulable", "operator": "Exists"}]}}])
    assert messages(evaluate(any_readiness, view_of(cluster(nodes)))) == [
        "needs 2 nodes matching /ready In [false] and /schedulable Exists; 1 node qualifies "
        "(worker-1); cp-1 fails /ready In [false] (has true)"]
    unknown_status = [{k: v for k, v in node("worker-1").items() if k != "ready"}]
    assert messages(evaluate(default, view_of(cluster(unknown_status)))) == [
        "needs 1 node with >= 4 cores available; no node qualifies; "
        "worker-1 has no Ready status"]


def test_node_selectors_take_draft_operators_and_every_node_field() -> None:
    nodes = [node("arm-1", 2, arch="arm64", zone="hall-2"),
             node("arm-2", 6, arch="arm64", zone="hall-1"), node("x86-1", 16)]
    requirement = needs(nodes=[{"count": 2, "selector": {"matchExpressions": [
        {"key": "/architecture", "operator": "In", "values": ["arm64"]},
        {"key": "/available/cpu", "operator": "GtEq", "values": [2]}]}},
        {"selector": {"matchExpressions": [
            {"key": "/zone", "operator": "In", "values": ["hall-1"]},
            {"key": "/available/cpu", "operator": "LtEq", "values": [6]}]}}])
    assert evaluate(requirement, view_of(cluster(nodes))).eligible
    nodes[0]["available"]["cpu"] = 1.999
    nodes[1]["available"]["cpu"] = 6.001
    assert messages(evaluate(requirement, view_of(cluster(nodes)))) == [
        "needs 2 nodes matching /architecture In ['arm64'] and /available/cpu GtEq 2; "
        "1 node qualifies (arm-2); arm-1 fails /available/cpu GtEq 2 (has 1.999); "
        "x86-1 fails /architecture In ['arm64'] (has 'amd64')",
        "needs 1 node matching /zone In ['hall-1'] and /available/cpu LtEq 6; no node "
        "qualifies; arm-1 fails /zone In ['hall-1'] (has 'hall-2'); arm-2 fails "
        "/available/cpu LtEq 6 (has 6.001); x86-1 fails /zone In ['hall-1'] (has nothing "
        "there), fails /available/cpu LtEq 6 (has 16)"]


def test_quantities_in_requirements_and_reports() -> None:
    nodes = [node("a", "1500m", "1536Mi"), node("b", 2, "2Gi")]
    assert evaluate(needs(nodes=[{"count": 2, "capacity": {"cpu": "1500m", "memory": "1.5Gi"}}]),
                    view_of(cluster(nodes))).eligible
    result = evaluate(needs(nodes=[{"count": 2, "capacity": {
        "cpu": 1.6, "memory": "2Gi", "ephemeralStorage": "50Gi"}}]), view_of(cluster(nodes)))
    assert messages(result) == [
        "needs 2 nodes with >= 1.6 cores and 2Gi memory and 50Gi ephemeral storage available; "
        "no node qualifies; a has 1.5 cores and 1.5Gi memory and 40Gi ephemeral storage "
        "available; b has 40Gi ephemeral storage available"]
    broken = [node("a", "lots", None)]  # type: ignore[arg-type]
    assert messages(evaluate(needs(nodes=[{"capacity": {"cpu": 1, "memory": "1Mi"}}]),
                             view_of(cluster(broken)))) == [
        "needs 1 node with >= 1 core and 1Mi memory available; no node qualifies; "
        "a has no cores and no memory available"]


def test_more_nodes_than_listed_are_counted() -> None:
    nodes = [node(f"n{i:02}", 1) for i in range(12)]
    result = evaluate(needs(nodes=[{"count": 3, "capacity": {"cpu": 2}}]),
                      view_of(cluster(nodes)))
    message = messages(result)[0]
    assert message.startswith("needs 3 nodes with >= 2 cores available; no node qualifies; "
                              "n00 has 1 core available;")
    assert "n07 has 1 core available; and 4 more nodes do not qualify" in message
    assert "n08" not in message
    assert len(result.failures[0].actual["nodes"]) == 12


def test_every_node_entry_must_hold() -> None:
    requirement = needs(nodes=[{"count": 1, "capacity": {"cpu": 2}},
                               {"count": 3}])
    result = evaluate(requirement, view_of(cluster([node("a"), node("b")])))
    assert messages(result) == ["needs 3 nodes; 2 nodes qualify (a, b)"]
    assert result.failures[0].key == "cluster.nodes[1]"


def test_a_manifest_with_only_a_node_summary_is_matched_on_allocatable() -> None:
    summary = {"allocatable": {"cpu": "32", "memory": "128Gi"}, "nodeCount": 2, "nodeSummary": [
        {"architecture": "amd64", "allocatableCpu": "16", "allocatableMemory": "64Gi"},
        {"architecture": "amd64", "allocatableCpu": "16000m", "allocatableMemory": "64Gi",
         "allocatableGpu": {"nvidia.com/gpu": 4}}]}
    view = view_of(cluster(resources=summary))
    assert evaluate(needs(nodes=[{"capacity": {"cpu": 16, "resources": {"nvidia.com/gpu": 4}}}]),
                    view).eligible
    assert messages(evaluate(needs(nodes=[{"capacity": {"resources": {"nvidia.com/gpu": 8}}}]),
                             view)) == [
        "needs 1 node with >= 8 nvidia.com/gpu available (from nodeSummary: allocatable "
        "amounts, the cluster reports no requests); no node qualifies; nodeSummary[0] has no "
        "nvidia.com/gpu available; nodeSummary[1] has 4 nvidia.com/gpu available"]


def test_unreadable_nodes_fail_with_the_reason_the_cluster_gave() -> None:
    body = cluster(resources={"allocatable": {"cpu": "4", "memory": "8Gi"}})
    body["unknown"] = [{"what": "resources.nodes", "reason": "nodes is forbidden (RBAC 403)"}]
    assert messages(evaluate(needs(nodes=[{"count": 1}]), view_of(body))) == [
        "needs 1 node, but the cluster reported no nodes (the cluster could not read "
        "resources.nodes: nodes is forbidden (RBAC 403))"]
    assert messages(evaluate(needs(nodes=[{"count": 1}]), view_of(cluster([])))) == [
        "needs 1 node; no node qualifies (the cluster reported no nodes)"]


ALL_CLAUSES = needs(nodes=[{"count": 1}], kubernetesVersion=">=1.28",
                    apiGroups=["apps"], customResourceDefinitions=["policies.example.com"],
                    defaultStorageClass=True)


@pytest.mark.parametrize("view", [view_of(None), {}, None], ids=["rc3-device", "empty", "none"])
def test_a_device_without_cluster_data_fails_every_cluster_requirement(view: Any) -> None:
    result = evaluate(ALL_CLAUSES, view)
    assert messages(result) == [
        f"needs 1 node, but {NO_CLUSTER}",
        f"needs Kubernetes >=1.28, but {NO_CLUSTER}",
        f"needs API group apps, but {NO_CLUSTER}",
        f"needs CRD policies.example.com, but {NO_CLUSTER}",
        f"needs a default storage class, but {NO_CLUSTER}"]
    assert [f.key for f in result.failures] == [
        "cluster.nodes[0]", "cluster.kubernetesVersion", "cluster.apiGroups",
        "cluster.customResourceDefinitions", "cluster.defaultStorageClass"]
    assert evaluate(ALL_CLAUSES, view_of(cluster())).eligible


# --------------------------------------------------------------------------- version range


@pytest.mark.parametrize(("text", "inside", "outside"), [
    (">=1.28 <1.33", ["1.28.0", "1.32.9", "v1.30.4+k3s1"], ["1.27.15", "1.33.0", "2.0.0"]),
    (">1.31", ["1.32.0"], ["1.31.9", "1.31.0"]),
    (">1.31.2", ["1.31.3", "1.32.0"], ["1.31.2"]),
    ("<=1.31", ["1.31.9", "1.20.0"], ["1.32.0"]),
    ("<=1.31.2", ["1.31.2"], ["1.31.3"]),
    ("=1.31", ["1.31.0", "1.31.7-gke.100"], ["1.30.9", "1.32.0"]),
    ("1.31.2", ["1.31.2", "1.31.2+rke2r1"], ["1.31.3"]),
    (">= 1.28 < 1.30 || >=1.32", ["1.29.1", "1.32.0"], ["1.30.0", "1.31.5", "1.27.0"]),
    ("v1.29", ["1.29.3"], ["1.28.0"]),
])
def test_kubernetes_version_ranges(text: str, inside: list[str], outside: list[str]) -> None:
    compiled = compile_constraints(needs(kubernetesVersion=text))
    for version in inside:
        body = cluster(metadata={"id": "c", "kubernetesVersion": version})
        assert compiled.is_eligible(view_of(body), {}), (text, version)
    for version in outside:
        body = cluster(metadata={"id": "c", "kubernetesVersion": version})
        result = compiled.evaluate(view_of(body), {})
        assert messages(result) == [f"needs Kubernetes {text}, but the cluster runs {version}"]
        assert result.failures[0].actual == version


def test_version_range_grammar() -> None:
    assert parse_version_range(">=1.28 <1.33") == (((">=", (1, 28, 0)), ("<", (1, 33, 0))),)
    assert parse_version_range("=1.31") == (((">=", (1, 31, 0)), ("<", (1, 32, 0))),)
    assert parse_version_range("1.2.3 || >2.0") == ((("==", (1, 2, 3)),),
                                                    ((">=", (2, 1, 0)),))
    for bad in ["", "  ", "1", ">=1.28<1.33", "1.28.0.1", "~1.28", ">=1.028", "1.28 ||", "x"]:
        with pytest.raises(ValueError):
            parse_version_range(bad)


def test_unreadable_or_missing_versions_fail() -> None:
    compiled = compile_constraints(needs(kubernetesVersion=">=1.28"))
    odd = cluster(metadata={"id": "c", "kubernetesVersion": "latest"})
    assert messages(compiled.evaluate(view_of(odd), {})) == [
        "needs Kubernetes >=1.28, but the cluster reports 'latest', not MAJOR.MINOR[.PATCH]"]
    gone = cluster(metadata={"id": "c"}, unknown=[
        {"what": "metadata.kubernetesVersion", "reason": "GET /version: 503"}])
    assert messages(compiled.evaluate(view_of(gone), {})) == [
        "needs Kubernetes >=1.28, but the cluster reported no Kubernetes version (the cluster "
        "could not read metadata.kubernetesVersion: GET /version: 503)"]


# --------------------------------------------------------------------------- API surface


def test_api_groups_with_and_without_versions() -> None:
    ok = needs(apiGroups=["v1", "apps", "monitoring.coreos.com/v1alpha1", "networking.k8s.io"])
    assert evaluate(ok, view_of(cluster())).eligible
    missing = needs(apiGroups=["monitoring.coreos.com/v2", "gateway.networking.k8s.io",
                               "v2", "apps/v1"])
    result = evaluate(missing, view_of(cluster()))
    assert messages(result) == [
        "needs API groups monitoring.coreos.com/v2, gateway.networking.k8s.io, v2, apps/v1, "
        "but the cluster lacks monitoring.coreos.com/v2 (served: v1, v1alpha1); "
        "gateway.networking.k8s.io (group not served); v2 (served: v1)"]
    assert result.failures[0].actual == ["", "apps", "monitoring.coreos.com",
                                         "networking.k8s.io"]
    odd = cluster(apiSurface={"apiGroups": [{"name": "apps"}, "batch", {"versions": ["v1"]}]})
    assert evaluate(needs(apiGroups=["apps"]), view_of(odd)).eligible
    assert messages(evaluate(needs(apiGroups=["apps/v1", "batch"]), view_of(odd))) == [
        "needs API groups apps/v1, batch, but the cluster lacks apps/v1 (served: none); "
        "batch (group not served)"]
    forbidden = cluster(apiSurface={}, unknown=[{"what": "apiSurface.apiGroups",
                                                 "reason": "discovery failed"}])
    assert messages(evaluate(needs(apiGroups=["apps"]), view_of(forbidden))) == [
        "needs API group apps, but the cluster reported no API groups (the cluster could not "
        "read apiSurface.apiGroups: discovery failed)"]


def test_crds_by_plural_or_kind() -> None:
    ok = needs(customResourceDefinitions=[
        "servicemonitors.monitoring.coreos.com", "PodMonitor.monitoring.coreos.com",
        "gateways.networking.istio.io", "policies.example.com"])
    assert evaluate(ok, view_of(cluster())).eligible
    missing = needs(customResourceDefinitions=[
        "prometheusrules.monitoring.coreos.com", "servicemonitor.monitoring.coreos.com",
        "clusterpolicies.nvidia.com", "podmonitor.monitoring.coreos.com",
        "Servicemonitor.monitoring.coreos.com"])
    assert messages(evaluate(missing, view_of(cluster()))) == [
        "needs CRDs prometheusrules.monitoring.coreos.com, servicemonitor.monitoring.coreos.com,"
        " clusterpolicies.nvidia.com, podmonitor.monitoring.coreos.com, "
        "Servicemonitor.monitoring.coreos.com, but the cluster lacks "
        "prometheusrules.monitoring.coreos.com (group monitoring.coreos.com has PodMonitor, "
        "ServiceMonitor); clusterpolicies.nvidia.com (no CRD of group nvidia.com); "
        "Servicemonitor.monitoring.coreos.com (group monitoring.coreos.com has PodMonitor, "
        "ServiceMonitor)"]  # the singular is the CRD's singular name, so it matches
    named = cluster(apiSurface={"customResourceDefinitions": [
        {"group": "example.com", "kind": "Octopus", "versions": ["v1"], "plural": "octopi"}]})
    assert evaluate(needs(customResourceDefinitions=["octopi.example.com"]),
                    view_of(named)).eligible
    forbidden = cluster(apiSurface={"apiGroups": []}, unknown=[
        {"what": "apiSurface.customResourceDefinitions", "reason": "forbidden"}])
    assert messages(evaluate(needs(customResourceDefinitions=["policies.example.com"]),
                             view_of(forbidden))) == [
        "needs CRD policies.example.com, but the cluster reported no CRDs (the cluster could "
        "not read apiSurface.customResourceDefinitions: forbidden)"]


def test_default_storage_class() -> None:
    assert evaluate(needs(defaultStorageClass=True), view_of(cluster())).eligible
    assert evaluate(needs(defaultStorageClass="local-path"), view_of(cluster())).eligible
    assert messages(evaluate(needs(defaultStorageClass="longhorn"), view_of(cluster()))) == [
        "needs 'longhorn' as the default storage class, but the default is 'local-path'"]
    no_default = cluster(capabilities={"storageClasses": [
        {"name": "longhorn", "provisioner": "driver.longhorn.io", "isDefault": False}]})
    assert messages(evaluate(needs(defaultStorageClass=True), view_of(no_default))) == [
        "needs a default storage class, but no storage class is the default "
        "(classes: 'longhorn')"]
    unread = cluster(capabilities={"otelCollector": True}, unknown=[
        {"what": "capabilities.storageClasses", "reason": "storageclasses is forbidden"}])
    assert messages(evaluate(needs(defaultStorageClass=True), view_of(unread))) == [
        "needs a default storage class, but the cluster reported no storage classes (the "
        "cluster could not read capabilities.storageClasses: storageclasses is forbidden)"]


def test_cluster_requirements_combine_with_standard_constraints() -> None:
    constraints = {
        "capacityRequirements": {"cpu": {"cores": 8}},
        "eligibilityRules": [{"labelSelector": {"matchExpressions": [
            {"key": "example.com/site", "operator": "In", "values": ["plant-a"]}]}}],
        "x-acme-extensions": {"anything": True},  # other vendors' extensions are ignored
        **needs(nodes=[{"capacity": {"memory": "16Gi"}}]),
    }
    result = evaluate(constraints, view_of(cluster()), {"example.com/site": "plant-b"})
    assert [f.stage for f in result.failures] == ["capacity", "cluster", "eligibility"]
    big = view_of(cluster([node("big", 8, "32Gi")]), cpus=[{"cores": 8}])
    assert evaluate(constraints, big, {"example.com/site": "plant-a"}).eligible


# --------------------------------------------------------------------------- draft form


def draft(*entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {EXTENSION: {"deviceCharacteristics": [{"matchExpressions": e} for e in entries]}}


def test_draft_characteristics_reach_the_device_labels_and_reported_characteristics() -> None:
    extensions = {EXTENSION: {"cluster": cluster(), "deviceCharacteristics": [
        {"key": "example.com/interface/canbus", "properties": {"interfaces": [
            {"channelId": "can0", "baudRate": 500000}]}}]}}
    view = matching_view({"id": "d", "cpus": [{"cores": 4, "architecture": "amd64"}]},
                         extensions)
    labels = {"example.com/site": "plant-a", "k8s.margo-gitops.dev/minor": 31}
    constraints = draft([
        {"key": DEVICE_CHARACTERISTIC, "property": "/cpus", "operator": "ContainsAll",
         "itemSelector": {"matchExpressions": [
             {"key": "/cores", "operator": "GtEq", "values": [4]},
             {"key": "/architecture", "operator": "In", "values": ["amd64"]}]}},
        {"key": DEVICE_CHARACTERISTIC, "property": "/apiSurface/apiGroups", "operator": "Exists"},
        {"key": "example.com/site", "operator": "In", "values": ["plant-a"]},
        {"key": "k8s.margo-gitops.dev/minor", "operator": "LtEq", "values": [31]},
        {"key": "example.com/interface/canbus", "property": "/interfaces", "operator":
         "ContainsAny", "itemSelector": {"matchExpressions": [
             {"key": "/baudRate", "operator": "GtEq", "values": [250000]}]}},
        {"key": "example.com/interface/profinet", "operator": "DoesNotExist"},
    ])
    assert evaluate(constraints, view, labels).eligible
    result = evaluate(constraints, view, {"example.com/site": "plant-b",
                                          "k8s.margo-gitops.dev/minor": 32})
    assert messages(result) == [
        "deviceCharacteristics 0 (draft): characteristic 'example.com/site' In ['plant-a'] "
        "but the device has 'plant-b'",
        "deviceCharacteristics 0 (draft): characteristic 'k8s.margo-gitops.dev/minor' LtEq 31 "
        "but the device has 32"]
    assert [(f.stage, f.key, f.rule) for f in result.failures] == [
        ("characteristics", "example.com/site", 0),
        ("characteristics", "k8s.margo-gitops.dev/minor", 0)]


def test_draft_entries_are_alternatives_and_misses_are_explained() -> None:
    constraints = draft(
        [{"key": "margo.org/deployment/helm-with-chart-api-2", "operator": "Exists"}],
        [{"key": DEVICE_CHARACTERISTIC, "property": "/memoryGiB", "operator": "GtEq",
          "values": [8]},
         {"key": "example.com/ram", "property": "/size", "operator": "Gt", "values": [1]}])
    view = {"memoryGiB": 8}
    assert not evaluate(constraints, view).eligible
    assert messages(evaluate(constraints, view, {"example.com/ram": "big"})) == [
        "deviceCharacteristics 0 (draft): characteristic "
        "'margo.org/deployment/helm-with-chart-api-2' Exists but the device has no "
        "characteristic or label 'margo.org/deployment/helm-with-chart-api-2'",
        "deviceCharacteristics 1 (draft): characteristic 'example.com/ram' /size Gt 1 but the "
        "device has no property /size in characteristic 'example.com/ram'"]
    assert messages(evaluate(constraints, {"memoryGiB": "8Gi"})) == [
        "deviceCharacteristics 0 (draft): characteristic "
        "'margo.org/deployment/helm-with-chart-api-2' Exists but the device has no "
        "characteristic or label 'margo.org/deployment/helm-with-chart-api-2'",
        "deviceCharacteristics 1 (draft): characteristic 'margo-gitops.dev/capabilities' "
        "/memoryGiB GtEq 8 but the device has '8Gi' (a string, not a number)",
        "deviceCharacteristics 1 (draft): characteristic 'example.com/ram' /size Gt 1 but the "
        "device has no characteristic or label 'example.com/ram'"]
    reported = matching_view({}, {EXTENSION: {"deviceCharacteristics": [
        {"key": "margo.org/deployment/helm-with-chart-api-2", "properties": {}}]}})
    assert evaluate(constraints, reported).eligible  # an empty bag still exists


@pytest.mark.parametrize(("operator", "bound", "passing", "failing"), [
    ("GtEq", 2, [2, 2.5, 3], [1.999, "2", None, True, [2]]),
    ("LtEq", 2, [2, 1.5, -1], [2.001, "2", False]),
    ("Gt", 2, [2.001], [2]),
    ("Lt", 2, [1.999], [2]),
])
def test_bound_operators_at_the_edges(operator: str, bound: float, passing: list[Any],
                                      failing: list[Any]) -> None:
    compiled = compile_constraints(draft([{"key": DEVICE_CHARACTERISTIC, "property": "/n",
                                           "operator": operator, "values": [bound]}]))
    for value in passing:
        assert compiled.is_eligible({"n": value}, {}), (operator, value)
    for value in failing:
        result = compiled.evaluate({"n": value}, {})
        assert not result.eligible, (operator, value)
        assert result.failures[0].required == bound


# --------------------------------------------------------------------------- compile errors


def test_draft_operators_are_refused_in_standard_selectors() -> None:
    rules = {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
        {"key": "/cpus", "operator": "ContainsAll", "itemSelector": {"matchExpressions": [
            {"key": "/cores", "operator": "GtEq", "values": [2]}]}}]}}]}
    assert compile_problems(rules) == [
        (("eligibilityRules", 0, "propertySelector", "matchExpressions", 0, "itemSelector",
          "matchExpressions", 0, "operator"),
         "GtEq belongs to the schema-agnostic matching draft, not to the rc.3 operators of this "
         "selector; use Gt here, or use it inside deviceConstraints.x-margo-gitops-extensions")]
    assert compile_problems(draft([{"key": "a/b", "property": "/n", "operator": "gteq",
                                    "values": [1]}])) == [
        ((EXTENSION, "deviceCharacteristics", 0, "matchExpressions", 0, "operator"),
         "unknown operator 'gteq'; did you mean 'GtEq'? (operators are case-sensitive)")]


CLUSTER_PATH = (EXTENSION, "cluster")
NODE_PATH = (*CLUSTER_PATH, "nodes", 0)


@pytest.mark.parametrize(("requirements", "expected"), [
    ({"nodes": []}, [((*CLUSTER_PATH, "nodes"),
                      "nodes must be a non-empty list of node requirements")]),
    ({"nodes": [{"count": 0}]}, [((*NODE_PATH, "count"),
                                  "count must be a whole number of nodes, at least 1")]),
    ({"nodes": [{"count": 1.5}]}, [((*NODE_PATH, "count"),
                                    "count must be a whole number of nodes, at least 1")]),
    ({"nodes": [{"name": "worker-1"}]}, [((*NODE_PATH, "name"),
                                          "unknown field 'name' in a node requirement")]),
    ({"nodes": [{"capacity": {}}]}, [((*NODE_PATH, "capacity"), "node capacity is empty")]),
    ({"nodes": [{"capacity": {"cpu": 0}}]}, [((*NODE_PATH, "capacity", "cpu"),
                                              "cpu must be a number of cores greater than 0")]),
    ({"nodes": [{"capacity": {"cpu": "two"}}]}, [((*NODE_PATH, "capacity", "cpu"),
                                                  "cpu must be a number of cores greater than "
                                                  "0")]),
    ({"nodes": [{"capacity": {"memory": "4 gigs"}}]},
     [((*NODE_PATH, "capacity", "memory"), "memory is not a quantity: expected a non-negative "
       "quantity such as 512Mi, 4Gi, '59 Gi', 16GB or 1.5e3, found '4 gigs': unknown unit "
       "'gigs' (use Ki Mi Gi Ti Pi Ei, k K M G T P E or m, optionally followed by B)")]),
    ({"nodes": [{"capacity": {"gpu": 1}}]}, [((*NODE_PATH, "capacity", "gpu"),
                                              "unknown field 'gpu' in node capacity; did you "
                                              "mean 'cpu'?")]),
    ({"nodes": [{"capacity": {"resources": {"nvidia.com/gpu": 0, "memory": 1}}}]},
     [((*NODE_PATH, "capacity", "resources", "nvidia.com/gpu"),
       "nvidia.com/gpu must be a whole number of devices, at least 1"),
      ((*NODE_PATH, "capacity", "resources", "memory"),
       "'memory' is not an extended resource name (cpu, memory and ephemeral storage have "
       "their own fields)")]),
    ({"nodes": [{"selector": {"matchExpressions": [{"key": "architecture", "operator": "In",
                                                    "values": ["arm64"]}]}}]},
     [((*NODE_PATH, "selector", "matchExpressions", 0, "key"),
       "key is not a valid JSON Pointer: a JSON Pointer is empty or starts with '/', found "
       "'architecture'")]),
    ({"kubernetesVersion": ">=1.28<1.33"},
     [((*CLUSTER_PATH, "kubernetesVersion"), "kubernetesVersion is not a version range: "
       "cannot read '>=1.28<1.33' in '>=1.28<1.33'")]),
    ({"kubernetesVersion": 1.28},
     [((*CLUSTER_PATH, "kubernetesVersion"), "kubernetesVersion is not a version range: "
       "a version range is a non-empty string")]),
    ({"apiGroups": "apps"}, [((*CLUSTER_PATH, "apiGroups"), "apiGroups must be a non-empty "
                                                            "list")]),
    ({"apiGroups": ["apps", "Apps/v1", 7]},
     [((*CLUSTER_PATH, "apiGroups", 2), "an entry of apiGroups must be a non-empty string"),
      ((*CLUSTER_PATH, "apiGroups", 1), "'Apps/v1' is not an API group[/version]")]),
    ({"customResourceDefinitions": ["servicemonitors", "sm.monitoring"]},
     [((*CLUSTER_PATH, "customResourceDefinitions", 0),
       "'servicemonitors' is not a CRD name (plural.group)"),
      ((*CLUSTER_PATH, "customResourceDefinitions", 1),
       "'sm.monitoring' is not a CRD name (plural.group)")]),
    ({"defaultStorageClass": False}, [((*CLUSTER_PATH, "defaultStorageClass"),
                                       "defaultStorageClass is true (some default) or a class "
                                       "name")]),
    ({}, [(CLUSTER_PATH, "cluster requirements are empty")]),
    ({"node": [{"count": 1}]}, [((*CLUSTER_PATH, "node"), "unknown field 'node' in cluster "
                                                          "requirements; did you mean "
                                                          "'nodes'?")]),
])
def test_malformed_cluster_requirements_are_located_compile_errors(
        requirements: dict[str, Any], expected: list[tuple[tuple[Any, ...], str]]) -> None:
    assert compile_problems(needs(**requirements)) == expected


@pytest.mark.parametrize(("extension", "expected"), [
    ({"clusters": {}}, [((EXTENSION, "clusters"), "unknown field 'clusters' in "
                                                  "x-margo-gitops-extensions; did you mean "
                                                  "'cluster'?")]),
    ("cluster", [((EXTENSION,), "x-margo-gitops-extensions must be an object")]),
    ({"deviceCharacteristics": []}, [((EXTENSION, "deviceCharacteristics"),
                                      "deviceCharacteristics must be a non-empty list")]),
    ({"deviceCharacteristics": [{"matchExpressions": []}]},
     [((EXTENSION, "deviceCharacteristics", 0, "matchExpressions"),
       "matchExpressions must be a non-empty list")]),
    ({"deviceCharacteristics": [{"matchExpressions": [
        {"operator": "Exists"}, {"key": "a/b", "property": "cpus", "operator": "Exists"},
        {"key": "a/b", "operator": "In"}, {"key": "a/b", "operator": "Exists", "value": 1}]}]},
     [((EXTENSION, "deviceCharacteristics", 0, "matchExpressions", 0),
       "a characteristic expression needs `key`, a non-empty string"),
      ((EXTENSION, "deviceCharacteristics", 0, "matchExpressions", 1, "property"),
       "property is not a valid JSON Pointer: a JSON Pointer is empty or starts with '/', "
       "found 'cpus'"),
      ((EXTENSION, "deviceCharacteristics", 0, "matchExpressions", 2), "In needs `values`"),
      ((EXTENSION, "deviceCharacteristics", 0, "matchExpressions", 3, "value"),
       "unknown field 'value' in a characteristic expression; did you mean 'values'?")]),
])
def test_malformed_extension_blocks_are_located_compile_errors(
        extension: Any, expected: list[tuple[tuple[Any, ...], str]]) -> None:
    assert compile_problems({EXTENSION: extension}) == expected


def test_cluster_clauses_compile_into_checks() -> None:
    compiled = compile_constraints(ALL_CLAUSES)
    assert isinstance(compiled, CompiledConstraints)
    assert len(compiled.checks) == 5 and compiled.rules == () and compiled.characteristics == ()
    assert compile_constraints(draft([{"key": "a/b", "operator": "Exists"}])).characteristics


def test_the_documented_examples_compile() -> None:
    """docs/intents.md, "Requirements on Kubernetes clusters": every YAML example is valid."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "intents.md").read_text()
    section = text.split("## Requirements on Kubernetes clusters")[1].split("\n## ")[0]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    assert len(blocks) == 3
    requirements, pointers, draft_form = blocks
    compiled = compile_constraints(requirements["deviceConstraints"])
    assert len(compiled.checks) == 7  # memory, 2 node entries, version, groups, CRDs, class
    compile_constraints({"eligibilityRules": [{"propertySelector": {
        "matchExpressions": pointers}}]})
    assert compile_constraints(draft_form["deviceConstraints"]).characteristics
