"""Capacity accounting with an upgrade that no longer fits (docs/intents.md, "Capacity
accounting", rule 4): a device reporting 2 cores runs two applications of 1 core each; one
is upgraded to a version needing 1.5 cores. The upgrade is held: the device keeps its file,
the engine keeps running the old version, and the read API, `GET /api/fleet/explain` and
`margo explain --url` say "held for capacity" with the numbers. The other application is
untouched. When the device re-reports more capacity (its capabilities file, or its
cluster's node, now has 4 cores: the client reports a change on its own), the held upgrade
goes through and the engine runs the new version.

Render and Compose devices read a capabilities file (one `cpus` entry); a Helm device
reports what its kwok node has, minus what the pods there request (our two pods request
50m each), so its numbers differ slightly and are matched as numbers, not as text."""

from __future__ import annotations

import re
from collections.abc import Callable

from kits.matrixkit import Cell, MatrixDevice, Workload, capacity

FEATURE = "accounting"
#: In `make test`: the rc.2 row (signed requests; its reports name what was adopted in our
#: extension object).
QUICK = frozenset({"rc2-render-sqlite"})

#: "needs 1.5 cores; the device has 2, of which 1 is assigned to <intent>", any amounts. On a
#: cluster: "needs 1.45 cores; the cluster has 1.9 available, ..." (the new version's demand
#: less what its running pods already request, against what the nodes have left).
HELD = re.compile(r"needs (?P<needs>[\d.]+) cores; the (device|cluster) has (?P<has>[\d.]+)"
                  r"( available)?, of which (?P<assigned>[\d.]+) (is|are) assigned to "
                  r"(?P<other>[a-z0-9-]+)")


def _held_numbers(message: str, other: str) -> None:
    """The message names the other deployment and numbers that do not fit: what the new
    version needs (1.5 cores, less its running pods' requests on a cluster) is at most
    what the device has, but more than what the other deployment leaves of it."""
    numbers = HELD.search(message)
    assert numbers is not None, message
    assert numbers["other"] == other, message
    needs, has, assigned = (float(numbers[k]) for k in ("needs", "has", "assigned"))
    assert 1.4 <= needs <= 1.5 and needs <= has < needs + assigned, message


def test_an_upgrade_that_does_not_fit_is_held_until_the_device_reports_more(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device(constraints=capacity(1))
    other = device.application("b")
    other.publish("1.0.0", constraints=capacity(1))
    device.engine.set_cores(2)
    device.start(cycles=True)
    both = device.deploy(greeting="Hello")
    other.deploy(greeting="Hi")
    device.wait_settled(both, count=2)
    device.wait_workloads([Workload("1.0.0", "Hello"), Workload("1.0.0", "Hi")])
    kept = {d["intent"]: d for d in device.deployments()}

    # 1.5 + 1 cores do not fit in 2: the upgrade is held at 1.0.0.
    upgrade = device.publish("2.0.0", constraints=capacity(1.5))
    held = device.wait_until("the upgrade held for capacity", lambda: (
        (found := device.eligibility(device.intent)) is not None
        and found["status"] == "held for capacity" and found),
        lambda: f"eligibility {device.eligibility(device.intent)}")
    assert held["heldAt"] == "1.0.0", held
    [reason] = [c["message"] for c in held["capacity"]]
    _held_numbers(reason, other.intent)

    # After a compile that saw the new version and a cycle of the device since, nothing
    # moved: the same files, the old version on the engine, the other one untouched.
    device.host.wait_compiled(upgrade.at)
    device.wait_cycles(1, since=len(device.cycles()))
    assert {d["intent"]: d["digest"] for d in device.deployments()} == {
        intent: d["digest"] for intent, d in kept.items()}
    assert device.workloads() == sorted([Workload("1.0.0", "Hello"), Workload("1.0.0", "Hi")])
    explained = device.host.http.get("/api/fleet/explain",
                                     params={"intent": device.intent}).json()
    [entry] = [i for d in explained["devices"] if d["device"] == device.device_id
               for i in d["intents"]]
    assert (entry["status"], entry["heldAt"]) == ("held for capacity", "1.0.0")
    printed = device.host.cli("explain", "--intent", device.intent).stdout
    assert device.device_id in printed and f"{device.intent}: held for capacity" in printed, printed
    [line] = [x for x in printed.splitlines() if "held at 1.0.0: the new version needs" in x]
    _held_numbers(line, other.intent)
    assert "the device keeps running 1.0.0 until 2.0.0 fits" in printed, printed

    # More capacity reported: the held upgrade goes through; the other one stays as it was.
    more = device.change()
    device.engine.set_cores(4)
    upgraded = device.wait_deployment(device.intent, more)
    device.wait_workloads([Workload("2.0.0", "Hello"), Workload("1.0.0", "Hi")])
    assert upgraded["deploymentId"] == kept[device.intent]["deploymentId"]
    assert device.deployment(other.intent)["digest"] == kept[other.intent]["digest"]
    assert device.eligibility(device.intent)["status"] == "eligible"
