"""What a Kubernetes cluster offers, read from its API with read-only rights.

`discover(client)` reads /version, /api, /apis, CRDs, nodes, the pods scheduled on them, the
storage, ingress and runtime classes, DaemonSets (to find an OpenTelemetry collector) and the
Helm engine's version, into `ClusterFacts`. Every read except /version may fail on its own
(RBAC forbids it, the API is not served): the failure is recorded in `unknown` with its
reason and the fact stays absent, because a report that claims what it could not see would
place workloads where they cannot run. /version is the reachability probe; when it fails the
whole discovery fails, and so does any read that finds the server gone.

`cluster_manifest` and `capabilities_document` then map the facts onto the proposal's
ClusterCapabilitiesManifest and the rc.3 DeviceCapabilitiesManifest through margo.cluster,
which the server uses too. Output is deterministic: lists are sorted, numbers exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from margo.cluster import (
    CLUSTER_API_VERSION,
    CLUSTER_KIND,
    cores,
    device_capabilities_from_cluster,
    exact_binary,
    gpu_manufacturer,
    is_gpu_resource,
)
from margo.kinds import Kind
from margo.quantity import parse_quantity
from margo.validation import validate_value
from reconciler.kubernetes.client import KubeClient, KubeError

__all__ = ["ClusterFacts", "GpuFacts", "NodeFacts", "capabilities_document", "cluster_manifest",
           "discover", "guess_platform", "helm_engine_version", "node_facts",
           "pod_requests"]

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
    helm_version: str | None = None
    unknown: list[dict[str, str]] = field(default_factory=list)

    def note_unknown(self, what: str, reason: str) -> None:
        """Record a fact that could not be read (reasons for one fact are joined)."""
        for entry in self.unknown:
            if entry["what"] == what:
                entry["reason"] += f"; {reason}"
                return
        self.unknown.append({"what": what, "reason": reason})


# --- reading --------------------------------------------------------------------------------

def _attempt(facts: ClusterFacts, what: str, read: Callable[[], Any]) -> Any:
    """Run one read; an HTTP failure becomes an `unknown` entry (None is returned), while an
    unreachable server ends the whole discovery."""
    try:
        return read()
    except KubeError as exc:
        if exc.unreachable:
            raise
        facts.note_unknown(what, exc.describe())
        return None


def _group_versions(group: Mapping[str, Any]) -> list[str]:
    """Versions with the preferred one first, then the rest in the server's order."""
    listed = [str(v.get("version")) for v in group.get("versions") or [] if v.get("version")]
    preferred = (group.get("preferredVersion") or {}).get("version")
    if preferred in listed:
        listed.remove(preferred)
        listed.insert(0, preferred)
    return listed


def _read_api_groups(client: KubeClient, facts: ClusterFacts) -> list[dict[str, Any]] | None:
    groups: list[dict[str, Any]] = []
    core = _attempt(facts, "apiSurface.apiGroups", lambda: client.get("/api"))
    if core is not None:
        groups.append({"name": "", "versions": [str(v) for v in core.get("versions") or []]})
    listing = _attempt(facts, "apiSurface.apiGroups", lambda: client.get("/apis"))
    if listing is not None:
        groups += [{"name": str(g["name"]), "versions": _group_versions(g)}
                   for g in listing.get("groups") or [] if g.get("name")]
    if core is None and listing is None:
        return None
    return sorted((g for g in groups if g["versions"]), key=lambda g: g["name"])


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


# --- nodes ------------------------------------------------------------------------------------

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


def _read_nodes(client: KubeClient,
                facts: ClusterFacts) -> tuple[list[NodeFacts] | None, list[dict[str, Any]]]:
    """The nodes (None when unreadable) and their raw labels (for the platform guess)."""
    items = _attempt(facts, "resources", lambda: client.list("/api/v1/nodes"))
    if items is None:
        return None, []
    pods = _attempt(facts, "resources.nodes.available", lambda: client.list(
        "/api/v1/pods", {"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"}))
    if pods is None:
        facts.note_unknown("resources.nodes.available", "what scheduled pods request is "
                           "unknown, so no available resources are claimed")
    requested = None if pods is None else _requests_by_node(pods)
    nodes = [node_facts(item, None if requested is None else requested.get(_name(item), {}))
             for item in items]
    labels = [dict((i.get("metadata") or {}).get("labels") or {}) for i in items]
    return sorted(nodes, key=lambda n: n.name), labels


