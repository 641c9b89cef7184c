"""Soak: a GPU application on the real control plane, for minutes (issue 28: a placement's
own pods and GPU are released when it is re-checked, so it never evicts itself).

    .venv/bin/python bench/gpu_soak.py [--minutes 10] [--row rc3] [--store sqlite]
                                       [--every 20]

The device matrix's GPU feature (tests/matrix/test_matrix_gpu.py), held for as long as
asked: the real `margo device run` (its row: rc3 or rc2; an Oct-2024 device reports no
cluster data) polling every second, Helm on the control plane from tools/kube with a
simulated GPU node (kwok: there is no GPU here), a real `margo serve` (SQLite, or two
replicas on PostgreSQL) and an application whose profile asks for a node with a GPU
available and whose pod requests it. Every `--every` seconds the other node's CPU changes
(4 <-> 6 cores), which the device's Kubernetes discovery re-reports and the server compiles
again. The run samples the read API and Helm's records once a second and prints:

* minutes held: how long the deployment stayed as first installed (until the first
  removal, or the whole run);
* removes and re-adds: `removing`/`removed` reports and deployments that went and came
  back, and new installs (the status history's `installing` after the start);
* the Helm release's revision at the end (1: never applied again);
* capability reports the server received, compiles it finished, the device's poll cycles.

A soak observes over wall time; it asserts nothing (the test does, over counted events).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repository's tools/ and test kits

from kits.matrixengines import HelmView  # noqa: E402
from kits.matrixkit import (  # noqa: E402
    GPU_DEPLOYMENT,
    GPU_NODE_CONSTRAINTS,
    ROWS,
    Cell,
    MatrixDevice,
    MatrixParts,
    Workload,
    devices,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--row", choices=["rc3", "rc2"], default="rc3")
    parser.add_argument("--store", choices=["sqlite", "replicas"], default="sqlite")
    parser.add_argument("--every", type=float, default=20.0,
                        help="seconds between capability changes (default 20)")
    args = parser.parse_args()
    row = next(r for r in ROWS if r.name == args.row)
    cell = Cell(row, "helm", args.store)

    with tempfile.TemporaryDirectory(prefix="margo-gpu-soak-") as scratch:
        work = Path(scratch)
        parts = MatrixParts().use_directory(work)
        try:
            started = time.monotonic()
            parts.start_for(cell)
            print(f"parts started in {time.monotonic() - started:.1f} s "
                  f"(control plane, registry, {args.store} server)", flush=True)
            with devices(parts, cell, "gpusoak", work) as make:
                device = make(constraints=GPU_NODE_CONSTRAINTS,
                              templates={"deployment.yaml": GPU_DEPLOYMENT})
                soak(device, args.minutes, args.every)
        finally:
            parts.close()


def soak(device: MatrixDevice, minutes: float, every: float) -> None:
    engine = device.engine
    assert isinstance(engine, HelmView)
    engine.set_gpu(True)
    device.start(cycles=True)
    began = time.monotonic()
    [deployed] = device.wait_settled(device.deploy())
    device.wait_workloads([Workload("1.0.0", "Hello")])
    print(f"installed in {time.monotonic() - began:.1f} s; soaking {minutes:g} min",
          flush=True)

    first_id, first_digest = deployed["deploymentId"], deployed["digest"]
    t0 = time.time()
    start, end = time.monotonic(), time.monotonic() + minutes * 60
    cycles0 = len(device.cycles())
    reports: set[float] = set()
    compiles: set[float] = set()
    events: set[tuple[str, float]] = set()  # (state, reportedAt) after the start
    present, went, came_back, moved_at = True, 0, 0, None
    cores, next_change = 4.0, start + every
    while time.monotonic() < end:
        view = device.view() or {}
        if view.get("reportedAt", 0) > t0:
            reports.add(view["reportedAt"])
        compiled = device.host.compiled_at()
        if compiled > t0:
            compiles.add(compiled)
        found = [d for d in view.get("deployments", []) if d["intent"] == device.intent]
        for d in found:
            events |= {(h["state"], h["reportedAt"]) for h in d["statusHistory"]
                       if h["reportedAt"] > t0}
        now_present = bool(found) and found[0]["deploymentId"] == first_id
        if present and not now_present:
            went += 1
        if not present and now_present:
            came_back += 1
        if moved_at is None and (not now_present or found[0]["digest"] != first_digest
                                 or any(s != "installed" for s, _ in events)):
            moved_at = time.monotonic()
        present = now_present
        if time.monotonic() >= next_change:
            cores = 6.0 if cores == 4.0 else 4.0
            engine.set_cores(cores)
            next_change += every
        time.sleep(1.0)  # a soak samples over wall time

    held = ((moved_at or time.monotonic()) - start) / 60
    removes = sum(1 for s, _ in events if s in ("removing", "removed"))
    installs = sum(1 for s, _ in events if s == "installing")
    revisions = engine.revisions()
    print(f"minutes held: {held:.1f} of {minutes:g}")
    print(f"removes: {removes} removing/removed reports, {went} time(s) gone from the branch")
    print(f"re-adds: {came_back} time(s) back on the branch, {installs} new installs")
    print("release revision: " + (", ".join(f"{n} {r}" for n, r in revisions.items())
                                  or "none (uninstalled at the end)"))
    print(f"capability reports seen: {len(reports)} (a change every {every:g} s)")
    print(f"compiles seen (sampled once a second): {len(compiles)}")
    print(f"device poll cycles: {len(device.cycles()) - cycles0}")


if __name__ == "__main__":
    main()
