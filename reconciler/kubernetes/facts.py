"""What a Kubernetes cluster offers, as facts parsed from its API objects (pure: no reads).

Nodes become `NodeFacts` (roles, readiness, taints, topology, GPUs and the labels worth
reporting, allocatable and, from the pods scheduled there, requested resources, summed as
the scheduler sums them); classes, CRDs and API groups are reduced to what the report says;
a DaemonSet is recognised as an OpenTelemetry collector and judged on its coverage; the
platform is guessed (informational only). `discovery` reads the objects,
`cluster_documents` turns the facts into documents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from margo.cluster import (
    gpu_manufacturer,
    is_gpu_resource,
)
from margo.quantity import parse_quantity

__all__ = ["ClusterFacts", "GpuFacts", "NodeFacts", "guess_platform", "node_facts", "pod_requests"]


_ROLE_PREFIX = "node-role.kubernetes.io/"

_LEGACY_ROLE = "kubernetes.io/role"

_CONTROL_PLANE_ROLES = {"control-plane", "master"}

_BLOCKING_EFFECTS = {"NoSchedule", "NoExecute"}

_BYTE_RESOURCES = {"memory", "ephemeral-storage"}

_NFD_DOMAIN = "feature.node.kubernetes.io"

#: Node labels worth reporting next to NFD's: GPU Feature Discovery and the AMD/Intel
#: labellers. Operator plumbing (`nvidia.com/gpu.deploy.*`) and GFD's start time are left out:
#: the first says nothing about the hardware, the second would re-report on every restart.
_GPU_LABEL_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/cuda.", "nvidia.com/mig.",
                       "nvidia.com/vgpu.", "amd.com/gpu.", "beta.amd.com/gpu.", "gpu.intel.com/")

_GPU_LABEL_EXCLUDED = ("nvidia.com/gpu.deploy.",)

#: Labels that name a GPU's model, by resource domain.
_GPU_MODEL_LABELS = {"nvidia.com": ("nvidia.com/gpu.product",),
                     "amd.com": ("amd.com/gpu.product-name", "beta.amd.com/gpu.product-name")}

_ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")

_REGION_LABELS = ("topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/region")

_DEFAULT_CLASS = ("storageclass.kubernetes.io/is-default-class",
                  "storageclass.beta.kubernetes.io/is-default-class")

_DEFAULT_INGRESS = "ingressclass.kubernetes.io/is-default-class"

_OTEL_NAMES = ("opentelemetry-collector", "otel-collector")
_OTLP_PORTS = (4317, 4318)

#: (marker in a kubelet or server version, platform); informational only (the proposal
#: forbids placing by platform).
_VERSION_PLATFORMS = (("+k3s", "k3s"), ("+rke2", "rke2"), ("+k0s", "k0s"), ("-eks-", "eks"),
                      ("-gke.", "gke"))

_LABEL_PLATFORMS = (("node.openshift.io/os_id", "openshift"),
                    ("kubernetes.azure.com/cluster", "aks"), ("microk8s.io/cluster", "microk8s"),
                    ("minikube.k8s.io/name", "minikube"))

@dataclass(frozen=True)
class GpuFacts:
    """GPUs of one resource on one node (from allocatable), with what the labels tell."""

    resource: str
    count: int
    manufacturer: str | None
    model: str | None

@dataclass(frozen=True)
class NodeFacts:
    """One node. Resource maps use Kubernetes names (`cpu` in cores, `memory` and
    `ephemeral-storage` in bytes, extended resources as counts); `requested` is None when
    the pods could not be read."""

    name: str
    roles: tuple[str, ...]
    control_plane: bool
    ready: bool
    schedulable: bool
    architecture: str | None
    os: str | None
    kubelet_version: str | None
    container_runtime: str | None
    allocatable: dict[str, Decimal]
    requested: dict[str, Decimal] | None
    gpus: tuple[GpuFacts, ...]
    taints: tuple[dict[str, str], ...]
    zone: str | None
    region: str | None
    labels: dict[str, str]
    #: What the scheduled pods of each of our deployments request here (`workloads.py`);
    #: None when pods could not be traced to deployments.
    workloads: tuple[Any, ...] | None = None

    @property
    def available(self) -> dict[str, Decimal] | None:
        """allocatable minus requested, never below zero; None when requests are unknown."""
        if self.requested is None:
            return None
        return {k: max(Decimal(0), v - self.requested.get(k, Decimal(0)))
                for k, v in self.allocatable.items()}

@dataclass
class ClusterFacts:
    """Everything discovery read. A None field was not readable; `unknown` says why."""

    git_version: str
    platform: str | None = None
    api_groups: list[dict[str, Any]] | None = None
    crds: list[dict[str, Any]] | None = None
    nodes: list[NodeFacts] | None = None
    storage_classes: list[dict[str, Any]] | None = None
    ingress_classes: list[dict[str, Any]] | None = None
    runtime_classes: list[dict[str, Any]] | None = None
    otel_collector: bool | None = None
    #: What the collector check found, or what is missing (one sentence, for people).
    otel_collector_detail: str | None = None
    helm_version: str | None = None
    #: Every GPU and who holds it (`workloads.GpuAllocation`); None when pods are unknown.
    gpu_allocations: list[Any] | None = None
    unknown: list[dict[str, str]] = field(default_factory=list)

    def note_unknown(self, what: str, reason: str) -> None:
        """Record a fact that could not be read (reasons for one fact are joined)."""
        for entry in self.unknown:
            if entry["what"] == what:
                entry["reason"] += f"; {reason}"
                return
        self.unknown.append({"what": what, "reason": reason})

def _group_versions(group: Mapping[str, Any]) -> list[str]:
    """Versions with the preferred one first, then the rest in the server's order."""
    listed = [str(v.get("version")) for v in group.get("versions") or [] if v.get("version")]
    preferred = (group.get("preferredVersion") or {}).get("version")
    if preferred in listed:
        listed.remove(preferred)
        listed.insert(0, preferred)
    return listed

