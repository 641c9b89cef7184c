"""Benchmark: the resident memory of `margo device run`, a Compose box and a Helm device.

    .venv/bin/python -m bench.device_memory [--deployments 3] [--cycles 5] [--breakdown]
                                            [--timeline] [--only compose|helm]

Each device is the real command (`python -m margo_cli.main device run --json`, its own
process, polling every second) against a `margo serve` and an OCI registry on loopback:

* Compose-only: the Compose driver on a private Docker engine (tools/docker), N deployments
  of a busybox web image with a health check and `wait: true`, capabilities from a file;
* Helm driver: the real Kubernetes control plane of tools/kube (three kwok nodes), N Hello
  World releases with `wait: true`, as the device's ServiceAccount, the capabilities
  discovered from the cluster.

Once the device has installed the N deployments and then run `--cycles` unchanged cycles,
the benchmark reads the process's /proc/<pid>/status and prints its peak resident memory
(VmHWM: start-up, installs and cycles) and its steady resident memory (VmRSS, idle between
cycles). `--breakdown` adds what the steady figure is made of (/proc/<pid>/smaps: per
shared library, the heap, anonymous mappings), which says what bounds it; `--timeline`
the resident memory sampled every 50 ms against the end of each cycle, which says when
the peak happens.

Targets (issue 34): Compose-only ≤ 64 MiB, Helm driver ≤ 120 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.benchkit import HELLO_INTENT, memory_kib, resident_by_mapping
from bench.composefleet import compose_box
from tools.charts import publish_example_charts
from tools.docker.dockerengine import why_unavailable
from tools.fleetserver import FleetServer, fleet_server, write_fleet
from tools.kube.controlplane import ControlPlane
from tools.kube.kubebuild import binaries
from tools.kube.kubenodes import THREE_NODES, apply_nodes
from tools.processes import die_with_parent, stop
from tools.registry import running_registry

ROOT = Path(__file__).resolve().parents[1]
DEVICE_RBAC = ROOT / "examples" / "kubernetes" / "device-rbac.yaml"
#: Seconds a device may take to install everything and settle.
TIMEOUT = 300.0
#: What the device polls at: every second, so that the benchmark does not wait.
SCHEDULE = {"schedule": {"interval": "1s"}}


class Timeline:
    """A process's resident memory sampled every 50 ms (each move of 2 MiB or more kept)
    and the end of each of its cycles: when its peak happens (`--timeline`)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.started = pid, time.monotonic()
        self.events: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        last = 0.0
        while not self._stop.wait(0.05):
            try:
                resident = memory_kib("VmRSS", self.pid) / 1024
            except OSError:  # the process is gone
                return
            if abs(resident - last) >= 2:
                self.note(f"resident {resident:.1f} MiB")
                last = resident

    def note(self, what: str) -> None:
        self.events.append((time.monotonic() - self.started, what))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Device:
    """A running `margo device run`: its process, log and (optionally) timeline."""

    process: subprocess.Popen[bytes]
    log: Path
    timeline: Timeline | None

    def cycles(self) -> Iterator[dict[str, Any]]:
        """The device's cycles (`--json` lines) as they end; RuntimeError (with its log)
        when it exits, or is killed after `TIMEOUT` seconds, while more are wanted."""
        timer = threading.Timer(TIMEOUT, self.process.kill)
        timer.start()
        try:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                result: dict[str, Any] = json.loads(line)
                if self.timeline is not None:
                    actions = [step["action"] for step in result["steps"]]
                    self.timeline.note(f"cycle ended, steps: {actions}")
                yield result
        finally:
            timer.cancel()
        raise RuntimeError(f"the device client stopped: {self.log.read_text()[-3000:]}")


@contextmanager
def running_device(config: Path, timeline: bool) -> Iterator[Device]:
    """`margo device run --json` on `config` in its own process; SIGTERM afterwards."""
    log = config.parent / "device.log"
    with open(log, "w") as output:  # the child writes it
        process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
             str(config), "--json", "--log-level", "warning"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=output, preexec_fn=die_with_parent)
    device = Device(process, log, Timeline(process.pid) if timeline else None)
    try:
        yield device
    finally:
        if device.timeline is not None:
            device.timeline.close()
        stop(process)


