"""Tracing pods to our deployments (`reconciler.kubernetes.workloads`), on metadata shaped as
the API server returns it; the real control plane's own run is in test_cluster_real_e2e."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from reconciler.kubernetes.provider import significant_change
from reconciler.kubernetes.workloads import (
    GpuAllocation,
    Ownership,
    attribute,
    gpu_allocations,
)
from reconciler.releases import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER


def meta(name: str, namespace: str = "apps", *, owner: tuple[str, str] | None = None,
         release: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner is not None:
        metadata["ownerReferences"] = [
            {"kind": "Other", "name": "not-the-controller"},
            {"kind": owner[0], "name": owner[1], "controller": True}]
    if release is not None:
        metadata["annotations"] = {"meta.helm.sh/release-name": release,
                                   "meta.helm.sh/release-namespace": namespace}
    if labels is not None:
        metadata["labels"] = labels
    return {"metadata": metadata}


def pod(name: str, *, node: str | None = "n1", cpu: str = "250m", gpus: int = 0,
        phase: str = "Running", **metadata: Any) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": cpu, "memory": "64Mi"}
    if gpus:
        requests["nvidia.com/gpu"] = str(gpus)
    doc = meta(name, **metadata)
    doc["spec"] = {"containers": [{"name": "c", "resources": {"requests": requests}}]}
    if node:
        doc["spec"]["nodeName"] = node
    doc["status"] = {"phase": phase}
    return doc


def record(release: str, deployment: str, namespace: str = "apps") -> dict[str, Any]:
    return meta(f"sh.helm.release.v1.{release}.v1", namespace, labels={
        "name": release, "owner": "helm", LABEL_MANAGED_BY: MANAGER,
        LABEL_DEPLOYMENT: deployment})


OWNERSHIP = Ownership(
    replicasets=[meta("web-5d8f", owner=("Deployment", "web"))],
    jobs=[meta("nightly-29000", owner=("CronJob", "nightly")), meta("once")],
    workloads={"Deployment": [meta("web", release="web-abc")],
               "StatefulSet": [meta("db", release="db-def")],
               "DaemonSet": [meta("agent", release="foreign")],  # not a release of ours
               "CronJob": [meta("nightly", release="web-abc")],
               "Job": [meta("once", release="db-def")]},
    releases=[record("web-abc", "dep-web"), record("db-def", "dep-db")])


def test_pods_are_traced_through_their_owners_to_the_release() -> None:
    cases = {
        "web-5d8f-x": ("ReplicaSet", "web-5d8f"),  # Pod -> ReplicaSet -> Deployment
        "db-0": ("StatefulSet", "db"),
        "nightly-29000-y": ("Job", "nightly-29000"),  # Pod -> Job -> CronJob
        "once-z": ("Job", "once"),
        "agent-q": ("DaemonSet", "agent"),
        "stray": ("ReplicaSet", "unknown-rs"),
    }
    found = {name: OWNERSHIP.deployment_of(pod(name, owner=owner))
             for name, owner in cases.items()}
    assert found == {"web-5d8f-x": "dep-web", "db-0": "dep-db", "nightly-29000-y": "dep-web",
                     "once-z": "dep-db", "agent-q": None, "stray": None}
    # A bare pod of a release carries Helm's annotations itself.
    assert OWNERSHIP.deployment_of(pod("bare", release="db-def")) == "dep-db"
    # The same names in another namespace are someone else's.
    assert OWNERSHIP.deployment_of(pod("web-5d8f-x", namespace="other",
                                       owner=("ReplicaSet", "web-5d8f"))) is None


def test_only_scheduled_running_pods_count_per_node() -> None:
    pods = [pod("web-5d8f-1", owner=("ReplicaSet", "web-5d8f")),
            pod("web-5d8f-2", owner=("ReplicaSet", "web-5d8f"), cpu="500m"),
            pod("web-5d8f-3", owner=("ReplicaSet", "web-5d8f"), node="n2"),
            pod("web-5d8f-4", owner=("ReplicaSet", "web-5d8f"), node=None),  # pending
            pod("db-0", owner=("StatefulSet", "db"), phase="Succeeded"),
            pod("agent-q", owner=("DaemonSet", "agent"))]
    by_node = attribute(pods, OWNERSHIP)
    assert {n: [(w.deployment, w.pods, w.requested["cpu"]) for w in ws]
            for n, ws in by_node.items()} == {
        "n1": [("dep-web", 2, Decimal("0.75"))], "n2": [("dep-web", 1, Decimal("0.25"))]}


def test_every_gpu_is_listed_with_its_holder_in_a_stable_order() -> None:
    pods = [pod("zz-foreign", gpus=1), pod("web-5d8f-1", owner=("ReplicaSet", "web-5d8f"),
                                           gpus=1)]
    allocatable = {"n1": {"cpu": Decimal(8), "nvidia.com/gpu": Decimal(3)},
                   "n2": {"cpu": Decimal(4)}}
    expected = [GpuAllocation("n1", "nvidia.com/gpu", 0, "dep-web"),
                GpuAllocation("n1", "nvidia.com/gpu", 1, "pod:apps/zz-foreign"),
                GpuAllocation("n1", "nvidia.com/gpu", 2, None)]
    assert gpu_allocations(pods, OWNERSHIP, allocatable) == expected
    assert gpu_allocations(list(reversed(pods)), OWNERSHIP, allocatable) == expected
    # Without ownership (it could not be read) every holder is named by its pod.
    assert [a.holder for a in gpu_allocations(pods, None, allocatable)] == [
        "pod:apps/web-5d8f-1", "pod:apps/zz-foreign", None]


def test_pod_churn_of_a_deployment_is_no_change_but_a_new_deployment_is() -> None:
    def doc(workloads: list[dict[str, Any]]) -> dict[str, Any]:
        return {"properties": {"id": "k"}, "x-margo-gitops-extensions": {"cluster": {
            "resources": {"nodes": [{"name": "n1", "allocatable": {"cpu": 8},
                                     "available": {"cpu": 4}, "workloads": workloads}]}}}}

    one = doc([{"deployment": "dep-web", "pods": 2, "requested": {"cpu": 1}}])
    surged = doc([{"deployment": "dep-web", "pods": 3, "requested": {"cpu": 1.5}}])
    two = doc([{"deployment": "dep-web", "pods": 2, "requested": {"cpu": 1}},
               {"deployment": "dep-db", "pods": 1, "requested": {"cpu": 1}}])
    assert not significant_change(one, surged)
    assert significant_change(one, two)