def _crd(item: Mapping[str, Any]) -> dict[str, Any] | None:
    spec = item.get("spec") or {}
    versions = [str(v["name"]) for v in spec.get("versions") or []
                if v.get("name") and v.get("served", True)]
    kind = (spec.get("names") or {}).get("kind")
    if not versions or not kind or not spec.get("group"):
        return None
    return {"group": str(spec["group"]), "kind": str(kind), "versions": versions}

def _is_default(item: Mapping[str, Any], annotations: Iterable[str]) -> bool:
    found = (item.get("metadata") or {}).get("annotations") or {}
    return any(str(found.get(key, "")).lower() == "true" for key in annotations)

def _name(item: Mapping[str, Any]) -> str:
    return str((item.get("metadata") or {}).get("name", ""))

def _storage_class(item: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": _name(item), "provisioner": str(item.get("provisioner", "")),
            "isDefault": _is_default(item, _DEFAULT_CLASS)}

def _ingress_class(item: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": _name(item), "controller": str((item.get("spec") or {}).get("controller",
                                                                               "")),
            "isDefault": _is_default(item, (_DEFAULT_INGRESS,))}

def _runtime_class(item: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": _name(item), "handler": str(item.get("handler", ""))}

def _sorted_by_name(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((i for i in items if i["name"]), key=lambda i: i["name"])

def _resources(raw: Mapping[str, Any] | None) -> dict[str, Decimal]:
    """cpu, memory, ephemeral-storage and extended resources (`<domain>/<name>`), parsed;
    pods and hugepages are not placement facts Margo can express, and unreadable values are
    skipped rather than guessed."""
    out: dict[str, Decimal] = {}
    for key, value in (raw or {}).items():
        if key in ("cpu", *_BYTE_RESOURCES) or "/" in key:
            try:
                out[key] = parse_quantity(str(value))
            except ValueError:
                continue
    return out

def _roles(labels: Mapping[str, str]) -> tuple[str, ...]:
    roles = {key[len(_ROLE_PREFIX):] for key in labels if key.startswith(_ROLE_PREFIX)}
    if labels.get(_LEGACY_ROLE):
        roles.add(labels[_LEGACY_ROLE])
    return tuple(sorted(r for r in roles if r))

def _ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])

