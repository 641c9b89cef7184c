"""Waiting polls (issue 34; docs/server.md, "Waiting polls") in every cell: a device whose
polling interval is far longer than the test learns of each change through the poll the
server holds for it — the rc.3 and the rc.2 State Manifest (signed requests for rc.2), the
Git ref advertisement of an Oct-2024 device — on each driver, on one server and on two
replicas behind the balancer (the poll held by one replica, the compile on either).

Before each change the test waits until the server holds the device's poll, so the change
can only reach the device through that poll: its next scheduled cycle is `INTERVAL` away.
The change must be installed within `PROMPTLY` seconds (a compile, an install with its
readiness wait, two reports); the latency itself is bench/fleet.py's figure.
"""

from __future__ import annotations

from collections.abc import Callable

from kits.matrixkit import Cell, FleetHost, MatrixDevice, MatrixParts, Workload

FEATURE = "waiting"
#: The device's polling interval: longer than any test, so no scheduled cycle comes.
INTERVAL = "3600s"
#: What each poll asks the server to hold it for (the client's default).
WAIT = "60s"
#: Seconds a change may take to be installed through the held poll.
PROMPTLY = 90.0
#: In `make test` (3-7 s a cell): what tests/reconciler/test_waiting_polls.py leaves out (it
#: runs rc.3 and the Git source on the render driver, on both stores): rc.2's signed polls on
#: both stores, each engine, and each engine behind the replicas' balancer.
QUICK = frozenset({"rc2-render-sqlite", "rc2-render-replicas", "rc3-helm-sqlite",
                   "oct2024-compose-sqlite", "oct2024-helm-replicas", "rc2-compose-replicas"})


def test_each_change_arrives_through_the_held_poll(
        cell: Cell, matrix: MatrixParts, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device(schedule={"interval": INTERVAL, "wait": WAIT})
    host = matrix.host(cell.store)
    device.start()

    held(device, host)
    device.wait_settled(device.deploy(greeting="Hello"), timeout=PROMPTLY)
    device.wait_workloads([Workload("1.0.0", "Hello")])

    held(device, host)
    device.wait_settled(device.reconfigure("Servus"), timeout=PROMPTLY)
    device.wait_workloads([Workload("1.0.0", "Servus")])
    device.assert_served_in_its_generation()
    assert "stopped holding polls" not in device.log.read_text(), device.log_tail()


def held(device: MatrixDevice, host: FleetHost) -> None:
    """Until the server (either replica) holds the device's poll: the only device running."""
    device.wait_until("its poll held by the server", lambda: host.held_polls() >= 1,
                      lambda: f"held polls {host.held_polls()}", timeout=30)
