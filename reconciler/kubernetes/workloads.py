"""Whose are the scheduled pods: which of our deployments each one belongs to (pure).

The fleet server counts what it has placed on a cluster, and must not count a deployment
twice once its pods are scheduled (the report's `available` already subtracts them). So the
report says, per node, what the scheduled pods of each of our deployments request
(`resources.nodes[].workloads`), and which deployment or pod holds each GPU
(`resources.gpus`, the per-GPU shape of the Margo GPU proposal with `allocatedTo`).

A pod is traced to its release the way Kubernetes records ownership, never by name:

* a pod's controller owner, and that owner's controller (a ReplicaSet's Deployment, a Job's
  CronJob), up to the top object;
* Helm annotates every object it applies with `meta.helm.sh/release-name` and
  `meta.helm.sh/release-namespace` (bare pods included);
* Helm's release records (Secrets labelled `owner=helm`) carry our ownership labels, among
  them the deployment id (`reconciler.releases`).

Only metadata is needed for all of this; discovery lists it as `PartialObjectMetadata`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from margo.cluster import is_gpu_resource
from reconciler.kubernetes.facts import _add, pod_requests
from reconciler.releases import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER

__all__ = ["GpuAllocation", "Ownership", "WorkloadFacts", "attribute", "gpu_allocations"]

RELEASE_NAME = "meta.helm.sh/release-name"
RELEASE_NAMESPACE = "meta.helm.sh/release-namespace"
#: Helm's release records: `name` is the release, `owner=helm` marks them.
RELEASE_RECORDS = f"owner=helm,{LABEL_MANAGED_BY}={MANAGER}"

Key = tuple[str, str, str]  # (kind, namespace, name)


@dataclass(frozen=True)
class WorkloadFacts:
    """What the scheduled pods of one of our deployments request on one node."""

    deployment: str
    pods: int
    requested: dict[str, Decimal]


@dataclass(frozen=True)
class GpuAllocation:
    """One GPU on one node, and who holds it (None: free). Kubernetes counts GPUs per node,
    not which device a pod got, so `index` only numbers them: holders are listed in a
    stable order (our deployments by id, then other pods by namespace/name)."""

    node: str
    resource: str
    index: int
    holder: str | None


def _metadata(item: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = item.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _key(kind: str, item: Mapping[str, Any]) -> Key:
    metadata = _metadata(item)
    return (kind, str(metadata.get("namespace", "")), str(metadata.get("name", "")))


def _controller(item: Mapping[str, Any]) -> tuple[str, str] | None:
    for ref in _metadata(item).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return str(ref.get("kind", "")), str(ref.get("name", ""))
    return None


class Ownership:
    """What discovery read to trace pods to deployments: the intermediate owners
    (ReplicaSets, Jobs), the annotated top objects and Helm's release records."""

    def __init__(self, *, replicasets: Iterable[Mapping[str, Any]],
                 jobs: Iterable[Mapping[str, Any]],
                 workloads: Mapping[str, Iterable[Mapping[str, Any]]],
                 releases: Iterable[Mapping[str, Any]]) -> None:
        """`workloads` maps a kind (Deployment, StatefulSet, DaemonSet, CronJob, Job) to its
        objects; `releases` are Helm's release Secrets (metadata)."""
        self._owners: dict[Key, tuple[str, str]] = {}
        for kind, items in (("ReplicaSet", replicasets), ("Job", jobs)):
            for item in items:
                owner = _controller(item)
                if owner is not None:
                    self._owners[_key(kind, item)] = owner
        self._release_of: dict[Key, tuple[str, str]] = {}
        for kind, items in workloads.items():
            for item in items:
                release = _release_annotation(item)
                if release is not None:
                    self._release_of[_key(kind, item)] = release
        self._deployments: dict[tuple[str, str], str] = {}
        for record in releases:
            metadata = _metadata(record)
            labels = metadata.get("labels") or {}
            name, deployment = labels.get("name"), labels.get(LABEL_DEPLOYMENT)
            if isinstance(name, str) and isinstance(deployment, str):
                self._deployments[(str(metadata.get("namespace", "")), name)] = deployment

    def _top(self, pod: Mapping[str, Any]) -> Key:
        namespace = str(_metadata(pod).get("namespace", ""))
        key = _key("Pod", pod)
        owner = _controller(pod)
        for _ in range(4):  # Pod -> ReplicaSet -> Deployment; Pod -> Job -> CronJob
            if owner is None:
                return key
            key = (owner[0], namespace, owner[1])
            owner = self._owners.get(key)
        return key

    def deployment_of(self, pod: Mapping[str, Any]) -> str | None:
        """The id of the deployment whose release made this pod, or None (not ours)."""
        top = self._top(pod)
        release = (_release_annotation(pod) if top[0] == "Pod"
                   else self._release_of.get(top))
        return None if release is None else self._deployments.get(release)


def _release_annotation(item: Mapping[str, Any]) -> tuple[str, str] | None:
    annotations = _metadata(item).get("annotations") or {}
    name, namespace = annotations.get(RELEASE_NAME), annotations.get(RELEASE_NAMESPACE)
    if isinstance(name, str) and isinstance(namespace, str):
        return namespace, name
    return None


def _holds(pod: Mapping[str, Any]) -> str | None:
    """The node of a pod that holds resources (scheduled, not finished), or None."""
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    return str(node) if node and phase not in ("Succeeded", "Failed") else None


def attribute(pods: Iterable[Mapping[str, Any]],
              ownership: Ownership) -> dict[str, tuple[WorkloadFacts, ...]]:
    """Node name -> the requests of each of our deployments' scheduled pods there."""
    found: dict[str, dict[str, tuple[int, dict[str, Decimal]]]] = {}
    for pod in pods:
        node = _holds(pod)
        deployment = None if node is None else ownership.deployment_of(pod)
        if node is None or deployment is None:
            continue
        count, requested = found.setdefault(node, {}).get(deployment, (0, {}))
        _add(requested, pod_requests(pod))
        found[node][deployment] = (count + 1, requested)
    return {node: tuple(WorkloadFacts(d, n, r) for d, (n, r) in sorted(by.items()))
            for node, by in found.items()}


def gpu_allocations(pods: Iterable[Mapping[str, Any]], ownership: Ownership | None,
                    allocatable: Mapping[str, Mapping[str, Decimal]]) -> list[GpuAllocation]:
    """Every GPU of every node (`allocatable`: node -> resources), each with its holder:
    our deployment's id, or `pod:<namespace>/<name>` for anyone else's pod."""
    holders: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for pod in pods:
        node = _holds(pod)
        if node is None:
            continue
        deployment = None if ownership is None else ownership.deployment_of(pod)
        metadata = _metadata(pod)
        holder = deployment or f"pod:{metadata.get('namespace', '')}/{metadata.get('name', '')}"
        for resource, amount in pod_requests(pod).items():
            if is_gpu_resource(resource):
                holders.setdefault((node, resource), []).extend(
                    [(0 if deployment else 1, holder)] * int(amount))
    out = []
    for node in sorted(allocatable):
        for resource, amount in sorted(allocatable[node].items()):
            if not is_gpu_resource(resource):
                continue
            held = [h for _, h in sorted(holders.get((node, resource), []))]
            out += [GpuAllocation(node, resource, i, held[i] if i < len(held) else None)
                    for i in range(int(amount))]
    return out
