"""A change of the running version's profile requirements alone (its `deviceConstraints`:
cpu cores 0.5 -> 0.25) gives the device new bytes with nothing to apply. The device must
still report for them (docs/device.md, "Reports settle every change"), or the server
never learns that it runs them: freshness would stay `pending` and a rollout's canary
would go stale. Asserted in the read API (a report after the change, about the new bytes;
freshness `current`) and on the engine (the same workload, never applied again: the
render ledger's revision, Helm's release revision, the container's id and start time)."""

from __future__ import annotations

from collections.abc import Callable

from kits.matrixkit import Cell, MatrixDevice, Workload, capacity
from kits.serverkit import assert_deployment_in_generation

FEATURE = "capacity-only"
#: In `make test`: the Git row (its adoption goes through the device's branch).
QUICK = frozenset({"oct2024-render-sqlite"})


def test_a_capacity_only_change_settles_with_no_step_on_the_device(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device()
    device.start(cycles=True)
    # Oct-2024 documents have no place for constraints (a change of them alone changes no
    # byte there): the Git row's device is given rc.3 documents, which our client reads,
    # by the intent's outputShape (issue 33: an intent can force a shape).
    forced = {"outputShape": "rc.3"} if cell.row.api == "oct-2024" else {}
    [deployed] = device.wait_settled(device.deploy(**forced))
    running = device.wait_workloads([Workload("1.0.0", "Hello")])
    cycles_before = device.wait_quiet_cycle()  # the install's cycle is over
    applied = device.engine.fingerprint()

    change = device.set_constraints(capacity(0.25))
    [settled] = device.wait_settled(change)

    # New bytes of the same deployment, reported on by the device since the change, and
    # only as installed: nothing was installing meanwhile.
    assert settled["deploymentId"] == deployed["deploymentId"]
    assert settled["digest"] != deployed["digest"]
    assert settled["applied"]["digest"] == settled["digest"] and settled["applied"]["current"]
    since = [entry["state"] for entry in settled["statusHistory"]
             if entry["reportedAt"] >= change.at]
    assert since and set(since) == {"installed"}, settled["statusHistory"]
    device.wait_freshness("current")
    for data in device.adopted_documents().values():
        assert_deployment_in_generation(forced.get("outputShape", cell.row.api), data)

    # The device adopted the new bytes and took no step for them; the engine runs the same
    # workload, applied no further time.
    cycles = device.cycles()[cycles_before:]
    assert any(c["fetched"] == "adopted" for c in cycles), cycles
    assert [c["steps"] for c in cycles if c["steps"]] == [], (cycles, device.log_tail())
    assert device.workloads() == running
    assert device.engine.fingerprint() == applied
