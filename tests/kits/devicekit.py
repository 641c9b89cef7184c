"""Test kit: devices of the render driver against a `fleetserver` server, driven by the real
`margo device` command in its own process.

    device = new_device(server, "site-1", source="git")   # config, token, capabilities, intent
    assert steps(once(device)) == [("install", "ok")]

Each device lives in `<workdir>/<device id>` next to the server's data directory and gets
an intent of its own (the example hello-world application), so tests sharing one server
stay independent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kits.fleetserver import FleetServer, capabilities
from kits.netkit import CuttableProxy
from reconciler.desired import DesiredState
from reconciler.runner import CycleResult, Reconciler
from reconciler.sources import Adopted

__all__ = ["HELLO", "ROOT", "Device", "cycle_losing_the_link", "head", "intent", "new_device",
           "once", "steps", "wait_for_new_commit"]

ROOT = Path(__file__).resolve().parents[2]
HELLO = "com-example-hello-world"

_INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata:
  name: {name}
spec:
  application:
    id: {app}
  profile:
    type: helm
  namespace: {namespace}
  parameters:
    greeting: {greeting}
  targets:
    devices: [{device}]
"""


def intent(name: str, *, device: str | None = None, app: str = HELLO,
           greeting: str = "Hello", namespace: str | None = None) -> str:
    """A DeploymentIntent `name` of the helm profile of `app` for one device (`name` if
    not told), in namespace `ns-<name>` unless told."""
    return _INTENT.format(name=name, app=app, namespace=namespace or f"ns-{name}",
                          greeting=greeting, device=device or name)


@dataclass
class Device:
    device_id: str
    config: Path
    output: Path
    data: Path

    @property
    def state_file(self) -> Path:
        return self.data / "device-state.sqlite"


def new_device(server: FleetServer, device_id: str, *, source: str = "margo-rest",
               url: str | None = None, app: str = HELLO, greeting: str = "Hello",
               with_intent: bool = True, resync: str | None = None) -> Device:
    """A device directory (config, token, capabilities) and, unless `with_intent` is
    false, an intent targeting it; waits until the server compiled the device's
    deployment. `resync`: the device's `schedule.resync` (default: the client's)."""
    home = server.data_dir.parent / device_id
    home.mkdir()
    (home / "token").write_text(server.token)
    doc = capabilities("k8s-single-amd64", device_id)
    (home / "capabilities.json").write_text(json.dumps(doc))
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": device_id},
        "server": {"url": url or server.base, "clientId": server.client_id,
                   "tokenFile": "token", "timeout": "5s"},
        "source": {"type": source},
        "driver": {"type": "render", "outputDir": "rendered"},
        "dataDir": "data",
        "capabilities": {"file": "capabilities.json"},
        "schedule": {"interval": "1s", **({"resync": resync} if resync else {})},
    }))
    server.put_capabilities(doc)
    if with_intent:
        server.edit_intent(device_id, intent(device_id, app=app, greeting=greeting))
        server.wait_for_deployments(1, device_id=device_id)
    return Device(device_id, home / "device.yaml", home / "rendered", home / "data")


def once(device: Device, *, expect: int | None = 0) -> dict[str, Any]:
    """`margo device once --json` in its own process; its cycle report, with what the
    process wrote to stderr under `stderr`."""
    done = subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "device", "once", "--config",
         str(device.config), "--json", "--log-level", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
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
