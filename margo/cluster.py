"""Kubernetes clusters as Margo targets: the proposal's `ClusterCapabilitiesManifest` and the
rc.3 `DeviceCapabilitiesManifest` that carries the same facts.

A cluster can be reported two ways (see docs/kubernetes.md): as the proposal's manifest
(`cluster.margo.org/v1alpha1`, which rc.3 servers cannot read) or as an rc.3 capabilities
document whose properties say what a plain rc.3 matcher needs (one `cpus` entry per node that
takes new pods, available memory and storage, one `gpu` peripheral per GPU) and whose
`x-margo-gitops-extensions.cluster` holds the full manifest body. Both the device client and the
server convert with the functions here, so a cluster is stored and matched alike whichever
form it sent.

Facts that could not be read (RBAC forbids a list, a request failed) are absent from the body
and named in its `unknown` list; nothing here ever fills a gap with a guess, because a matcher
cannot tell a guessed fact from a true one.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from decimal import ROUND_FLOOR, Decimal
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator

from margo.errors import DocumentError, Problem
from margo.normalize import normalise_architecture
from margo.quantity import parse_quantity
from margo.schemas import python_patterns
from margo.schemas.source import DEVICE_ID

__all__ = ["CLUSTER_API_VERSION", "CLUSTER_KIND", "CLUSTER_SECTIONS", "EXTENSION_KEY",
           "LABEL_PREFIX", "cluster_body", "cluster_labels", "cluster_manifest_from_capabilities",
           "cluster_manifest_schema", "cores", "device_capabilities_from_cluster",
           "exact_binary", "gpu_manufacturer", "is_cluster_manifest", "is_gpu_resource",
           "placement_properties", "rounded_binary", "validate_cluster_manifest"]

CLUSTER_API_VERSION = "cluster.margo.org/v1alpha1"
CLUSTER_KIND = "ClusterCapabilitiesManifest"
#: Where an rc.3 document carries the cluster body (`{"cluster": body}`).
EXTENSION_KEY = "x-margo-gitops-extensions"
#: Prefix of the label vocabulary derived from the cluster (reserved: discovered values win).
LABEL_PREFIX = "k8s.margo-gitops.dev/"
#: The body's sections a matcher also sees at the root of a device's properties.
CLUSTER_SECTIONS = ("metadata", "apiSurface", "resources", "capabilities")

#: Extended resources that count whole GPUs, and who makes them. Intel's `gpu.intel.com/
#: millicores`, `memory.max` and `tiles` are shares of a GPU, not GPUs, so only the device
#: resources i915 and xe count.
_GPU_RESOURCES = {"nvidia.com/gpu": "NVIDIA", "nvidia.com/gpu.shared": "NVIDIA",
                  "amd.com/gpu": "AMD", "intel.com/gpu": "Intel",
                  "gpu.intel.com/i915": "Intel", "gpu.intel.com/xe": "Intel"}
_RC3_ARCHITECTURES = ("amd64", "arm64", "arm")
_RC3_DEPLOYMENT_TYPES = ("helm", "compose", "custom")
_MILLI = Decimal("0.001")
_GI, _MI, _KI = 1024**3, 1024**2, 1024
_EXTENSION = r"^x-[a-z][a-z0-9-]*-extensions$"

#: Fields the proposal marks required that we leave out when they could not be read; each
#: absence must then be named in `unknown` (a prefix such as `resources` covers its children).
_PROPOSAL_REQUIRED: tuple[tuple[str, ...], ...] = (
    ("apiSurface",), ("apiSurface", "apiGroups"), ("resources",),
    ("resources", "allocatable"), ("resources", "allocatable", "cpu"),
    ("resources", "allocatable", "memory"), ("resources", "nodeCount"), ("capabilities",),
    ("capabilities", "otelCollector"))


# --- small shared helpers (discovery uses them too, so both sides render alike) ------------

def is_gpu_resource(name: str) -> bool:
    """True for extended resources that count whole GPUs (`nvidia.com/gpu`, ...)."""
    return name in _GPU_RESOURCES


def gpu_manufacturer(resource: str) -> str | None:
    """`NVIDIA`, `AMD` or `Intel` for a GPU resource name, else None."""
    return _GPU_RESOURCES.get(resource)


def cores(amount: Decimal) -> int | float:
    """Cores as a JSON number rounded down to 0.001 (Kubernetes' CPU resolution): an int
    when whole, so `4` and `4.0` never make two digests of one fact."""
    floored = amount.quantize(_MILLI, rounding=ROUND_FLOOR)
    whole = floored.to_integral_value()
    return int(whole) if whole == floored else float(floored)


def exact_binary(size: int | Decimal) -> str:
    """Bytes as an exact Kubernetes binary quantity in the largest unit that divides them
    (`16Gi`, `15995Mi`, `16379772Ki`, plain bytes otherwise): exact, so per-node sums and
    comparisons lose nothing."""
    amount = int(size)
    for suffix, unit in (("Gi", _GI), ("Mi", _MI), ("Ki", _KI)):
        if amount and amount % unit == 0:
            return f"{amount // unit}{suffix}"
    return str(amount)


def rounded_binary(size: int | Decimal) -> str:
    """Bytes rounded DOWN the way device reports read (`31Gi` from 10 GiB up, else `15872Mi`),
    so a report never claims more than there is."""
    amount = int(size)
    if amount >= 10 * _GI:
        return f"{amount // _GI}Gi"
    return f"{amount // _MI}Mi"


def _plain(value: Any) -> Any:
    """A deep JSON-only copy (documents are digested and sent as plain data)."""
    return json.loads(json.dumps(value))


# --- the manifest: detection, schema, validation -----------------------------------------

def is_cluster_manifest(doc: Any) -> bool:
    """True for a ClusterCapabilitiesManifest: its apiVersion/kind, or (as the proposal tells
    servers to distinguish the bodies) `apiSurface` plus `metadata.kubernetesVersion`."""
    if not isinstance(doc, Mapping):
        return False
    if doc.get("apiVersion") == CLUSTER_API_VERSION and doc.get("kind") == CLUSTER_KIND:
        return True
    metadata = doc.get("metadata")
    return "apiSurface" in doc and isinstance(metadata, Mapping) and (
        "kubernetesVersion" in metadata)


def _closed(properties: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def _open(properties: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    schema = _closed(properties, required)
    del schema["additionalProperties"]
    return schema


_STR = {"type": "string"}
_TEXT = {"type": "string", "minLength": 1}
_STRINGS = {"type": "array", "items": _TEXT}
_COUNT = {"type": "integer", "minimum": 0}
_COUNTS = {"type": "object", "additionalProperties": _COUNT}
_CORES = {"type": "number", "minimum": 0}
_LABEL_VALUE = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"},
                          {"type": "array", "items": {"type": "string"}},
                          {"type": "array", "items": {"type": "number"}}]}


def _node_resources() -> dict[str, Any]:
    """allocatable/requested/available of one node: cpu in cores, bytes as quantities,
    extended resources as counts."""
    return {"type": "object", "properties": {"cpu": _CORES, "memory": _TEXT,
                                             "ephemeralStorage": _TEXT},
            "additionalProperties": _COUNT}


def _node_schema() -> dict[str, Any]:
    """Our per-node addition (`resources.nodes`): open, so newer clients can add facts."""
    gpu = _closed({"resource": _TEXT, "count": _COUNT, "manufacturer": _TEXT, "model": _TEXT},
                  ["resource", "count"])
    workload = _closed({"deployment": _TEXT, "pods": _COUNT, "requested": _node_resources()},
                       ["deployment", "pods", "requested"])
    taint = _closed({"key": _TEXT, "value": _STR, "effect": _TEXT}, ["key", "effect"])
    return _open({
        "name": _TEXT, "roles": _STRINGS, "controlPlane": {"type": "boolean"},
        "ready": {"type": "boolean"}, "schedulable": {"type": "boolean"},
        "architecture": _TEXT, "os": _TEXT, "kubeletVersion": _TEXT,
        "containerRuntime": _TEXT, "allocatable": _node_resources(),
        "requested": _node_resources(), "available": _node_resources(),
        "gpus": {"type": "array", "items": gpu}, "taints": {"type": "array", "items": taint},
        "workloads": {"type": "array", "items": workload},
        "zone": _TEXT, "region": _TEXT,
        "labels": {"type": "object", "additionalProperties": _STR},
    }, ["name"])


def _build_schema() -> dict[str, Any]:
    metadata = _closed({"id": {"type": "string", "pattern": DEVICE_ID}, "name": _STR,
                        "kubernetesVersion": _TEXT, "platform": _TEXT},
                       ["id", "kubernetesVersion"])
    api_group = _closed({"name": _STR, "versions": {**_STRINGS, "minItems": 1}},
                        ["name", "versions"])
    crd = _closed({"group": _TEXT, "kind": _TEXT, "versions": {**_STRINGS, "minItems": 1}},
                  ["group", "kind", "versions"])
    api_surface = _closed({"apiGroups": {"type": "array", "items": api_group},
                           "customResourceDefinitions": {"type": "array", "items": crd}})
    allocatable = _closed({"cpu": _TEXT, "memory": _TEXT, "ephemeralStorage": _TEXT,
                           "gpu": _COUNTS, "extendedResources": _COUNTS})
    summary = _closed({"architecture": _TEXT, "allocatableCpu": _TEXT,
                       "allocatableMemory": _TEXT, "allocatableGpu": _COUNTS,
                       "allocatableExtendedResources": _COUNTS},
                      ["architecture", "allocatableCpu", "allocatableMemory"])
    gpu = _closed({"node": _TEXT, "resource": _TEXT, "index": _COUNT, "manufacturer": _TEXT,
                   "model": _TEXT, "allocatedTo": _TEXT}, ["node", "resource", "index"])
    resources = _closed({"allocatable": allocatable, "nodeCount": _COUNT,
                         "nodeSummary": {"type": "array", "items": summary},
                         "nodes": {"type": "array", "items": _node_schema()},
                         "gpus": {"type": "array", "items": gpu}})
    storage_class = _closed({"name": _TEXT, "provisioner": _TEXT, "isDefault": {
        "type": "boolean"}}, ["name", "provisioner", "isDefault"])
    ingress_class = _closed({"name": _TEXT, "controller": _TEXT,
                             "isDefault": {"type": "boolean"}}, ["name", "controller"])
    runtime_class = _closed({"name": _TEXT, "handler": _TEXT}, ["name", "handler"])
    capabilities = _closed({
        "supportedDeploymentTypes": {**_STRINGS, "minItems": 1},
        "storageClasses": {"type": "array", "items": storage_class},
        "ingressClasses": {"type": "array", "items": ingress_class},
        "runtimeClasses": {"type": "array", "items": runtime_class},
        "otelCollector": {"type": "boolean"}}, ["supportedDeploymentTypes"])
    install_entry = _closed({"type": {"enum": ["string", "number", "boolean"]}, "value": {},
                             "description": _STR, "mutable": {"type": "boolean"}},
                            ["type", "value"])
    unknown = _closed({"what": _TEXT, "reason": _TEXT}, ["what", "reason"])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://margo-gitops.dev/schemas/ClusterCapabilitiesManifest.v1alpha1.schema.json",
        "title": "ClusterCapabilitiesManifest (cluster.margo.org/v1alpha1, proposal)",
        "description": "The proposal's manifest plus margo-gitops additions (resources.nodes, "
                       "helmVersion, unknown). Fields the proposal requires but the agent could "
                       "not read are absent here and listed in `unknown`; "
                       "validate_cluster_manifest checks that pairing.",
        "type": "object",
        "properties": {
            "apiVersion": {"const": CLUSTER_API_VERSION}, "kind": {"const": CLUSTER_KIND},
            "metadata": metadata, "apiSurface": api_surface, "resources": resources,
            "capabilities": capabilities,
            "installContext": {"type": "object", "additionalProperties": install_entry},
            "labels": {"type": "object", "additionalProperties": _LABEL_VALUE},
            "helmVersion": _TEXT, "unknown": {"type": "array", "items": unknown},
        },
        "patternProperties": {_EXTENSION: {"type": "object"}},
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata"],
    }


@cache
def _schema() -> dict[str, Any]:
    schema = _build_schema()
    Draft202012Validator.check_schema(schema)
    return schema


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(python_patterns(_schema()))


def cluster_manifest_schema() -> dict[str, Any]:
    """JSON Schema 2020-12 of the manifest (a fresh copy: callers may embed or alter it)."""
    return copy.deepcopy(_schema())


def _unknown_paths(doc: Mapping[str, Any]) -> list[tuple[str, ...]]:
    entries = doc.get("unknown")
    if not isinstance(entries, list):
        return []
    return [tuple(str(e["what"]).split(".")) for e in entries
            if isinstance(e, Mapping) and isinstance(e.get("what"), str)]


def _missing_required(doc: Mapping[str, Any]) -> list[Problem]:
    """Proposal-required fields that are absent without being declared unknown."""
    declared = _unknown_paths(doc)
    problems: list[Problem] = []
    reported: list[tuple[str, ...]] = []
    for path in _PROPOSAL_REQUIRED:
        if any(path[:len(r)] == r for r in reported):
            continue  # the parent is already reported missing
        node: Any = doc
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping) or path[-1] in node:
            continue
        if any(path[:len(d)] == d for d in declared):
            continue
        reported.append(path)
        problems.append(Problem(path, f"{'.'.join(path)} is required (the proposal requires "
                                "it; leave it out only when it is listed in `unknown`)",
                                expected="present", found="absent"))
    return problems


def _quantity_problems(doc: Mapping[str, Any]) -> list[Problem]:
    resources = doc.get("resources")
    if not isinstance(resources, Mapping):
        return []
    places: list[tuple[tuple[str | int, ...], Any]] = []
    allocatable = resources.get("allocatable")
    if isinstance(allocatable, Mapping):
        places += [(("resources", "allocatable", k), allocatable[k])
                   for k in ("cpu", "memory", "ephemeralStorage") if k in allocatable]
    for index, entry in enumerate(resources.get("nodeSummary") or []):
        if isinstance(entry, Mapping):
            places += [(("resources", "nodeSummary", index, k), entry[k])
                       for k in ("allocatableCpu", "allocatableMemory") if k in entry]
    problems = []
    for path, value in places:
        try:
            parse_quantity(value)
        except ValueError as exc:
            problems.append(Problem(path, f"not a Kubernetes quantity: {exc}",
                                    expected="a quantity such as 48, 3800m or 192Gi",
                                    found=repr(value)))
    return problems


def _helm_problems(doc: Mapping[str, Any]) -> list[Problem]:
    types = (doc.get("capabilities") or {}).get("supportedDeploymentTypes")
    if not isinstance(types, list) or "helm" in types:
        return []
    return [Problem(("capabilities", "supportedDeploymentTypes"), "must include 'helm' (the "
                    "proposal: a Kubernetes cluster deploys Helm charts)",
                    expected="a list containing 'helm'", found=repr(types))]


def validate_cluster_manifest(doc: Any) -> list[Problem]:
    """Every problem of a ClusterCapabilitiesManifest (empty when valid): the schema, then
    quantities that do not parse, a missing `helm` deployment type, and proposal-required
    fields missing without an `unknown` entry saying why."""
    from margo.validation import explain_schema_errors  # validation imports much; load late

    problems = [p for p, _ in explain_schema_errors(_validator(), doc)]
    if problems or not isinstance(doc, Mapping):
        return problems
    return _quantity_problems(doc) + _helm_problems(doc) + _missing_required(doc)


# --- manifest <-> rc.3 document -----------------------------------------------------------

def _body_of(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest without apiVersion/kind, validated (DocumentError when invalid; a bare
    body is validated as if it had the right apiVersion and kind)."""
    manifest = {"apiVersion": CLUSTER_API_VERSION, "kind": CLUSTER_KIND,
                **_plain(dict(cluster))}
    problems = validate_cluster_manifest(manifest)
    if problems:
        raise DocumentError(problems)
    return {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}


def _architecture(name: Any) -> str | None:
    """The rc.3 word for a node architecture, or None when rc.3 has none (riscv64, ...)."""
    if not isinstance(name, str):
        return None
    normal = normalise_architecture(name.lower())
    if normal in _RC3_ARCHITECTURES:
        return normal
    return "arm" if normal.startswith("arm") and normal != "arm64" else None


def _placeable(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nodes that can take a new pod now: Ready and schedulable."""
    return [n for n in nodes if n.get("ready") is True and n.get("schedulable") is True]


def _gpu_peripherals(gpus: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for gpu in gpus:
        entry: dict[str, Any] = {"type": "gpu"}
        for key in ("manufacturer", "model"):
            if gpu.get(key):
                entry[key] = gpu[key]
        out += [dict(entry) for _ in range(int(gpu.get("count", 0)))]
    return out


def _gpus_of_counts(counts: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"resource": r, "count": int(n), **({"manufacturer": gpu_manufacturer(r)}
                                                 if gpu_manufacturer(r) else {})}
            for r, n in sorted(counts.items())]


def _sum_bytes(values: Iterable[Any]) -> int:
    return int(sum((parse_quantity(v) for v in values), Decimal(0)))


def _from_nodes(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Placement properties from our per-node facts: available resources of placeable nodes.
    Without `available` (pods could not be read) cpus, memory and storage stay unknown."""
    placeable = _placeable(nodes)
    out: dict[str, Any] = {}
    if all("available" in n for n in placeable):
        cpus = []
        for node in placeable:
            amount = node["available"].get("cpu", 0)
            if amount > 0:  # a full node takes no new pod; rc.3 cores must be > 0
                cpu: dict[str, Any] = {"cores": amount}
                architecture = _architecture(node.get("architecture"))
                if architecture:
                    cpu["architecture"] = architecture
                cpus.append(cpu)
        out["cpus"] = cpus
        memory = [n["available"].get("memory") for n in placeable]
        if all(m is not None for m in memory):
            out["memory"] = rounded_binary(_sum_bytes(memory))
        storage = [n["available"].get("ephemeralStorage") for n in placeable]
        if all(s is not None for s in storage):
            out["storage"] = rounded_binary(_sum_bytes(storage))
    out["peripherals"] = _gpu_peripherals(g for n in placeable for g in _free_gpus(n))
    return out


def _free_gpus(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The node's GPUs no scheduled pod holds (all of them when requests are unknown)."""
    available = node.get("available")
    gpus = [dict(g) for g in node.get("gpus") or []]
    if isinstance(available, Mapping):
        for gpu in gpus:
            gpu["count"] = min(int(gpu.get("count", 0)),
                               int(available.get(gpu.get("resource"), gpu.get("count", 0))))
    return gpus


def _from_summary(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Placement properties from a proposal manifest without our `nodes`: allocatable stands
    in for available (the proposal reports nothing finer)."""
    out: dict[str, Any] = {}
    summary = resources.get("nodeSummary")
    allocatable = resources.get("allocatable") or {}
    if isinstance(summary, list):
        cpus = []
        for entry in summary:
            amount = cores(parse_quantity(entry["allocatableCpu"]))
            if amount > 0:
                cpu: dict[str, Any] = {"cores": amount}
                architecture = _architecture(entry.get("architecture"))
                if architecture:
                    cpu["architecture"] = architecture
                cpus.append(cpu)
        out["cpus"] = cpus
        gpus = [g for e in summary for g in _gpus_of_counts(e.get("allocatableGpu") or {})]
    else:
        gpus = _gpus_of_counts(allocatable.get("gpu") or {})
    if "memory" in allocatable:
        out["memory"] = rounded_binary(parse_quantity(allocatable["memory"]))
    if "ephemeralStorage" in allocatable:
        out["storage"] = rounded_binary(parse_quantity(allocatable["ephemeralStorage"]))
    out["peripherals"] = _gpu_peripherals(gpus)
    return out


def placement_properties(body: Mapping[str, Any]) -> dict[str, Any]:
    """The rc.3 placement properties a cluster body stands for: `cpus` (one entry per node
    that takes pods, its available cores), available `memory`/`storage`, one `gpu`
    peripheral per GPU no pod holds."""
    resources = body.get("resources")
    if not isinstance(resources, Mapping):
        return {}
    nodes = resources.get("nodes")
    out = _from_nodes(nodes) if isinstance(nodes, list) else _from_summary(resources)
    out["peripherals"] = sorted(out["peripherals"], key=lambda p: (
        p.get("manufacturer", ""), p.get("model", "")))
    return out


def _version_label(version: str) -> tuple[str, int] | None:
    """`v1.31.2+k3s1` -> ("1.31.2", 31); None when it does not read as a version."""
    found = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    major, minor, patch = found.group(1), found.group(2), found.group(3) or "0"
    return f"{int(major)}.{int(minor)}.{int(patch)}", int(minor)


def _gpu_total_and_vendors(body: Mapping[str, Any]) -> tuple[int, list[str]] | None:
    resources = body.get("resources")
    if not isinstance(resources, Mapping):
        return None
    nodes = resources.get("nodes")
    if isinstance(nodes, list):
        gpus = [g for n in _placeable(nodes) for g in n.get("gpus") or []]
    elif isinstance(resources.get("nodeSummary"), list):
        gpus = [g for e in resources["nodeSummary"]
                for g in _gpus_of_counts(e.get("allocatableGpu") or {})]
    else:
        gpus = _gpus_of_counts((resources.get("allocatable") or {}).get("gpu") or {})
    total = sum(int(g.get("count", 0)) for g in gpus)
    vendors = sorted({str(g["manufacturer"]).lower() for g in gpus
                      if g.get("manufacturer") and int(g.get("count", 0)) > 0})
    return total, vendors


def _node_labels(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    def distinct(key: str) -> list[str]:
        return sorted({str(n[key]) for n in nodes if n.get(key)})
    return {"nodes": len(nodes), "schedulable-nodes": len(_placeable(nodes)),
            "control-plane-nodes": sum(1 for n in nodes if n.get("controlPlane") is True),
            "zones": distinct("zone"), "regions": distinct("region"),
            "architectures": sorted({a for n in nodes
                                     if (a := _architecture(n.get("architecture")))})}


def cluster_labels(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The documented label vocabulary (`k8s.margo-gitops.dev/...`) derived from a cluster
    body or manifest; a label is absent when its fact is unknown."""
    metadata = cluster.get("metadata") or {}
    labels: dict[str, Any] = {}
    version = _version_label(str(metadata.get("kubernetesVersion", "")))
    if version is not None:
        labels["version"], labels["minor"] = version
    if metadata.get("platform"):
        labels["platform"] = metadata["platform"]
    resources = cluster.get("resources")
    if isinstance(resources, Mapping):
        nodes = resources.get("nodes")
        if isinstance(nodes, list):
            labels.update(_node_labels(nodes))
        else:
            if "nodeCount" in resources:
                labels["nodes"] = resources["nodeCount"]
            summary = resources.get("nodeSummary")
            if isinstance(summary, list):
                labels["architectures"] = sorted(
                    {a for e in summary if (a := _architecture(e.get("architecture")))})
    gpus = _gpu_total_and_vendors(cluster)
    if gpus is not None:
        labels["gpus"], labels["gpu-vendors"] = gpus
    classes = (cluster.get("capabilities") or {}).get("storageClasses")
    if isinstance(classes, list):
        defaults = sorted(c["name"] for c in classes if c.get("isDefault") is True)
        if len(defaults) == 1:  # two defaults: Kubernetes picks the newest, we cannot tell
            labels["default-storage-class"] = defaults[0]
    return {LABEL_PREFIX + key: value for key, value in sorted(labels.items())}


def device_capabilities_from_cluster(cluster: Mapping[str, Any], *, vendor: str = "unknown",
                                     model_number: str = "unknown",
                                     serial_number: str = "unknown") -> dict[str, Any]:
    """The rc.3 DeviceCapabilitiesManifest for a cluster manifest (or its bare body).

    properties: `cpus` one entry per Ready, schedulable node with free CPU (its available
    cores and architecture), `memory`/`storage` the available totals rounded down, one `gpu`
    peripheral per GPU, helm/oci, `otelCollector` only when known; labels: the cluster's own
    labels, overridden by the derived vocabulary; the body under
    `x-margo-gitops-extensions.cluster`. `DocumentError` when the manifest is invalid.
    """
    body = _body_of(cluster)
    properties: dict[str, Any] = {
        "id": body["metadata"]["id"], "vendor": vendor, "modelNumber": model_number,
        "serialNumber": serial_number}
    properties.update(placement_properties(body))
    properties["interfaces"] = []
    capabilities = body.get("capabilities") or {}
    types = [t for t in capabilities.get("supportedDeploymentTypes", ["helm"])
             if t in _RC3_DEPLOYMENT_TYPES]
    properties["supportedDeploymentTypes"] = sorted(set(types)) or ["helm"]
    properties["supportedRuntimes"] = ["oci"]
    if isinstance(capabilities.get("otelCollector"), bool):
        properties["otelCollector"] = capabilities["otelCollector"]
    doc: dict[str, Any] = {"properties": properties}
    labels = {**(body.get("labels") or {}), **cluster_labels(body)}
    if labels:
        doc["labels"] = dict(sorted(labels.items()))
    doc[EXTENSION_KEY] = {"cluster": body}
    return doc


def cluster_body(doc: Any) -> dict[str, Any] | None:
    """The cluster body an rc.3 document carries, or None for a plain device's document."""
    if not isinstance(doc, Mapping):
        return None
    extension = doc.get(EXTENSION_KEY)
    body = extension.get("cluster") if isinstance(extension, Mapping) else None
    return body if isinstance(body, dict) else None


def cluster_manifest_from_capabilities(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest view of an rc.3 cluster document: apiVersion/kind plus the extension's
    cluster body. `ValueError` when the document carries no cluster body."""
    body = cluster_body(doc)
    if body is None:
        raise ValueError(f"not a cluster's capabilities: no {EXTENSION_KEY}.cluster object")
    return {"apiVersion": CLUSTER_API_VERSION, "kind": CLUSTER_KIND, **_plain(body)}
