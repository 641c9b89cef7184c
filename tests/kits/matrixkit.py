"""Test kit: the device matrix of issue 28. The fleet's features run in every cell of
{device generation x source} x {driver} x {store}, with the real `margo device run` in its
own process, a real `margo serve` and real engines.

    device = new_device(PARTS.use(tmp_path_factory), cell, "lifecycle", tmp_path)
    device.start()                                  # margo device run, every second
    device.wait_settled(device.deploy())            # the read API: installed, reported since
    device.wait_workloads([Workload("1.0.0", "Hello")])   # what the engine really runs

The cells are data (`ROWS`, `DRIVERS`, `STORES`): a row is one line. `tests/matrix/`
parametrizes each feature module over `selected_cells()`; `KNOWN_DEFECTS` is the one place
where a (feature, row) pair is expected to fail.

The parts (registry, control plane, Docker engine, one server per store) are started on
first use in each test process and shared by its cells (`MatrixParts`); every device gets
its own client, application, chart or package repository, intent and namespace, so cells
sharing a server stay independent.

A staged rollout needs several devices: a mixed fleet (`Mix`, `MixedFleet`,
`mixed_fleets`) is one device of every row on one driver and store, each on an engine of
its own (control plane and Docker engine "slots" of `MatrixParts`), sharing one
`Application` and intent.

This module is the kit's one door; the parts live in kits.matrixcells (the cells, mixes and
their pytest parameters), kits.matrixparts (the shared parts, `FleetHost`), kits.matrixapp
(`Application`, the profiles, `Change`) and kits.matrixdevice (`MatrixDevice`, the mixed
fleets).
"""

from __future__ import annotations

from kits.matrixapp import (
    DEFAULT_CONSTRAINTS,
    GPU_DEPLOYMENT,
    GPU_NODE_CONSTRAINTS,
    Application,
    Change,
    capacity,
)
from kits.matrixcells import (
    CELLS,
    DRIVERS,
    KNOWN_DEFECTS,
    MIXES,
    QUICK,
    QUICK_MIXES,
    ROWS,
    STORES,
    Cell,
    FreshnessNotReached,
    Mix,
    Row,
    cell_params,
    mix_params,
    selected_cells,
)
from kits.matrixdevice import MatrixDevice, MixedFleet, devices, mixed_fleets, new_device
from kits.matrixengines import Workload
from kits.matrixparts import PARTS, FleetHost, MatrixParts

__all__ = ["CELLS", "DEFAULT_CONSTRAINTS", "DRIVERS", "GPU_DEPLOYMENT", "GPU_NODE_CONSTRAINTS",
           "KNOWN_DEFECTS", "MIXES", "PARTS", "QUICK", "QUICK_MIXES", "ROWS", "STORES",
           "Application", "Cell", "Change", "FleetHost", "FreshnessNotReached",
           "MatrixDevice", "MatrixParts", "Mix", "MixedFleet", "Row", "Workload", "capacity",
           "cell_params", "devices", "mix_params", "mixed_fleets", "new_device",
           "selected_cells"]
