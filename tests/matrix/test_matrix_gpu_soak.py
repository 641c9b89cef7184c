"""Soak: the GPU feature (test_matrix_gpu.py) held over wall time (issue 28: a placement's
own pods and GPU are released when it is re-checked, so it never evicts itself).

    make soak                                   # 10 minutes, rc3-helm-sqlite
    make soak SOAK_MINUTES=1 SOAK_EVERY=10 SOAK_CELLS=rc2-helm-replicas

Only when `MARGO_SOAK_MINUTES` is set (`make soak` sets it from `SOAK_MINUTES`): without it
the module runs in no cell and is deselected, in `make test` and `make matrix` alike. The
cells are those of `MARGO_SOAK_CELLS` (a comma-separated list, default rc3-helm-sqlite;
every Helm cell but the Oct-2024 row's with MARGO_MATRIX=full), each soaked in turn.

The device is placed as in the GPU feature (the real `margo device run` of the cell's row
polling every second, Helm on the control plane from tools/kube with a simulated GPU node,
the profile asking for a node with a GPU available and the pod requesting it); then every
`MARGO_SOAK_EVERY` seconds (default 20) the other node's CPU changes (4 <-> 6 cores), which
the device's Kubernetes discovery re-reports and the server compiles again. The read API
and Helm's records are sampled once a second; the figures are printed (`make soak` runs
pytest with `-s`), and then asserted over the counted events: the deployment held for the
whole soak (never gone from the branch, never back, no `removing`/`removed` and no new
`installing` in its status history, the same id and bytes), no new commit on the device's
branch, Helm's release still at revision 1, and the soak did what it says (the changes were
reported, the device polled).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kits.matrixkit import CELLS, Cell, MatrixDevice, MatrixParts, devices
from test_matrix_gpu import _helm, place

FEATURE = "gpusoak"
#: The cells the soak runs in without MARGO_MATRIX=full.
QUICK: frozenset[str] = frozenset(
    os.environ.get("MARGO_SOAK_CELLS", "rc3-helm-sqlite").split(","))
if QUICK - {c.id for c in CELLS}:
    raise ValueError(f"MARGO_SOAK_CELLS: no cell {sorted(QUICK - {c.id for c in CELLS})}")


def _minutes() -> float | None:
    value = os.environ.get("MARGO_SOAK_MINUTES", "").strip()
    return float(value) if value else None


def applies(cell: Cell) -> bool:
    """Only when a soak is asked for; Helm cells of the rows that report cluster data (the
    GPU feature's own `applies`)."""
    return _minutes() is not None and cell.driver == "helm" and cell.row.name != "oct2024"


@dataclass
class Soak:
    """What the samples counted since the soak began (`t0`: the server's clock, seconds)."""

    deployment_id: str
    digest: str
    commit: str
    t0: float
    started: float = field(default_factory=time.monotonic)
    reports: set[float] = field(default_factory=set)
    compiles: set[float] = field(default_factory=set)
    events: set[tuple[str, float]] = field(default_factory=set)  # (state, reportedAt)
    commits: set[str] = field(default_factory=set)
    present: bool = True
    went: int = 0
    came_back: int = 0
    moved_at: float | None = None
    changes: int = 0

    def sample(self, device: MatrixDevice) -> None:
        """One look at the read API: reports, compiles, the deployment's status history,
        whether it is still the one first installed, the branch's newest commit."""
        view = device.view() or {}
        if view.get("reportedAt", 0) > self.t0:
            self.reports.add(view["reportedAt"])
        compiled = device.host.compiled_at()
        if compiled > self.t0:
            self.compiles.add(compiled)
        if view.get("history"):
            self.commits.add(view["history"][0]["commit"])
        found = [d for d in view.get("deployments", []) if d["intent"] == device.intent]
        for d in found:
            self.events |= {(h["state"], h["reportedAt"]) for h in d["statusHistory"]
                            if h["reportedAt"] > self.t0}
        present = bool(found) and found[0]["deploymentId"] == self.deployment_id
        if self.present and not present:
            self.went += 1
        if present and not self.present:
            self.came_back += 1
        self.present = present
        if self.moved_at is None and (not present or found[0]["digest"] != self.digest
                                      or any(s != "installed" for s, _ in self.events)):
            self.moved_at = time.monotonic()

    def count(self, *states: str) -> int:
        return sum(1 for s, _ in self.events if s in states)

    def held_minutes(self) -> float:
        """How long the deployment stayed as first installed: until it first moved, or
        until now."""
        return ((self.moved_at or time.monotonic()) - self.started) / 60


def test_a_gpu_application_stays_put_for_the_whole_soak(
        cell: Cell, matrix: MatrixParts, tmp_path: Path) -> None:
    minutes = _minutes()
    assert minutes is not None  # `applies`
    every = float(os.environ.get("MARGO_SOAK_EVERY", "20"))
    began = time.monotonic()
    matrix.start_for(cell)
    print(f"\n{cell}: parts started in {time.monotonic() - began:.1f} s "
          f"(control plane, registry, {cell.store} server)", flush=True)
    with devices(matrix, cell, FEATURE, tmp_path) as make:
        soak(make, minutes, every)


def soak(make: Callable[..., MatrixDevice], minutes: float, every: float) -> None:
    began = time.monotonic()
    device, deployed = place(make)
    print(f"installed in {time.monotonic() - began:.1f} s (its pod holding the GPU in the "
          f"device's report, a quiet cycle since); soaking {minutes:g} min", flush=True)
    engine = _helm(device)
    view = device.view()
    assert view is not None
    counted = Soak(deployed["deploymentId"], deployed["digest"], view["history"][0]["commit"],
                   t0=time.time())
    cycles0 = len(device.cycles())
    end = counted.started + minutes * 60
    cores, next_change = 4.0, counted.started + every
    while time.monotonic() < end:
        counted.sample(device)
        if time.monotonic() >= next_change:
            cores = 6.0 if cores == 4.0 else 4.0
            engine.set_cores(cores)
            counted.changes += 1
            next_change += every
        time.sleep(1.0)  # a soak samples over wall time
    counted.sample(device)
    revisions = engine.revisions()
    polls = len(device.cycles()) - cycles0
    removes, installs = counted.count("removing", "removed"), counted.count("installing")
    new_commits = len(counted.commits - {counted.commit})
    print(f"minutes held: {counted.held_minutes():.1f} of {minutes:g}")
    print(f"removes: {removes} removing/removed reports, {counted.went} time(s) gone from "
          "the branch")
    print(f"re-adds: {counted.came_back} time(s) back on the branch, {installs} new installs")
    print(f"new commits on the device's branch: {new_commits}")
    print("release revision: " + (", ".join(f"{n} {r}" for n, r in revisions.items())
                                  or "none (uninstalled at the end)"))
    print(f"capability reports seen: {len(counted.reports)} ({counted.changes} changes, one "
          f"every {every:g} s)")
    print(f"compiles seen (sampled once a second): {len(counted.compiles)}")
    print(f"device poll cycles: {polls}", flush=True)

    assert counted.moved_at is None, _events(counted)
    assert (removes, installs, counted.went, counted.came_back) == (0, 0, 0, 0), \
        _events(counted)
    assert new_commits == 0, counted.commits
    assert list(revisions.values()) == [1], revisions
    # The soak did what it says: the changes reached the server (the last one may still be
    # on its way) and the device kept polling.
    assert len(counted.reports) >= counted.changes - 1, (counted.reports, counted.changes)
    assert polls >= 1
    assert device.eligibility(device.intent)["status"] == "eligible"


def _events(counted: Soak) -> list[tuple[str, float]]:
    """The status history since the soak began, in order (for a failure's message)."""
    return sorted(counted.events, key=lambda e: e[1])