def _read_classes(client: KubeClient, facts: ClusterFacts, key: str, path: str,
                  shape: Callable[[Mapping[str, Any]], dict[str, Any]],
                  ) -> list[dict[str, Any]] | None:
    items = _attempt(facts, f"capabilities.{key}", lambda: client.list(path))
    return None if items is None else _sorted_by_name([shape(i) for i in items])


# --- OpenTelemetry collector, platform, helm -----------------------------------------------

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


def _covers(daemonset: Mapping[str, Any], placeable: int) -> bool:
    """Ready on every node it is meant for, and meant for at least every node that takes
    pods (it may also tolerate tainted ones: tolerations are not evaluated further)."""
    status = daemonset.get("status") or {}
    desired, ready = status.get("desiredNumberScheduled"), status.get("numberReady")
    return (isinstance(desired, int) and desired > 0 and ready == desired
            and desired >= placeable)


def _read_otel(client: KubeClient, facts: ClusterFacts) -> bool | None:
    if facts.nodes is None:
        facts.note_unknown("capabilities.otelCollector",
                           "nodes could not be read, so collector coverage cannot be checked")
        return None
    daemonsets = _attempt(facts, "capabilities.otelCollector",
                          lambda: client.list("/apis/apps/v1/daemonsets"))
    if daemonsets is None:
        return None
    placeable = sum(1 for n in facts.nodes if n.ready and n.schedulable)
    return any(_is_collector(d) and _covers(d, placeable) for d in daemonsets)


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


def helm_engine_version() -> str:
    import helm_python  # 80 MB of Go runtime: only when discovery runs

    return str(helm_python.helm_sdk_version())


def discover(client: KubeClient, *,
             helm_version: Callable[[], str] | None = helm_engine_version) -> ClusterFacts:
    """Read the cluster's facts. `KubeError` when /version fails or the server is gone;
    any other failed read is recorded in `unknown`. `helm_version=None` skips the engine."""
    version = client.get("/version")
    facts = ClusterFacts(git_version=str(version.get("gitVersion") or ""))
    facts.api_groups = _read_api_groups(client, facts)
    crds = _attempt(facts, "apiSurface.customResourceDefinitions", lambda: client.list(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"))
    if crds is not None:
        parsed = [c for c in (_crd(item) for item in crds) if c is not None]
        facts.crds = sorted(parsed, key=lambda c: (c["group"], c["kind"]))
    facts.nodes, node_labels = _read_nodes(client, facts)
    facts.storage_classes = _read_classes(client, facts, "storageClasses",
                                          "/apis/storage.k8s.io/v1/storageclasses",
                                          _storage_class)
    facts.ingress_classes = _read_classes(client, facts, "ingressClasses",
                                          "/apis/networking.k8s.io/v1/ingressclasses",
                                          _ingress_class)
    facts.runtime_classes = _read_classes(client, facts, "runtimeClasses",
                                          "/apis/node.k8s.io/v1/runtimeclasses",
                                          _runtime_class)
    facts.otel_collector = _read_otel(client, facts)
    facts.platform = guess_platform(facts.git_version, facts.nodes or [], node_labels)
    if helm_version is not None:
        try:
            facts.helm_version = helm_version()
        except (ImportError, OSError, RuntimeError) as exc:
            facts.note_unknown("helmVersion", f"the Helm engine is not available: {exc}")
    return facts


# --- mapping --------------------------------------------------------------------------------

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


def _resources_section(nodes: list[NodeFacts]) -> dict[str, Any]:
    """The proposal's sums over Ready nodes, plus our per-node list of every node."""
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
    return {"allocatable": allocatable, "nodeCount": len(ready),
            "nodeSummary": [_summary(n) for n in ready],
            "nodes": [_node_entry(n) for n in nodes]}


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
        manifest["resources"] = _resources_section(facts.nodes)
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
