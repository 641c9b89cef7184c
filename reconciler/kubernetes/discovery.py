"""What a Kubernetes cluster offers, read from its API with read-only rights.

`discover(client)` reads /version, /api, /apis, CRDs, nodes, the pods scheduled on them (and,
as metadata, their owners and Helm's release records, to tell which are our deployments':
`workloads`), the storage, ingress and runtime classes, DaemonSets (to find an OpenTelemetry
collector) and the Helm engine's version, into `ClusterFacts` (parsed by `facts`). Every
read except /version may fail on its own (RBAC forbids it, the API is not served): the
failure is recorded in `unknown` with its reason and the fact stays absent, because a report
that claims what it could not see would place workloads where they cannot run. /version is
the reachability probe; when it fails the whole discovery fails, and so does any read that
finds the server gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from reconciler.kubernetes.client import KubeClient, KubeError
from reconciler.kubernetes.facts import (
    ClusterFacts,
    NodeFacts,
    _crd,
    _group_versions,
    _ingress_class,
    _name,
    _requests_by_node,
    _runtime_class,
    _sorted_by_name,
    _storage_class,
    collector_verdict,
    guess_platform,
    node_facts,
)
from reconciler.kubernetes.workloads import (
    RELEASE_RECORDS,
    Ownership,
    attribute,
    gpu_allocations,
)

__all__ = ["discover", "helm_engine_version"]


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

def _read_nodes(client: KubeClient,
                facts: ClusterFacts) -> tuple[list[NodeFacts] | None, list[dict[str, Any]]]:
    """The nodes (None when unreadable) and their raw labels (for the platform guess);
    with the pods, what they request and which of them are our deployments'."""
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
    if pods is not None:
        ownership = _read_ownership(client, facts)
        if ownership is not None:
            by_node = attribute(pods, ownership)
            nodes = [dataclasses.replace(n, workloads=by_node.get(n.name, ())) for n in nodes]
        facts.gpu_allocations = gpu_allocations(
            pods, ownership, {n.name: n.allocatable for n in nodes})
    labels = [dict((i.get("metadata") or {}).get("labels") or {}) for i in items]
    return sorted(nodes, key=lambda n: n.name), labels


#: The owners a pod is traced through, and the kinds Helm annotates with their release.
_OWNER_LISTS = {"ReplicaSet": "/apis/apps/v1/replicasets", "Job": "/apis/batch/v1/jobs"}
_TOP_LISTS = {"Deployment": "/apis/apps/v1/deployments",
              "StatefulSet": "/apis/apps/v1/statefulsets",
              "DaemonSet": "/apis/apps/v1/daemonsets", "CronJob": "/apis/batch/v1/cronjobs",
              "Job": "/apis/batch/v1/jobs"}


def _read_ownership(client: KubeClient, facts: ClusterFacts) -> Ownership | None:
    """What traces pods to our deployments (metadata only), or None when some of it cannot
    be read: then no node says whose pods it runs, and the server counts ours in full."""
    what = "resources.nodes.workloads"
    lists: dict[str, list[dict[str, Any]]] = {}
    for path in sorted({*_OWNER_LISTS.values(), *_TOP_LISTS.values()}):
        found = _attempt(facts, what,
                         lambda p=path: client.list(p, metadata_only=True))  # type: ignore[misc]
        if found is None:
            return None
        lists[path] = found
    records = _attempt(facts, what, lambda: client.list(
        "/api/v1/secrets", {"labelSelector": RELEASE_RECORDS}, metadata_only=True))
    if records is None:
        return None
    return Ownership(replicasets=lists[_OWNER_LISTS["ReplicaSet"]],
                     jobs=lists[_OWNER_LISTS["Job"]],
                     workloads={kind: lists[path] for kind, path in _TOP_LISTS.items()},
                     releases=records)

def _read_classes(client: KubeClient, facts: ClusterFacts, key: str, path: str,
                  shape: Callable[[Mapping[str, Any]], dict[str, Any]],
                  ) -> list[dict[str, Any]] | None:
    items = _attempt(facts, f"capabilities.{key}", lambda: client.list(path))
    return None if items is None else _sorted_by_name([shape(i) for i in items])

def _read_otel(client: KubeClient, facts: ClusterFacts) -> bool | None:
    """A collector (a DaemonSet Ready on every schedulable node, or a Deployment with a
    ready replica) that a Service exposes on an OTLP port: what workloads are pointed at.
    `facts.otel_collector_detail` says what was found or what is missing."""
    what = "capabilities.otelCollector"
    if facts.nodes is None:
        facts.note_unknown(what, "nodes could not be read, so collector coverage cannot be "
                                 "checked")
        return None
    daemonsets = _attempt(facts, what, lambda: client.list("/apis/apps/v1/daemonsets"))
    deployments = _attempt(facts, what, lambda: client.list("/apis/apps/v1/deployments"))
    services = _attempt(facts, what, lambda: client.list("/api/v1/services"))
    if daemonsets is None or deployments is None or services is None:
        return None
    placeable = sum(1 for n in facts.nodes if n.ready and n.schedulable)
    found, detail = collector_verdict(daemonsets, deployments, services, placeable)
    facts.otel_collector_detail = detail
    return found

def helm_engine_version() -> str:
    from reconciler.helm_engine import helm as helm_python  # 80 MB of Go: only when needed

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
