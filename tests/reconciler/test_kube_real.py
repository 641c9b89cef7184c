"""Capability discovery and `margo device doctor` against the real control plane.

Nothing here is recorded: the nodes are registered as kubelets register them (kwok then
keeps them Ready), the pods whose requests discovery sums were placed by the real
scheduler, the collector's coverage is what the real DaemonSet controller reports, the
CRD is served by the real apiextensions server, and every read is made as the device's
ServiceAccount under the documented RBAC, or under a narrower role whose refusals are
real 403s.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from kits.kubekit import CONTROL_PLANE_TAINT, GPU_WORKER, THREE_NODES, KubeCluster, SimNode

from margo.cluster import LABEL_PREFIX
from margo.kinds import Kind
from margo.quantity import parse_quantity
from margo.validation import validate_value
from reconciler.kubernetes.client import KubeClient
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.discovery import discover
from reconciler.kubernetes.doctor import doctor
from reconciler.kubernetes.facts import pod_requests
from reconciler.kubernetes.provider import KubernetesProvider

DEVICE = "real-cluster"


def namespace(kube: KubeCluster, name: str) -> str:
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def workload(kind: str, name: str, ns: str, *, replicas: int = 1, cpu: str = "100m",
             memory: str = "64Mi", gpus: int = 0, labels: dict[str, str] | None = None,
             node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    selector = {"app": name, **(labels or {})}
    requests: dict[str, str] = {"cpu": cpu, "memory": memory}
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    pod: dict[str, Any] = {"containers": [{"name": "main", "image": f"example.com/{name}:1",
                                           "resources": {"requests": requests,
                                                         "limits": limits}}]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    spec: dict[str, Any] = {"selector": {"matchLabels": selector},
                            "template": {"metadata": {"labels": selector}, "spec": pod}}
    if kind == "Deployment":
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": ns, "labels": selector}, "spec": spec}


def otlp_service(name: str, ns: str) -> dict[str, Any]:
    """A Service exposing the collector workload `name` (as `workload` labels it) on the
    OTLP ports: what makes a collector one that workloads can send to."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"app": name},
                     "ports": [{"name": "otlp-grpc", "port": 4317},
                               {"name": "otlp-http", "port": 4318}]}}


def available(kube: KubeCluster, kind: str, name: str, ns: str, count: int) -> None:
    field = "availableReplicas" if kind == "Deployment" else "numberReady"
    kube.until(f"{kind} {name} with {count} ready", lambda: (
        kube.admin.get(kind, name, ns).get("status") or {}).get(field) == count)


def discovered(kubeconfig: Path) -> dict[str, Any]:
    with KubeClient.from_kubeconfig(kubeconfig) as client:
        return capabilities_document(discover(client), device_id=DEVICE)


def nodes_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = doc["x-margo-gitops-extensions"]["cluster"]
    return {n["name"]: n for n in cluster["resources"]["nodes"]}


