"""A placed deployment is checked as the cluster would be without its own pods, for every
clause: the device-level resources and the cluster clauses and node-level requirements under
`x-margo-gitops-extensions.cluster` alike (issue 28: a GPU application evicted itself on a
real control plane, was placed again and removed again, for ever).

The capability documents are built the way our Kubernetes device client builds them
(`reconciler.kubernetes.cluster_documents` from node facts, with the scheduled pods of each
of our deployments attributed under `workloads`, and every GPU's holder)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from kits.fleetkit import Fleet, app, intent

from compiler.explain import explain_device
from compiler.render import deployment_id
from compiler.snapshot import load_snapshot, snapshot_from_documents
from compiler.source import load_source
from margo.cluster_workloads import with_workload_released, workload_requests
from margo.constraints import EXTENSION, compile_constraints
from margo.constraints.pointers import cluster_of
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.facts import ClusterFacts, GpuFacts, NodeFacts
from reconciler.kubernetes.workloads import GpuAllocation, WorkloadFacts

APP = "com-example-vision"
GPU_CLAUSE = {EXTENSION: {"cluster": {"nodes": [
    {"capacity": {"resources": {"nvidia.com/gpu": 1}}}]}}}
HELM_ONLY = {"greeting": {"value": "hello", "targets": [{"pointer": "config.greeting",
                                                          "components": ["web"]}]}}
GPU = "nvidia.com/gpu"


def worker(*, gpu_pod: str | None = None, cpu: str = "0.5") -> NodeFacts:
    """worker-1: 8 cores, 16Gi and one GPU; `gpu_pod` names the deployment whose scheduled
    pod holds the GPU (and `cpu` cores), None: nothing is scheduled."""
    requested: dict[str, Decimal] = {"cpu": Decimal(0), "memory": Decimal(0), GPU: Decimal(0)}
    workloads: list[WorkloadFacts] = []
    if gpu_pod is not None:
        mine = {"cpu": Decimal(cpu), "memory": Decimal(2**30), GPU: Decimal(1)}
        requested = dict(mine)
        workloads.append(WorkloadFacts(gpu_pod, 1, mine))
    return NodeFacts(
        name="worker-1", roles=("worker",), control_plane=False, ready=True, schedulable=True,
        architecture="amd64", os="linux", kubelet_version="v1.31.2",
        container_runtime="containerd://1.7.22",
        allocatable={"cpu": Decimal(8), "memory": Decimal(16 * 2**30), GPU: Decimal(1)},
        requested=requested, gpus=(GpuFacts(GPU, 1, "NVIDIA", "NVIDIA-L4"),), taints=(),
        zone=None, region=None, labels={}, workloads=tuple(workloads))


def reported(device_id: str, node: NodeFacts) -> dict[str, Any]:
    """The rc.3 capabilities document our device client reports for a one-worker cluster."""
    held = node.workloads[0].deployment if node.workloads else None
    facts = ClusterFacts(
        git_version="v1.31.2", platform="kubeadm",
        api_groups=[{"name": "", "versions": ["v1"]}], crds=[], nodes=[node],
        storage_classes=[], otel_collector=True,
        gpu_allocations=[GpuAllocation(node.name, GPU, 0, held)])
    return capabilities_document(facts, device_id=device_id)


def gpu_fleet(tmp_path: Path) -> Fleet:
    fleet = Fleet(tmp_path)
    fleet.apps[APP] = app(APP, constraints=GPU_CLAUSE, compose=False, parameters=HELM_ONLY)
    fleet.intents["vision"] = intent("vision", APP)
    fleet.devices["plant"] = reported("plant", worker())
    return fleet


def test_a_gpu_application_keeps_the_gpu_its_own_pod_holds(tmp_path: Path) -> None:
    fleet = gpu_fleet(tmp_path)
    report = fleet.compile(now=1_000_000)
    assert not report.errors and "vision.yaml" in fleet.tree("plant")
    placed = fleet.tree("plant")
    # The device's next report: its own pod is scheduled on worker-1 and holds the GPU,
    # "worker-1 has 0 nvidia.com/gpu available".
    fleet.devices["plant"] = reported("plant", worker(gpu_pod=deployment_id("vision", "plant")))
    for step in range(4):
        report = fleet.compile(now=1_000_100 + step)
        assert not report.errors
        assert [c for r in report.results for c in r.changes] == []
        assert fleet.tree("plant") == placed
    fleet.write()
    [explained] = explain_device(load_source(fleet.source), load_snapshot(fleet.caps), "plant",
                                 intent_name="vision", placed={"vision"})
    assert explained.status == "eligible"


def test_a_gpu_someone_else_holds_is_still_taken(tmp_path: Path) -> None:
    """Only the deployment's own pods are given back: another one's GPU stays taken."""
    fleet = gpu_fleet(tmp_path)
    fleet.devices["plant"] = reported("plant", worker(gpu_pod=deployment_id("other", "plant")))
    fleet.compile()
    assert fleet.tree("plant") == {}


def test_the_released_view_gives_back_every_field_the_clauses_read() -> None:
    own = deployment_id("vision", "plant")
    device = snapshot_from_documents({"plant": reported("plant", worker(gpu_pod=own,
                                                                        cpu="1.5"))}
                                     ).devices["plant"]
    body = cluster_of(device.matching)
    assert body is not None
    requests = workload_requests(body)
    assert requests is not None
    released = with_workload_released(device.matching, body, requests[own], own)
    node = cluster_of(released)["resources"]["nodes"][0]  # type: ignore[index]
    assert node["available"][GPU] == 1 and node["available"]["cpu"] == 8
    assert node["requested"][GPU] == 0 and node["requested"]["cpu"] == 0
    assert node["workloads"] == []
    assert released["resources"]["nodes"][0] == node  # the section the view shows directly
    assert [g.get("allocatedTo") for g in released["resources"]["gpus"]] == [None]
    assert released["peripherals"] == [{"type": "gpu", "manufacturer": "NVIDIA",
                                        "model": "NVIDIA-L4"}]
    # A node selector on /requested sees the same release.
    clause = compile_constraints({EXTENSION: {"cluster": {"nodes": [{"selector": {
        "matchExpressions": [{"key": f"/requested/{GPU.replace('/', '~1')}", "operator": "In",
                              "values": [0]}]}}]}}})
    assert not clause.is_eligible(device.matching, device.labels)
    assert clause.is_eligible(released, device.labels)
    # The report itself is left as it was.
    assert cluster_of(device.matching)["resources"]["nodes"][0]["available"][GPU] == 0  # type: ignore[index]
