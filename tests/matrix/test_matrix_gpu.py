"""A GPU application on the real control plane stays put (issue 28: a placement's own pods
and GPU are released when it is re-checked, so a GPU application no longer evicts itself).

The cluster has a simulated GPU node (kwok: `kits.kubekit.GPU_WORKER`, one
`nvidia.com/gpu`; there is no GPU on this machine, the scheduler and the device's discovery
only see the node's capacity). The profile asks for it with the documented cluster clause
(docs/kubernetes.md) and the chart's pod requests `nvidia.com/gpu: 1`, so once the pod is
scheduled the node has no GPU available, and the device's report says that its own
deployment holds it (`workloads` of the node: the pod's requests). Every compile checks the
placement again, as the cluster would be without it. The test drives three capability
re-reports (the other node's CPU changes by more than the discovery's threshold) and waits,
after each, for the compile that read it and for a full poll cycle of the device; the
deployment must never move: the same id and bytes, no new status in the read API's history,
no new commit on the device's branch, and Helm's release still at revision 1.
tests/matrix/test_matrix_gpu_soak.py holds the same for minutes (`make soak`).

Helm cells only, and not the Oct-2024 row: an Oct-2024 capabilities document has roles and
resources only (reconciler/capabilities.py), so that device reports no cluster data, and a
cluster clause never passes without it (docs/intents.md: absence never passes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kits.matrixengines import HelmView
from kits.matrixkit import (
    GPU_DEPLOYMENT,
    GPU_NODE_CONSTRAINTS,
    Cell,
    MatrixDevice,
    Workload,
)

FEATURE = "gpu"
#: Not in `make test`: the control plane's worker is the longest already.
QUICK: frozenset[str] = frozenset()
RE_REPORTS = 3


def applies(cell: Cell) -> bool:
    return cell.driver == "helm" and cell.row.name != "oct2024"


def test_a_gpu_application_stays_put_through_polls_and_capability_reports(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device, _ = place(matrix_device)
    view = _view(device)
    baseline = _standing(view, device)
    assert baseline["revisions"] == {next(iter(baseline["revisions"])): 1}

    cores, reports, polls = 4.0, 0, 0
    reported = view["reportedAt"]
    for _ in range(RE_REPORTS):
        cores = 6.0 if cores == 4.0 else 4.0
        device.engine.set_cores(cores)
        reported = _wait_report(device, after=reported, cores=cores)
        reports += 1
        device.host.wait_compiled(reported)
        since = len(device.cycles())
        device.wait_cycles(1, since=since + 1)  # one full cycle after the compile
        polls += len(device.cycles()) - since
        assert _standing(_view(device), device) == baseline
    assert reports >= RE_REPORTS and polls >= RE_REPORTS
    assert device.workloads() == [Workload("1.0.0", "Hello")]
    assert device.eligibility(device.intent)["status"] == "eligible"


def place(make: Callable[..., MatrixDevice]) -> tuple[MatrixDevice, dict[str, Any]]:
    """A device (from `make`, a `matrix_device` factory) running the GPU application on a
    cluster with a GPU node: installed, its own pod holding the GPU in the device's report,
    and a quiet cycle since. The device and its deployment as first installed."""
    device = make(constraints=GPU_NODE_CONSTRAINTS, templates={"deployment.yaml": GPU_DEPLOYMENT})
    device.engine.set_gpu(True)
    device.start(cycles=True)
    [deployed] = device.wait_settled(device.deploy())
    device.wait_workloads([Workload("1.0.0", "Hello")])
    # The device's report shows its own pod holding the GPU on the GPU node.
    held = device.wait_until("a report with the pod's GPU under the node's workloads",
                             lambda: _gpu_workload(device, deployed["deploymentId"]),
                             lambda: f"nodes: {_nodes(device)}")
    assert held["requested"]["nvidia.com/gpu"] == 1, held
    device.wait_quiet_cycle()
    return device, deployed


def _wait_report(device: MatrixDevice, *, after: float, cores: float) -> float:
    """Until the server has a capability report received after `after` that reports a node
    with `cores` available; when it was received."""
    def received() -> float | None:
        view = _view(device)
        return view["reportedAt"] if view["reportedAt"] > after and _reports_cores(
            view, cores) else None

    return device.wait_until(f"the server to receive the report of {cores:g} cores",
                             received, lambda: f"cpus {_cpus(_view(device))}")


def _view(device: MatrixDevice) -> dict[str, Any]:
    view = device.view()
    assert view is not None
    return view


def _nodes(device: MatrixDevice) -> list[dict[str, Any]]:
    cluster = _view(device)["capabilities"].get("x-margo-gitops-extensions", {}).get(
        "cluster", {})
    return list(cluster.get("resources", {}).get("nodes", []))


def _gpu_workload(device: MatrixDevice, deployment_id: str) -> dict[str, Any] | None:
    """The GPU node's `workloads` entry of our deployment, when the report has one."""
    for node in _nodes(device):
        for workload in node.get("workloads") or []:
            if workload["deployment"] == deployment_id and \
                    workload.get("requested", {}).get("nvidia.com/gpu"):
                found: dict[str, Any] = {**workload, "node": node["name"]}
                return found
    return None


def _cpus(view: dict[str, Any]) -> list[dict[str, Any]]:
    return list(view["capabilities"].get("properties", {}).get("cpus", []))


def _reports_cores(view: dict[str, Any], cores: float) -> bool:
    return any(c.get("cores") == cores for c in _cpus(view))


def _standing(view: dict[str, Any], device: MatrixDevice) -> dict[str, Any]:
    """What must not move: the deployments (id, bytes, status history), the branch's
    newest commit and Helm's release revisions."""
    return {"deployments": [(d["deploymentId"], d["digest"], d["state"],
                             [(h["state"], h["deviceTime"]) for h in d["statusHistory"]])
                            for d in view["deployments"]],
            "commit": view["history"][0]["commit"],
            "revisions": _helm(device).revisions()}


def _helm(device: MatrixDevice) -> HelmView:
    assert isinstance(device.engine, HelmView)
    return device.engine