def settle(cycles: Iterator[dict[str, Any]], installs: int, quiet: int) -> None:
    """Until the device has installed `installs` components and then run `quiet`
    converged cycles in a row without a step."""
    installed = calm = 0
    for result in cycles:
        installed += sum(step["action"] == "install" for step in result["steps"])
        calm = calm + 1 if (installed >= installs and result["converged"]
                            and not result["steps"]) else 0
        if calm >= quiet:
            return


def report(label: str, device: Device, breakdown: bool) -> None:
    """The process's peak and steady resident memory (and, optionally, what it holds and
    how it got there)."""
    pid = device.process.pid
    print(f"  [{label}] resident memory: peak (VmHWM) {memory_kib('VmHWM', pid) / 1024:.1f} "
          f"MiB, steady (VmRSS) {memory_kib('VmRSS', pid) / 1024:.1f} MiB")
    if breakdown:
        mappings = resident_by_mapping(pid)
        for name, kib in mappings[:12]:
            print(f"      {kib / 1024:6.1f} MiB  {name}")
        rest = sum(kib for _, kib in mappings[12:])
        print(f"      {rest / 1024:6.1f} MiB  {len(mappings) - 12} other mappings")
    if device.timeline is not None:
        for at, what in device.timeline.events:
            print(f"      {at:6.2f} s  {what}")


def compose_device_memory(work: Path, registry: str, args: argparse.Namespace) -> None:
    """A Compose-only device: N web deployments on a private Docker engine."""
    reason = why_unavailable()
    if reason is not None:
        print(f"Compose-only device: skipped ({reason})")
        return
    n = args.deployments
    with compose_box(work, registry, "bench-compose", n, **SCHEDULE) as (_, config):
        print(f"margo device run, Compose driver on a real Docker engine, {n} deployments "
              f"(health check, wait: true), REST source, then {args.cycles} unchanged cycles")
        with running_device(config, args.timeline) as device:
            settle(device.cycles(), n, args.cycles)
            report("compose", device, args.breakdown)


def helm_device(work: Path, server: FleetServer, kubeconfig: Path) -> Path:
    """A Helm device's home and configuration: the cluster's capabilities discovered."""
    home = work / "bench-helm"
    home.mkdir()
    (home / "token").write_text(server.token)
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": "bench-helm"},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "helm", "kubeconfig": str(kubeconfig)},
        "dataDir": "data", "capabilities": {"kubernetes": {"debounce": "0s"}}, **SCHEDULE}))
    return home / "device.yaml"


def helm_device_memory(work: Path, registry: str, args: argparse.Namespace) -> None:
    """A Helm-driver device: N Hello World releases on the real control plane."""
    with ControlPlane(work / "kube", bin_dir=binaries()) as plane:
        with plane.admin() as admin:
            apply_nodes(admin, THREE_NODES, server_version=plane.version)
            admin.apply_file(DEVICE_RBAC)
        kubeconfig = plane.service_account_kubeconfig(work / "device.kubeconfig",
                                                      "margo-device", "margo-system")
        fleet = write_fleet(work / "helm-fleet", registry=registry, intents={})
        with fleet_server(work / "helm-server", fleet=fleet) as server:
            config = helm_device(work, server, kubeconfig)
            n = args.deployments
            print(f"margo device run, Helm driver on the real control plane "
                  f"({len(THREE_NODES)} nodes), {n} Hello World releases (wait: true), "
                  f"REST source, then {args.cycles} unchanged cycles")
            with running_device(config, args.timeline) as device:
                results = device.cycles()
                next(results)  # the cluster's capabilities reported: the server places on them
                for index in range(n):
                    server.edit_intent(f"hello-{index}", HELLO_INTENT.format(
                        name=f"hello-{index}", index=index, greeting=f"Hello{index}",
                        device="bench-helm"))
                settle(results, n, args.cycles)
                report("helm", device, args.breakdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true",
                        help="also print what the steady resident memory is made of")
    parser.add_argument("--timeline", action="store_true",
                        help="also print resident memory every 50 ms (moves of 2 MiB or more) "
                             "and the end of each cycle: when the peak happens")
    parser.add_argument("--only", choices=["compose", "helm"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        with running_registry(work / "registry") as registry:
            publish_example_charts(registry)
            if args.only != "helm":
                compose_device_memory(work, registry, args)
            if args.only != "compose":
                helm_device_memory(work, registry, args)
    print("targets (issue 34): Compose-only ≤ 64 MiB, Helm driver ≤ 120 MiB")


if __name__ == "__main__":
    main()