def test_discovery_reports_what_the_scheduler_and_controllers_did(kube: KubeCluster) -> None:
    kube.set_nodes([*THREE_NODES, GPU_WORKER])
    ns = namespace(kube, "discovery")
    kube.apply(workload("Deployment", "web", ns, replicas=3, cpu="500m", memory="256Mi"))
    kube.apply(workload("Deployment", "vision", ns, cpu="1", memory="1Gi", gpus=1))
    kube.apply(workload("DaemonSet", "collector", ns, cpu="50m", memory="32Mi",
                        labels={"app.kubernetes.io/name": "opentelemetry-collector"}))
    kube.apply(otlp_service("collector", ns))
    available(kube, "Deployment", "web", ns, 3)
    available(kube, "Deployment", "vision", ns, 1)
    available(kube, "DaemonSet", "collector", ns, 3)  # every schedulable node, not cp-0
    kube.apply({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": "widgets.example.com"},
                "spec": {"group": "example.com", "scope": "Namespaced",
                         "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                         "versions": [{"name": "v1", "served": True, "storage": True,
                                       "schema": {"openAPIV3Schema": {"type": "object"}}}]}})
    kube.until("the CRD served", lambda: any(
        c.get("type") == "Established" and c.get("status") == "True" for c in
        (kube.admin.get("CustomResourceDefinition", "widgets.example.com").get("status")
         or {}).get("conditions") or []))

    doc = discovered(kube.device_kubeconfig())
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    nodes = nodes_of(doc)
    # What the pods request, per node, as the scheduler placed them.
    expected: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    placed = [p for p in kube.admin.list("Pod", ns) if p["spec"].get("nodeName")]
    assert len(placed) == 3 + 1 + 3
    for pod in placed:
        for resource, amount in pod_requests(pod).items():
            expected[pod["spec"]["nodeName"]][resource] += amount
    [vision] = [p for p in placed if p["metadata"]["labels"]["app"] == "vision"]
    assert vision["spec"]["nodeName"] == "gpu-worker"  # the GPU request decided it
    for name, node in nodes.items():
        assert Decimal(str(node["requested"]["cpu"])) == expected[name]["cpu"], name
        assert parse_quantity(node["requested"]["memory"]) == expected[name]["memory"], name
    assert nodes["gpu-worker"]["requested"]["nvidia.com/gpu"] == 1
    assert nodes["gpu-worker"]["available"]["nvidia.com/gpu"] == 0
    assert (nodes["cp-0"]["roles"], nodes["cp-0"]["controlPlane"], nodes["cp-0"]["schedulable"],
            nodes["cp-0"]["taints"]) == (["control-plane"], True, False, [
                {"key": CONTROL_PLANE_TAINT["key"], "effect": "NoSchedule"}])
    assert nodes["gpu-worker"]["gpus"] == [{"resource": "nvidia.com/gpu", "count": 1,
                                            "manufacturer": "NVIDIA", "model": "Tesla-T4"}]
    assert {n["zone"] for n in nodes.values()} == {"zone-a", "zone-b"}
    assert {n["kubeletVersion"] for n in nodes.values()} == {kube.version}
    assert all(n["ready"] for n in nodes.values())

    labels = doc["labels"]
    assert {k.removeprefix(LABEL_PREFIX): v for k, v in labels.items()} == {
        "architectures": ["amd64"], "control-plane-nodes": 1, "gpu-vendors": ["nvidia"],
        "gpus": 1, "minor": 36, "nodes": 4, "regions": [], "schedulable-nodes": 3,
        "version": kube.version.lstrip("v"), "zones": ["zone-a", "zone-b"]}
    properties = doc["properties"]
    # The DaemonSet covers every schedulable node, and a Service exposes it on OTLP ports.
    assert properties["otelCollector"] is True
    # vision's pod holds the only GPU: it is not offered, and the report says who has it.
    assert properties["peripherals"] == []
    assert doc["x-margo-gitops-extensions"]["cluster"]["resources"]["gpus"] == [
        {"node": "gpu-worker", "resource": "nvidia.com/gpu", "index": 0,
         "manufacturer": "NVIDIA", "model": "Tesla-T4",
         "allocatedTo": f"pod:{ns}/{vision['metadata']['name']}"}]
    assert all(n["workloads"] == [] for n in nodes.values())  # none of it is ours
    # cpus: one entry per schedulable node, with what its pods leave free.
    free = sorted(float(Decimal(n.cpu) - expected[n.name]["cpu"])
                  for n in (*THREE_NODES[1:], GPU_WORKER))
    assert sorted(c["cores"] for c in properties["cpus"]) == free
    cluster = doc["x-margo-gitops-extensions"]["cluster"]
    assert {"group": "example.com", "kind": "Widget", "versions": ["v1"]} in \
        cluster["apiSurface"]["customResourceDefinitions"]
    assert "unknown" not in cluster


def test_a_collector_that_misses_a_node_is_no_collector(kube: KubeCluster) -> None:
    kube.set_nodes(THREE_NODES)
    ns = namespace(kube, "partial-collector")
    kube.apply(workload("DaemonSet", "collector", ns,
                        labels={"app.kubernetes.io/name": "opentelemetry-collector"},
                        node_selector={"topology.kubernetes.io/zone": "zone-a"}))
    kube.apply(otlp_service("collector", ns))
    available(kube, "DaemonSet", "collector", ns, 1)  # worker-a only
    assert discovered(kube.device_kubeconfig())["properties"]["otelCollector"] is False


