"""The documents a cluster's facts become (pure): the proposal's ClusterCapabilitiesManifest
and the rc.3 DeviceCapabilitiesManifest, through margo.cluster, which the server uses too.
Output is deterministic: lists are sorted, numbers exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from margo.cluster import (
    CLUSTER_API_VERSION,
    CLUSTER_KIND,
    cores,
    device_capabilities_from_cluster,
    exact_binary,
    is_gpu_resource,
)
from margo.kinds import Kind
from margo.validation import validate_value
from reconciler.kubernetes.facts import ClusterFacts, NodeFacts, _add

__all__ = ["capabilities_document", "cluster_manifest"]


def _cpu_quantity(amount: Decimal) -> str:
    """Kubernetes CPU quantity: whole cores (`48`) or millicores (`3800m`)."""
    if amount == amount.to_integral_value():
        return str(int(amount))
    return f"{int(amount * 1000)}m"

def _node_resources(amounts: Mapping[str, Decimal]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "cpu" in amounts:
        out["cpu"] = cores(amounts["cpu"])
    if "memory" in amounts:
        out["memory"] = exact_binary(amounts["memory"])
    if "ephemeral-storage" in amounts:
        out["ephemeralStorage"] = exact_binary(amounts["ephemeral-storage"])
    for key in sorted(k for k in amounts if "/" in k):
        out[key] = int(amounts[key])
    return out

def _node_entry(node: NodeFacts) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": node.name, "roles": list(node.roles),
                             "controlPlane": node.control_plane, "ready": node.ready,
                             "schedulable": node.schedulable}
    for key, value in (("architecture", node.architecture), ("os", node.os),
                       ("kubeletVersion", node.kubelet_version),
                       ("containerRuntime", node.container_runtime)):
        if value:
            entry[key] = value
    entry["allocatable"] = _node_resources(node.allocatable)
    available = node.available
    if node.requested is not None and available is not None:
        entry["requested"] = _node_resources(node.requested)
        entry["available"] = _node_resources(available)
    entry["gpus"] = [{k: v for k, v in (("resource", g.resource), ("count", g.count),
                                        ("manufacturer", g.manufacturer), ("model", g.model))
                      if v is not None} for g in node.gpus]
    entry["taints"] = [dict(t) for t in node.taints]
    if node.workloads is not None:
        entry["workloads"] = [{"deployment": w.deployment, "pods": w.pods,
                               "requested": _node_resources(w.requested)}
                              for w in node.workloads]
    if node.zone:
        entry["zone"] = node.zone
    if node.region:
        entry["region"] = node.region
    entry["labels"] = dict(node.labels)
    return entry

def _split_extended(amounts: Mapping[str, Decimal]) -> tuple[dict[str, int], dict[str, int]]:
    gpu = {k: int(v) for k, v in sorted(amounts.items()) if is_gpu_resource(k)}
    other = {k: int(v) for k, v in sorted(amounts.items())
             if "/" in k and not is_gpu_resource(k)}
    return gpu, other

def _summary(node: NodeFacts) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "architecture": node.architecture or "unknown",
        "allocatableCpu": _cpu_quantity(node.allocatable.get("cpu", Decimal(0))),
        "allocatableMemory": exact_binary(node.allocatable.get("memory", Decimal(0)))}
    gpu, other = _split_extended(node.allocatable)
    if gpu:
        entry["allocatableGpu"] = gpu
    if other:
        entry["allocatableExtendedResources"] = other
    return entry

def _gpu_entries(nodes: list[NodeFacts], allocations: list[Any]) -> list[dict[str, Any]]:
    """One entry per GPU (the GPU proposal's `gpus[]` with `allocatedTo`), with what the
    node's labels say of its model."""
    known = {(n.name, g.resource): g for n in nodes for g in n.gpus}
    out = []
    for allocation in allocations:
        entry: dict[str, Any] = {"node": allocation.node, "resource": allocation.resource,
                                 "index": allocation.index}
        gpu = known.get((allocation.node, allocation.resource))
        for key, value in (("manufacturer", gpu and gpu.manufacturer),
                           ("model", gpu and gpu.model), ("allocatedTo", allocation.holder)):
            if value:
                entry[key] = value
        out.append(entry)
    return out

def _resources_section(nodes: list[NodeFacts],
                       allocations: list[Any] | None = None) -> dict[str, Any]:
    """The proposal's sums over Ready nodes, plus our per-node list of every node and, when
    the pods are known, every GPU with its holder."""
    ready = [n for n in nodes if n.ready]
    total: dict[str, Decimal] = {}
    for node in ready:
        _add(total, node.allocatable)
    allocatable: dict[str, Any] = {
        "cpu": _cpu_quantity(total.get("cpu", Decimal(0))),
        "memory": exact_binary(total.get("memory", Decimal(0)))}
    if ready and all("ephemeral-storage" in n.allocatable for n in ready):
        allocatable["ephemeralStorage"] = exact_binary(total["ephemeral-storage"])
    gpu, other = _split_extended(total)
    if gpu:
        allocatable["gpu"] = gpu
    if other:
        allocatable["extendedResources"] = other
    section = {"allocatable": allocatable, "nodeCount": len(ready),
               "nodeSummary": [_summary(n) for n in ready],
               "nodes": [_node_entry(n) for n in nodes]}
    if allocations:
        section["gpus"] = _gpu_entries(nodes, allocations)
    return section

def _capabilities_section(facts: ClusterFacts) -> dict[str, Any]:
    section: dict[str, Any] = {"supportedDeploymentTypes": ["helm"]}
    for key, value in (("storageClasses", facts.storage_classes),
                       ("ingressClasses", facts.ingress_classes),
                       ("runtimeClasses", facts.runtime_classes)):
        if value is not None:
            section[key] = [dict(v) for v in value]
    if facts.otel_collector is not None:
        section["otelCollector"] = facts.otel_collector
    return section

def cluster_manifest(facts: ClusterFacts, *, device_id: str,
                     name: str | None = None) -> dict[str, Any]:
    """The proposal's ClusterCapabilitiesManifest (with our `resources.nodes`, `helmVersion`
    and `unknown`) for the facts; unreadable facts are absent and listed in `unknown`."""
    metadata: dict[str, Any] = {"id": device_id}
    if name:
        metadata["name"] = name
    metadata["kubernetesVersion"] = facts.git_version.removeprefix("v")
    if facts.platform:
        metadata["platform"] = facts.platform
    manifest: dict[str, Any] = {"apiVersion": CLUSTER_API_VERSION, "kind": CLUSTER_KIND,
                                "metadata": metadata}
    surface: dict[str, Any] = {}
    if facts.api_groups is not None:
        surface["apiGroups"] = [{"name": g["name"], "versions": list(g["versions"])}
                                for g in facts.api_groups]
    if facts.crds is not None:
        surface["customResourceDefinitions"] = [dict(c) for c in facts.crds]
    manifest["apiSurface"] = surface
    if facts.nodes is not None:
        manifest["resources"] = _resources_section(facts.nodes, facts.gpu_allocations)
    manifest["capabilities"] = _capabilities_section(facts)
    if facts.helm_version:
        manifest["helmVersion"] = facts.helm_version
    if facts.unknown:
        manifest["unknown"] = sorted((dict(u) for u in facts.unknown),
                                     key=lambda u: (u["what"], u["reason"]))
    return manifest

def capabilities_document(facts: ClusterFacts, *, device_id: str, vendor: str = "unknown",
                          model_number: str = "unknown", serial_number: str = "unknown",
                          labels: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The rc.3 DeviceCapabilitiesManifest for the facts (validated: `DocumentError` when
    it is not, e.g. for a device id the spec does not allow)."""
    manifest = cluster_manifest(facts, device_id=device_id)
    if labels:
        manifest["labels"] = dict(sorted(labels.items()))
    doc = device_capabilities_from_cluster(manifest, vendor=vendor, model_number=model_number,
                                           serial_number=serial_number)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES, file="kubernetes capabilities")
    return doc
