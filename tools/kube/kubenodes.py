"""Simulated nodes for the loopback control plane: what a kubelet would register.

A `SimNode` is written as a Node object the way a kubelet registers itself (labels for
hostname, OS, architecture, roles and topology; capacity and allocatable; node info with
the kubelet version and container runtime), plus kwok's annotation so that kwok keeps it
Ready and runs its pods. GPU nodes carry the extended resource a device plugin would
advertise (`nvidia.com/gpu` by default) and GPU Feature Discovery's product label.

`apply_nodes` makes the cluster's simulated nodes exactly the given ones: it writes each
(with its status: a create keeps it, and kwok then initialises the node from it; an update
of the main resource ignores status, so the status subresource is written too, as the
kubelet does), deletes simulated nodes that are not listed and waits until all are Ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tools.kube.kubeadmin import KubeAdmin

__all__ = ["CONTROL_PLANE_TAINT", "THREE_NODES", "SimNode", "apply_nodes", "node_ready"]

KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}


@dataclass(frozen=True)
class SimNode:
    name: str
    cpu: str = "4"
    memory: str = "8Gi"
    storage: str = "50Gi"
    pods: int = 110
    roles: tuple[str, ...] = ()
    zone: str | None = None
    region: str | None = None
    architecture: str = "amd64"
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    gpu_product: str | None = None
    taints: tuple[Mapping[str, str], ...] = ()
    unschedulable: bool = False
    #: None: the API server's own version, as on a freshly installed cluster.
    kubelet_version: str | None = None
    container_runtime: str = "containerd://2.1.4"
    labels: Mapping[str, str] = field(default_factory=dict)

    def resources(self) -> dict[str, str]:
        found = {"cpu": self.cpu, "memory": self.memory, "ephemeral-storage": self.storage,
                 "pods": str(self.pods)}
        if self.gpus:
            found[self.gpu_resource] = str(self.gpus)
        return found

    def to_object(self, server_version: str) -> dict[str, Any]:
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": self.architecture, "beta.kubernetes.io/os": "linux",
                  "beta.kubernetes.io/arch": self.architecture}
        labels.update({f"node-role.kubernetes.io/{role}": "" for role in self.roles})
        if self.zone:
            labels["topology.kubernetes.io/zone"] = self.zone
        if self.region:
            labels["topology.kubernetes.io/region"] = self.region
        if self.gpu_product:
            labels["nvidia.com/gpu.product"] = self.gpu_product
            labels["nvidia.com/gpu.count"] = str(self.gpus)
        labels.update(self.labels)
        spec: dict[str, Any] = {"taints": [dict(t) for t in self.taints]}
        if self.unschedulable:
            spec["unschedulable"] = True
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": labels, "annotations": KWOK_ANNOTATION},
            "spec": spec,
            "status": {
                "capacity": self.resources(), "allocatable": self.resources(),
                "nodeInfo": {
                    "architecture": self.architecture, "operatingSystem": "linux",
                    "kubeletVersion": self.kubelet_version or server_version,
                    "kubeProxyVersion": self.kubelet_version or server_version,
                    "containerRuntimeVersion": self.container_runtime,
                    "osImage": "Debian GNU/Linux 12 (bookworm)", "kernelVersion": "6.1.0",
                    "machineID": "", "systemUUID": "", "bootID": ""}}}


#: Taints the node lifecycle controller puts on a node until it has seen it Ready.
_LIFECYCLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_ready(node: Mapping[str, Any]) -> bool:
    """Ready, and the node lifecycle controller has noticed (its not-ready taint is gone):
    only then does the scheduler place pods there."""
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (node.get("status") or {}).get("conditions") or [])
    taints = (node.get("spec") or {}).get("taints") or []
    return ready and not any(t.get("key") in _LIFECYCLE_TAINTS for t in taints)


def apply_nodes(admin: KubeAdmin, nodes: Iterable[SimNode], *, server_version: str,
                timeout: float = 60.0) -> None:
    """Make the simulated nodes exactly `nodes` and wait until each is Ready."""
    wanted = {node.name: node for node in nodes}
    for existing in admin.list("Node"):
        meta = existing["metadata"]
        simulated = (meta.get("annotations") or {}).get("kwok.x-k8s.io/node") == "fake"
        if simulated and meta["name"] not in wanted:
            admin.delete("Node", meta["name"])
    for node in wanted.values():
        obj = node.to_object(server_version)
        admin.apply(obj)
        admin.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name},
                     "status": obj["status"]}, subresource="status")
    for name in wanted:
        admin.until(f"node {name} Ready",
                    lambda name=name: node_ready(admin.get("Node", name)), timeout=timeout)
    admin.until("deleted nodes gone", lambda: {
        n["metadata"]["name"] for n in admin.list("Node")
        if (n["metadata"].get("annotations") or {}).get("kwok.x-k8s.io/node") == "fake"}
        == set(wanted), timeout=timeout)


#: The taint that keeps workloads off a control-plane node.
CONTROL_PLANE_TAINT = {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}
#: A small cluster: a tainted control-plane node and two workers in two zones.
THREE_NODES = (
    SimNode("cp-0", cpu="2", memory="4Gi", roles=("control-plane",), zone="zone-a",
            taints=(CONTROL_PLANE_TAINT,)),
    SimNode("worker-a", cpu="4", memory="8Gi", zone="zone-a"),
    SimNode("worker-b", cpu="4", memory="8Gi", zone="zone-b"),
)
