"""Test kit: devices of the render driver against a `fleetserver` server, driven by the real
`margo device` command in its own process.

    device = new_device(server, "site-1", source="git")   # config, token, capabilities, intent
    assert steps(once(device)) == [("install", "ok")]

The devices themselves (`Device`, `new_device`, `intent`) are `tools.devices`, which the
benchmarks use too; this kit adds one cycle at a time (`once`) and what the tests read of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from kits.fleetserver import FleetServer
from kits.netkit import CuttableProxy
from reconciler.desired import DesiredState
from reconciler.runner import CycleResult, Reconciler
from reconciler.sources import Adopted
from tools.devices import HELLO, Device, engine_environment, intent, new_device
from tools.fleetserver import ROOT

__all__ = ["HELLO", "ROOT", "Device", "cycle_losing_the_link", "engine_environment", "head",
           "intent", "new_device", "once", "steps", "wait_for_new_commit"]


def once(device: Device, *, expect: int | None = 0) -> dict[str, Any]:
    """`margo device once --json` in its own process; its cycle report, with what the
    process wrote to stderr under `stderr`."""
    done = subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "device", "once", "--config",
         str(device.config), "--json", "--log-level", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=engine_environment())
    if expect is not None:
        assert done.returncode == expect, done.stdout + done.stderr
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def steps(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(action, outcome) of each step of a cycle report."""
    return [(s["action"], s["outcome"]) for s in report["steps"]]


def head(server: FleetServer, device: Device) -> str:
    """The newest commit of the device's branch, as the server's read API lists it."""
    return str(server.device(device.device_id)["history"][0]["commit"])


def wait_for_new_commit(server: FleetServer, device: Device, before: str) -> None:
    """Wait until the device's branch has moved on from `before`."""
    server.wait_for(lambda: head(server, device) != before,
                    what="a new commit on the device branch")


def cycle_losing_the_link(reconciler: Reconciler, proxy: CuttableProxy) -> CycleResult:
    """One cycle of an in-process client whose link (through `proxy`) drops right after
    the desired state arrived: it applies, and its reports find no server."""
    real_fetch = reconciler.source.fetch

    def fetch_then_lose_the_link(adopted: Adopted) -> DesiredState | None:
        fetched = real_fetch(adopted)
        proxy.cut()
        return fetched

    reconciler.source.fetch = fetch_then_lose_the_link  # type: ignore[method-assign]
    try:
        return reconciler.cycle()
    finally:
        reconciler.source.fetch = real_fetch  # type: ignore[method-assign]
