"""Test kit: the device matrix's cells (issue 28) — rows, drivers, stores, the mixed
fleets, which of them `make test` runs (`QUICK`, `QUICK_MIXES`) and the known defects — as
pytest parameters. The rest of the matrix kit: kits.matrixparts, kits.matrixapp,
kits.matrixdevice; kits.matrixkit is the one door to all of it."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
#: Seconds a cell may take to settle after a change (installs wait for readiness).
SETTLE = 120.0

# --- the cells ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """A kind of device: the API generation it speaks, where it reads its desired state
    and how it proves who it is (the `server:`, `source:` and `identity:` sections)."""

    name: str      # in test ids and device ids
    api: str       # server.api: rc.3 | rc.2 | oct-2024
    source: str    # source.type: margo-rest | git
    identity: str  # "token": a per-device client's bearer token (REST) or Git token; "rc2"
    title: str


ROWS: tuple[Row, ...] = (
    Row("rc3", "rc.3", "margo-rest", "token", "rc.3 API, margo-rest source, bearer token"),
    Row("rc2", "rc.2", "margo-rest", "rc2", "rc.2 API, margo-rest source, signed requests"),
    Row("oct2024", "oct-2024", "git", "token",
        "Oct-2024 API (Preview Release 1), git source, per-device token"),
)
DRIVERS: tuple[str, ...] = ("render", "helm", "compose")
#: sqlite: one `margo serve`; replicas: two on one PostgreSQL database behind the
#: round-robin test balancer (kits.serverkit, kits.balancer).
STORES: tuple[str, ...] = ("sqlite", "replicas")


@dataclass(frozen=True)
class Cell:
    row: Row
    driver: str
    store: str

    @property
    def id(self) -> str:
        return f"{self.row.name}-{self.driver}-{self.store}"

    def __str__(self) -> str:
        return self.id


CELLS: tuple[Cell, ...] = tuple(Cell(row, driver, store)
                                for row in ROWS for driver in DRIVERS for store in STORES)
#: The cells `make test` runs: every row on render, another row on each engine, and the
#: replica cell no other suite covers (rc.2 signatures through a per-request balancer);
#: `make matrix` (MARGO_MATRIX=full) runs all of CELLS. docs/matrix.md has the table.
QUICK: frozenset[str] = frozenset({
    "rc3-render-sqlite", "rc2-render-sqlite", "oct2024-render-sqlite",
    "rc3-helm-sqlite", "oct2024-compose-sqlite", "rc2-render-replicas"})

class FreshnessNotReached(AssertionError):
    """`MatrixDevice.wait_freshness` timed out: the one failure the freshness marks below
    expect (a device that never installed fails its test as usual)."""


#: Checks known to fail in some rows today, as (feature module, row name) -> a strict
#: xfail mark (raising `FreshnessNotReached` or another specific error), in this one place.
#: Delete a line when its fix lands: a fixed defect fails the run until its line goes.
#: (The freshness of rc.2 and Oct-2024 devices, issue 28's first defect, was the first.)
KNOWN_DEFECTS: dict[tuple[str, str], pytest.MarkDecorator] = {}

#: Cells on a machine-wide part run on one pytest-xdist worker, in the groups
#: tests/conftest.py (`_ONE_WORKER`) gives the tests of that part.
_ENGINE_GROUPS = {"helm": "kubernetes", "compose": "docker"}


def _full() -> bool:
    mode = os.environ.get("MARGO_MATRIX", "quick")
    if mode not in ("quick", "full"):
        raise ValueError(f"MARGO_MATRIX must be quick or full, not {mode!r}")
    return mode == "full"


def selected_cells(quick: Collection[str] | None = None) -> tuple[Cell, ...]:
    """Every cell with MARGO_MATRIX=full (`make matrix`), else the `QUICK` ones (or those
    of `quick`: a feature module's own, smaller share of `make test`)."""
    chosen = QUICK if quick is None else quick
    return CELLS if _full() else tuple(c for c in CELLS if c.id in chosen)


def cell_params(feature: str, applies: Callable[[Cell], bool] | None = None,
                quick: Collection[str] | None = None) -> list[Any]:
    """The selected cells a feature runs in, as pytest params with their marks: the
    engine's worker group and the feature's known defects. `quick`: the cells the feature
    runs in `make test` (default `QUICK`)."""
    params = []
    for cell in selected_cells(quick):
        if applies is not None and not applies(cell):
            continue
        marks = [pytest.mark.xdist_group(_ENGINE_GROUPS[cell.driver])] \
            if cell.driver in _ENGINE_GROUPS else []
        if (feature, cell.row.name) in KNOWN_DEFECTS:
            marks.append(KNOWN_DEFECTS[(feature, cell.row.name)])
        params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


@dataclass(frozen=True)
class Mix:
    """A mixed fleet's column: one device of every row (`ROWS`) on one driver and store,
    sharing one application and intent (a staged rollout needs several devices)."""

    driver: str
    store: str

    @property
    def id(self) -> str:
        return f"{self.driver}-{self.store}"

    @property
    def cells(self) -> tuple[Cell, ...]:
        return tuple(Cell(row, self.driver, self.store) for row in ROWS)

    def __str__(self) -> str:
        return self.id


MIXES: tuple[Mix, ...] = tuple(Mix(driver, store) for driver in DRIVERS for store in STORES)
#: The mixed fleets `make test` runs (`make matrix`: all of MIXES).
QUICK_MIXES: frozenset[str] = frozenset({"render-sqlite"})


def mix_params(feature: str, quick: Collection[str] | None = None) -> list[Any]:
    """The selected mixed fleets a feature runs on, as pytest params with the engine's
    worker group and the feature's known defects (keyed by (feature, "mixed"))."""
    chosen = QUICK_MIXES if quick is None else quick
    params = []
    for mix in MIXES:
        if not _full() and mix.id not in chosen:
            continue
        marks = [pytest.mark.xdist_group(_ENGINE_GROUPS[mix.driver])] \
            if mix.driver in _ENGINE_GROUPS else []
        if (feature, "mixed") in KNOWN_DEFECTS:
            marks.append(KNOWN_DEFECTS[(feature, "mixed")])
        params.append(pytest.param(mix, id=mix.id, marks=marks))
    return params
