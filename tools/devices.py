"""Devices of the render driver against a `tools.fleetserver` server, each in a directory of
its own, for the tests (`kits.devicekit`, `kits.failoverkit`) and the benchmarks
(`bench.failover`).

    device = new_device(server, "site-1", source="git")   # config, token, capabilities, intent
    with running_device(device):                          # the real `margo device run`
        digest = poll_until("the install", lambda: current(server, "site-1"))

Each device lives in `<workdir>/<device id>` next to the server's data directory and gets
an intent of its own (the example hello-world application), so devices sharing one server
stay independent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from margo_cli.go_runtime import GO_SETTINGS
from tools.docker.dockerengine import DockerEngine
from tools.fleetserver import ROOT, FleetServer, capabilities
from tools.processes import stop

__all__ = ["HELLO", "Device", "compose_device", "current", "engine_environment", "intent",
           "new_device", "new_digest", "running_device"]

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
               with_intent: bool = True, resync: str | None = None,
               interval: str = "1s", wait: str | None = None) -> Device:
    """A device directory (config, token, capabilities) and, unless `with_intent` is
    false, an intent targeting it; waits until the server compiled the device's
    deployment. `resync`, `interval`, `wait`: the device's `schedule` (default: the
    client's, but a one-second interval)."""
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
        "schedule": {"interval": interval, **({"resync": resync} if resync else {}),
                     **({"wait": wait} if wait else {})},
    }))
    # A Git-source device reports its capabilities through Oct-2024's route (the standard's
    # Git-era API); reported here the same way, its documents have their final shape from
    # the first compile on, instead of being rewritten in that shape when the device's own
    # report arrives, at a moment no test chooses (a new digest a test could take for the
    # change it made).
    server.put_capabilities(doc, oct_2024=source == "git")
    if with_intent:
        server.edit_intent(device_id, intent(device_id, app=app, greeting=greeting))
        server.wait_for_deployments(1, device_id=device_id)
    return Device(device_id, home / "device.yaml", home / "rendered", home / "data")


def engine_environment() -> dict[str, str]:
    """This process's environment with the Go runtime settings a render or Helm device
    gives itself (`margo_cli.go_runtime`; the environment's own win, as there): it starts
    with them, instead of exec'ing itself once more to get them, which costs a second
    interpreter start on every device process (tests/cli/test_go_runtime.py runs devices
    without them and checks that exec)."""
    return {**GO_SETTINGS, **os.environ}


@contextmanager
def running_device(device: Device) -> Iterator[Path]:
    """`margo device run` for the block (stopped with SIGTERM); yields its log file."""
    log_path = device.config.parent / "device.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
             str(device.config), "--log-level", "info"], cwd=ROOT, stdout=log, stderr=log,
            env=engine_environment())
        try:
            yield log_path
        finally:
            stop(process, timeout=60)


def current(server: FleetServer, device_id: str, digest: str | None = None) -> str | None:
    """The digest of the device's one deployment once the server holds an `installed`
    report about those very bytes (and, given `digest`, they are those); None before."""
    [deployment] = server.device(device_id)["deployments"]
    applied = deployment.get("applied") or {}
    if deployment["state"] != "installed" or not applied.get("current"):
        return None
    if digest is not None and deployment["digest"] != digest:
        return None
    return str(deployment["digest"])


def new_digest(server: FleetServer, device_id: str, old: str) -> str | None:
    """The digest of the device's one deployment once it is no longer `old`."""
    [deployment] = server.device(device_id)["deployments"]
    return None if deployment["digest"] == old else str(deployment["digest"])


def compose_device(home: Path, server: FleetServer, engine: DockerEngine, device_id: str,
                   **extra: Any) -> Path:
    """A Compose box's home (token, capabilities reported to the server) and its
    configuration file; `extra` adds top-level settings (e.g. `schedule`)."""
    home.mkdir()
    (home / "token").write_text(server.token)
    doc = capabilities("compose-box-amd64", device_id)
    (home / "caps.json").write_text(json.dumps(doc))
    server.put_capabilities(doc)
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": device_id},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "compose", "compose": engine.compose, "dockerHost": engine.host},
        "dataDir": "data", "capabilities": {"file": "caps.json"}, **extra}))
    return home / "device.yaml"
