"""The device matrix (issue 28, docs/matrix.md): every feature module here is run in each
selected cell of {device generation x source} x {driver} x {store}.

A test that takes `cell` is parametrized over `kits.matrixkit.selected_cells()` (the quick
subset in `make test`, all of them with MARGO_MATRIX=full, `make matrix`). Modules are named
`test_matrix_<feature>.py` (the suite imports test modules by file name, which must be
unique across tests/); the feature name is the module's `FEATURE` (which `KNOWN_DEFECTS` is
keyed by). A module that only makes sense in some cells defines `applies(cell) -> bool`.
`matrix_device()` makes a device of the test's cell; everything it started is stopped when
the test ends.

The shared parts (`kits.matrixkit.PARTS`) are stopped after the last matrix test of the
process, before any other suite starts its own control plane or Docker engine beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.matrixkit import PARTS, Cell, MatrixDevice, MatrixParts, cell_params, devices

HERE = Path(__file__).resolve().parent


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        metafunc.parametrize("cell", cell_params(feature_of(metafunc.module),
                                                 getattr(metafunc.module, "applies", None)))


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the test's own teardown: stop the shared parts when no matrix test follows."""
    result = yield
    if nextitem is None or HERE not in nextitem.path.parents:
        PARTS.close()
    return result
