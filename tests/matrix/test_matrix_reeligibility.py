"""Eligibility follows what the device re-reports (docs/intents.md, `gracePeriod`): an
intent whose profile requires a GPU runs on a device that reports one; the device stops
reporting it (render, Compose: its capabilities file loses the peripheral; Helm: the
cluster's GPU node goes, and the client's Kubernetes discovery reports that; the GPU
is a simulated kwok node, there is no GPU here). The deployment is kept for the grace
period (the read API explains it as "grace period" while the device's branch still holds
it), then removed from the branch and from the engine, and never before the grace period
has passed since the report. When the device reports the GPU again, the deployment comes
back, on the engine too."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kits.matrixkit import Cell, MatrixDevice, Workload, capacity

FEATURE = "reeligibility"
#: In `make test`: the rc.3 row.
QUICK = frozenset({"rc3-render-sqlite"})

GRACE_SECONDS = 8
#: The spec's GPU rule: some peripheral of type gpu (docs/intents.md counts it as one GPU).
NEEDS_A_GPU = capacity(0.5, eligibilityRules=[{"propertySelector": {"matchExpressions": [{
    "key": "/peripherals", "operator": "ContainsAll",
    "itemSelector": {"matchExpressions": [{"key": "/type", "operator": "In",
                                           "values": ["gpu"]}]}}]}}])


def test_a_deployment_leaves_after_its_grace_period_and_returns_with_the_capability(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device(constraints=NEEDS_A_GPU)
    device.engine.set_gpu(True)
    device.start()
    [deployed] = device.wait_settled(device.deploy(gracePeriod=f"{GRACE_SECONDS}s"))
    device.wait_workloads([Workload("1.0.0", "Hello")])
    reported = _view(device)["reportedAt"]

    # The GPU goes: once the server has the report, the deployment is kept for the grace
    # period, explained as such in the same answer that still lists it.
    device.engine.set_gpu(False)

    def in_grace() -> dict[str, Any] | None:
        view = _view(device)
        explained = next(e for e in view["eligibility"] if e["intent"] == device.intent)
        return view if (view["reportedAt"] > reported and view["deployments"]
                        and explained["status"] == "grace period") else None

    graced = device.wait_until("the deployment kept for its grace period", in_grace,
                               lambda: f"eligibility {device.eligibility(device.intent)}")
    lost_at = graced["reportedAt"]  # when the server received the report without the GPU
    assert [d["deploymentId"] for d in graced["deployments"]] == [deployed["deploymentId"]]

    device.wait_removed()
    device.wait_workloads([])
    removal = _view(device)["history"][0]
    assert device.intent in removal["message"], removal
    # Git's commit time has whole seconds: the removal came no earlier than the grace
    # period after the report (a lower bound the server must keep, not a measurement).
    assert removal["time"] >= math.floor(lost_at + GRACE_SECONDS) - 1, (removal, lost_at)
    assert device.eligibility(device.intent)["status"] == "not eligible"

    # The GPU is back: so is the deployment, on the engine too.
    back = device.change()
    device.engine.set_gpu(True)
    [returned] = device.wait_settled(back)
    device.wait_workloads([Workload("1.0.0", "Hello")])
    assert returned["digest"] == deployed["digest"]  # the same bytes as before
    assert device.eligibility(device.intent)["status"] == "eligible"


def _view(device: MatrixDevice) -> dict[str, Any]:
    view = device.view()
    assert view is not None
    return view
