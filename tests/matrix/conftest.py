"""The device matrix (issue 28, docs/matrix.md): every feature module here is run in each
selected cell of {device generation x source} x {driver} x {store}.

A test that takes `cell` is parametrized over `kits.matrixkit.selected_cells()` (the quick
subset in `make test`, all of them with MARGO_MATRIX=full, `make matrix`). Modules are named
`test_matrix_<feature>.py` (the suite imports test modules by file name, which must be
unique across tests/); the feature name is the module's `FEATURE` (which `KNOWN_DEFECTS` is
keyed by). A module that only makes sense in some cells defines `applies(cell) -> bool`;
one that runs in `make test` in fewer cells than `kits.matrixkit.QUICK` (most should: the
quick subset's time is shared) names them in its own `QUICK`.
`matrix_device()` makes a device of the test's cell; everything it started is stopped when
the test ends. A test that takes `mix` runs over the mixed fleets (one device of every row
on one driver and store: `kits.matrixkit.MIXES`, `make test` runs `QUICK_MIXES` or the
module's `QUICK`), and `mixed_fleet()` makes one.

The shared parts (`kits.matrixkit.PARTS`) are stopped after the last matrix test of the
process, before any other suite starts its own control plane or Docker engine beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.matrixkit import (
    PARTS,
    Cell,
    MatrixDevice,
    MatrixParts,
    Mix,
    MixedFleet,
    cell_params,
    devices,
    mix_params,
    mixed_fleets,
)

HERE = Path(__file__).resolve().parent


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module
    quick = getattr(module, "QUICK", None)  # the module's own share of `make test`
    if "cell" in metafunc.fixturenames:
        metafunc.parametrize("cell", cell_params(feature_of(module),
                                                 getattr(module, "applies", None), quick))
    if "mix" in metafunc.fixturenames:
        metafunc.parametrize("mix", mix_params(feature_of(module), quick))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A feature that runs in no selected cell (the GPU feature outside `make matrix`) is
    deselected, not reported as skipped: nothing is missing from the run it was left
    out of."""
    empty = [item for item in items if HERE in item.path.parents and any(
        str(mark.kwargs.get("reason", "")).startswith("got empty parameter set")
        for mark in item.iter_markers("skip"))]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]


def feature_of(module: Any) -> str:
    """A feature module's name in KNOWN_DEFECTS and in its devices' ids."""
    return str(getattr(module, "FEATURE", module.__name__.rpartition(".")[2]
                       .removeprefix("test_matrix_")))


@pytest.fixture
def matrix(tmp_path_factory: pytest.TempPathFactory) -> MatrixParts:
    """The process's shared parts, started on first use under pytest's temporary folders."""
    return PARTS.use(tmp_path_factory)


@pytest.fixture
def matrix_device(cell: Cell, matrix: MatrixParts, request: pytest.FixtureRequest,
                  tmp_path: Path) -> Iterator[Callable[..., MatrixDevice]]:
    """`matrix_device(name="")`: a new device of the test's cell (its client not started);
    each one is stopped, and its intent, application and workloads removed, afterwards.
    The cell's parts are started here, so a test's call time is the cell's own."""
    matrix.start_for(cell)
    with devices(matrix, cell, feature_of(request.module), tmp_path) as make:
        yield make


@pytest.fixture
def mixed_fleet(mix: Mix, matrix: MatrixParts, request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[Callable[..., MixedFleet]]:
    """`mixed_fleet(name="")`: one device of every row on the test's driver and store, with
    one shared application (version 1.0.0, not deployed); every device is stopped and the
    application, its intent and the workloads removed afterwards. The engines (one per
    device) are started here, so a test's call time is its own."""
    matrix.start_for_mix(mix)
    with mixed_fleets(matrix, mix, feature_of(request.module), tmp_path) as make:
        yield make


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the test's own teardown: stop the shared parts when no matrix test follows."""
    result = yield
    if nextitem is None or HERE not in nextitem.path.parents:
        PARTS.close()
    return result