def test_reads_the_role_does_not_allow_are_reported_unknown(
        kube: KubeCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A ServiceAccount that may read nodes but nothing else of discovery's list: the real
    API server answers 403, and the report says what it could not see."""
    kube.set_nodes(THREE_NODES)
    ns = namespace(kube, "narrow-rbac")
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "narrow", "namespace": ns}})
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "margo-test-narrow"},
                "rules": [{"nonResourceURLs": ["/version", "/api", "/api/*", "/apis",
                                               "/apis/*"], "verbs": ["get"]},
                          {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]})
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": "margo-test-narrow"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "margo-test-narrow"},
                "subjects": [{"kind": "ServiceAccount", "name": "narrow", "namespace": ns}]})
    kubeconfig = kube.plane.service_account_kubeconfig(kube.workdir / "narrow.kubeconfig",
                                                       "narrow", ns)
    doc = discovered(kubeconfig)
    cluster = doc["x-margo-gitops-extensions"]["cluster"]
    unknown = {u["what"]: u["reason"] for u in cluster["unknown"]}
    assert set(unknown) >= {"resources.nodes.available", "capabilities.storageClasses",
                            "capabilities.otelCollector", "apiSurface.customResourceDefinitions"}
    assert "forbidden" in unknown["resources.nodes.available"]
    assert "system:serviceaccount:narrow-rbac:narrow" in unknown["resources.nodes.available"]
    properties = doc["properties"]
    # Without pods, nothing is known to be free: no cpus, memory or storage are claimed.
    assert "memory" not in properties and "storage" not in properties, properties
    assert properties.get("cpus", []) == []
    assert "otelCollector" not in properties
    assert len(nodes_of(doc)) == 3  # what it may read is still reported
    # The device client's provider says so in its log too, once.
    with caplog.at_level(logging.WARNING, logger="margo.device.kubernetes"):
        provider = KubernetesProvider(DEVICE, kubeconfig=kubeconfig, debounce_seconds=0)
        provider.gather()
        provider.gather()
    warnings = [r.getMessage() for r in caplog.records]
    assert any("resources.nodes.available not reported: forbidden" in w for w in warnings)
    assert len(warnings) == len(unknown)


def test_doctor_on_the_real_control_plane(kube: KubeCluster) -> None:
    kube.set_nodes([*THREE_NODES, SimNode("old-kubelet", kubelet_version="v1.34.3")])
    ns = namespace(kube, "doctor")
    kube.apply(workload("Deployment", "margo-device", ns,
                        labels={"app.kubernetes.io/name": "margo-device"}))
    kube.apply(workload("DaemonSet", "collector", ns,
                        labels={"app.kubernetes.io/name": "opentelemetry-collector"}))
    available(kube, "Deployment", "margo-device", ns, 1)
    available(kube, "DaemonSet", "collector", ns, 3)
    with KubeClient.from_kubeconfig(kube.device_kubeconfig()) as client:
        report = doctor(client)
    # A collector that no Service exposes is one no workload can send to.
    collector = report.check("otel-collector")
    assert collector.status == "fail" and f"DaemonSet {ns}/collector runs, but no Service " \
        "in its namespace selects its pods on an OTLP port (4317, 4318, or a port named otlp...) " \
        "and it publishes no OTLP host port" in collector.message
    kube.apply(otlp_service("collector", ns))
    with KubeClient.from_kubeconfig(kube.device_kubeconfig()) as client:
        report = doctor(client)
    checks = {c.id: c for c in report.checks}
    assert {i: c.status for i, c in checks.items()} == {
        "wfm-client": "pass", "otel-collector": "pass", "apiserver": "pass",
        "scheduler": "pass", "controller-manager": "pass", "helm-engine": "pass",
        "kubelet-ready": "pass", "container-runtime": "pass", "version-skew": "pass"}
    assert report.verdict == "pass"
    assert checks["otel-collector"].message == \
        f"DaemonSet {ns}/collector receives OTLP through Service {ns}/collector"
    # The scheduler and controller manager run as processes, not pods: their
    # leader-election Leases show that they are running.
    assert "holds its leader-election Lease kube-system/kube-scheduler" in \
        checks["scheduler"].message
    assert "kube-controller-manager" in checks["controller-manager"].message
    # A kubelet two minors behind the API server is within the skew policy.
    [old] = [n for n in checks["version-skew"].nodes if n.name == "old-kubelet"]
    assert old.status == "pass" and "v1.34.3" in old.message


@pytest.mark.parametrize(("kubelet", "why"), [
    ("v1.32.0", "4 minor versions older"), ("v1.37.0", "newer than the API server")])
def test_doctor_fails_kubelets_outside_the_skew_policy(kube: KubeCluster, kubelet: str,
                                                       why: str) -> None:
    kube.set_nodes([SimNode("edge-0"), SimNode("skewed", kubelet_version=kubelet)])
    with KubeClient.from_kubeconfig(kube.device_kubeconfig()) as client:
        report = doctor(client)
    check = next(c for c in report.checks if c.id == "version-skew")
    assert check.status == "fail"
    [skewed] = [n for n in check.nodes if n.name == "skewed"]
    assert skewed.status == "fail" and why in skewed.message, skewed.message
    assert "version-skew" in report.failures