def _taints(spec: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    taints = []
    for taint in spec.get("taints") or []:
        entry = {"key": str(taint.get("key", "")), "effect": str(taint.get("effect", ""))}
        if taint.get("value"):
            entry["value"] = str(taint["value"])
        taints.append(entry)
    return tuple(sorted(taints, key=lambda t: (t["key"], t["effect"], t.get("value", ""))))

def _first(labels: Mapping[str, str], keys: Iterable[str]) -> str | None:
    return next((labels[k] for k in keys if labels.get(k)), None)

def _reported_labels(labels: Mapping[str, str]) -> dict[str, str]:
    def wanted(key: str) -> bool:
        domain = key.split("/", 1)[0] if "/" in key else ""
        if domain == _NFD_DOMAIN or domain.endswith("." + _NFD_DOMAIN):
            return True
        return key.startswith(_GPU_LABEL_PREFIXES) and not key.startswith(_GPU_LABEL_EXCLUDED)
    return {k: str(v) for k, v in sorted(labels.items()) if wanted(k)}

def _gpus(allocatable: Mapping[str, Decimal], labels: Mapping[str, str]) -> tuple[GpuFacts, ...]:
    gpus = []
    for resource, amount in sorted(allocatable.items()):
        if not is_gpu_resource(resource) or int(amount) <= 0:
            continue
        model = _first(labels, _GPU_MODEL_LABELS.get(resource.split("/", 1)[0], ()))
        gpus.append(GpuFacts(resource, int(amount), gpu_manufacturer(resource), model))
    return tuple(gpus)

def node_facts(node: Mapping[str, Any], requested: dict[str, Decimal] | None) -> NodeFacts:
    """One Node object read into facts (requested: summed pod requests, None if unknown)."""
    metadata, spec = node.get("metadata") or {}, node.get("spec") or {}
    status = node.get("status") or {}
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    info = status.get("nodeInfo") or {}
    roles = _roles(labels)
    taints = _taints(spec)
    allocatable = _resources(status.get("allocatable"))
    blocked = any(t["effect"] in _BLOCKING_EFFECTS for t in taints)
    return NodeFacts(
        name=str(metadata.get("name", "")), roles=roles,
        control_plane=bool(_CONTROL_PLANE_ROLES & set(roles)), ready=_ready(status),
        schedulable=not spec.get("unschedulable", False) and not blocked,
        architecture=labels.get("kubernetes.io/arch") or info.get("architecture") or None,
        os=labels.get("kubernetes.io/os") or info.get("operatingSystem") or None,
        kubelet_version=info.get("kubeletVersion") or None,
        container_runtime=info.get("containerRuntimeVersion") or None,
        allocatable=allocatable,
        requested=None if requested is None else {
            k: requested.get(k, Decimal(0)) for k in allocatable},
        gpus=_gpus(allocatable, labels), taints=taints,
        zone=_first(labels, _ZONE_LABELS), region=_first(labels, _REGION_LABELS),
        labels=_reported_labels(labels))

def _add(total: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, Decimal(0)) + value

def _at_least(total: dict[str, Decimal], other: Mapping[str, Decimal]) -> None:
    for key, value in other.items():
        total[key] = max(total.get(key, Decimal(0)), value)

def _container_requests(container: Mapping[str, Any]) -> dict[str, Decimal]:
    return _resources((container.get("resources") or {}).get("requests"))

def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """What the scheduler counts for a pod: the containers' sum, or the largest init step if
    larger (sidecar init containers, `restartPolicy: Always`, run alongside and add to
    both), plus the RuntimeClass overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        _add(total, _container_requests(container))
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for container in spec.get("initContainers") or []:
        requests = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, requests)
            _add(sidecars, requests)
            step = dict(sidecars)
        else:
            step = dict(requests)
            _add(step, sidecars)
        _at_least(init_peak, step)
    _at_least(total, init_peak)
    _add(total, _resources(spec.get("overhead")))
    return total

def _requests_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Decimal]]:
    """Requests of the pods that hold resources: scheduled, not Succeeded or Failed (the
    field selector already asks the server for that; checked again for servers that ignore
    it)."""
    by_node: dict[str, dict[str, Decimal]] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in ("Succeeded", "Failed"):
            continue
        _add(by_node.setdefault(str(node), {}), pod_requests(pod))
    return by_node

def _is_collector(daemonset: Mapping[str, Any]) -> bool:
    spec = daemonset.get("spec") or {}
    template = spec.get("template") or {}
    labels = {**((daemonset.get("metadata") or {}).get("labels") or {}),
              **((template.get("metadata") or {}).get("labels") or {})}
    name = str(labels.get("app.kubernetes.io/name", ""))
    component = str(labels.get("app.kubernetes.io/component", ""))
    if any(marker in name for marker in _OTEL_NAMES) or component == "opentelemetry-collector":
        return True
    containers = (template.get("spec") or {}).get("containers") or []
    return any("opentelemetry-collector" in str(c.get("image", "")) for c in containers)

def _is_otlp_port(port: Mapping[str, Any]) -> bool:
    name = str(port.get("name") or "") + str(port.get("appProtocol") or "")
    return port.get("port") in _OTLP_PORTS or port.get("targetPort") in _OTLP_PORTS \
        or "otlp" in name.lower()


def _exposes(service: Mapping[str, Any], workload: Mapping[str, Any]) -> bool:
    """Whether `service` (same namespace, a selector all of whose labels the workload's
    pods carry) routes OTLP to the workload's pods."""
    meta, spec = service.get("metadata") or {}, service.get("spec") or {}
    if meta.get("namespace") != (workload.get("metadata") or {}).get("namespace"):
        return False
    selector = spec.get("selector") or {}
    template = ((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}
    labels = template.get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items()) and any(
        _is_otlp_port(p) for p in spec.get("ports") or [] if isinstance(p, Mapping))


def _ready_replicas(deployment: Mapping[str, Any]) -> bool:
    return int((deployment.get("status") or {}).get("readyReplicas") or 0) > 0


def collector_verdict(daemonsets: list[dict[str, Any]], deployments: list[dict[str, Any]],
                      services: list[dict[str, Any]], placeable: int) -> tuple[bool, str]:
    """Whether the cluster runs an OpenTelemetry collector workloads can send OTLP to, and
    one sentence saying what was found: a collector DaemonSet Ready on every schedulable
    node (Margo allows a DaemonSet on a multi-node cluster) or a collector Deployment with a
    ready replica, exposed by a Service on an OTLP port (4317, 4318, or a port named
    `otlp...`) or, for a DaemonSet, publishing an OTLP port on every node (`hostPort`)."""
    running = [(f"DaemonSet {_namespaced(d)}", d) for d in daemonsets
               if _is_collector(d) and _covers(d, placeable)]
    running += [(f"Deployment {_namespaced(d)}", d) for d in deployments
                if _is_collector(d) and _ready_replicas(d)]
    if not running:
        partial = [_namespaced(d) for d in daemonsets if _is_collector(d)]
        return False, ("no OpenTelemetry collector runs: no collector DaemonSet Ready on all "
                       f"{placeable} schedulable node(s) and no collector Deployment with a "
                       "ready replica" + (f" (collector DaemonSet(s) not Ready everywhere: "
                                          f"{', '.join(partial)})" if partial else ""))
    for what, workload in running:
        exposing = [_namespaced(s) for s in services if _exposes(s, workload)]
        if exposing:
            return True, f"{what} receives OTLP through Service {exposing[0]}"
        host_ports = _otlp_host_ports(workload)
        if host_ports and what.startswith("DaemonSet"):
            return True, (f"{what} receives OTLP on every node's host port(s) "
                          f"{', '.join(map(str, host_ports))}")
    names = ", ".join(what for what, _ in running)
    return False, (f"{names} runs, but no Service in its namespace selects its pods on an "
                   "OTLP port (4317, 4318, or a port named otlp...) and it publishes no OTLP "
                   "host port: workloads cannot reach it")


def _otlp_host_ports(workload: Mapping[str, Any]) -> list[int]:
    """OTLP ports a collector's pods publish on their node (the agent pattern of the
    OpenTelemetry Collector chart: `hostPort` 4317 and 4318)."""
    pod = (((workload.get("spec") or {}).get("template") or {}).get("spec") or {})
    return sorted({int(p["hostPort"]) for c in pod.get("containers") or []
                   for p in c.get("ports") or []
                   if isinstance(p, Mapping) and p.get("hostPort") and _is_otlp_port(
                       {"port": p.get("containerPort"), "name": p.get("name")})})


def _namespaced(item: Mapping[str, Any]) -> str:
    meta = item.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _covers(daemonset: Mapping[str, Any], placeable: int) -> bool:
    """Ready on every node it is meant for, and meant for at least every node that takes
    pods (it may also tolerate tainted ones: tolerations are not evaluated further)."""
    status = daemonset.get("status") or {}
    desired, ready = status.get("desiredNumberScheduled"), status.get("numberReady")
    return (isinstance(desired, int) and desired > 0 and ready == desired
            and desired >= placeable)

def guess_platform(git_version: str, nodes: Iterable[NodeFacts] = (),
                   node_labels: Iterable[Mapping[str, str]] = ()) -> str | None:
    """k3s, rke2, k0s, eks, gke from version markers, else openshift/aks/microk8s/minikube
    from node labels; None when nothing tells (no claim of `vanilla`)."""
    versions = [git_version, *(n.kubelet_version or "" for n in nodes)]
    for marker, platform in _VERSION_PLATFORMS:
        if any(marker in v for v in versions):
            return platform
    labels = list(node_labels)
    for key, platform in _LABEL_PLATFORMS:
        if any(key in node for node in labels):
            return platform
    return None
