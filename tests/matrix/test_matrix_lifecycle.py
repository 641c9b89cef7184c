"""The lifecycle every cell must support: deploy, update to a new application version (a
new chart or Compose package), reconfigure a parameter, delete. Each step is asserted in
the server's read API (the deployment settled, reported after the change) and on the real
engine (what it runs, at which version, with which greeting); what the device adopted is
what the read API names, in the shape of the generation the cell's device speaks."""

from __future__ import annotations

from collections.abc import Callable

from kits.matrixkit import Cell, MatrixDevice, Workload

FEATURE = "lifecycle"


def test_deploy_update_reconfigure_delete(cell: Cell,
                                          matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device()
    device.start()

    [deployed] = device.wait_settled(device.deploy(greeting="Hello"))
    device.wait_workloads([Workload("1.0.0", "Hello")])
    device.assert_served_in_its_generation()

    [updated] = device.wait_settled(device.publish("1.1.0"))
    device.wait_workloads([Workload("1.1.0", "Hello")])

    [reconfigured] = device.wait_settled(device.reconfigure("Servus"))
    device.wait_workloads([Workload("1.1.0", "Servus")])
    device.assert_served_in_its_generation()
    # One deployment throughout: updated and reconfigured in place, never re-created.
    assert deployed["deploymentId"] == updated["deploymentId"] == reconfigured["deploymentId"]
    assert len({deployed["digest"], updated["digest"], reconfigured["digest"]}) == 3

    device.delete()
    device.wait_removed()
    device.wait_workloads([])
