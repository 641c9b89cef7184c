"""Benchmark: the resident memory of `margo device run`, a Compose box and a Helm device.

    .venv/bin/python -m bench.device_memory [--deployments 3] [--cycles 5] [--breakdown]
                                            [--only compose|helm]

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
shared library, the heap, anonymous mappings), which says what bounds it.

Targets (issue 34): Compose-only ≤ 64 MiB, Helm driver ≤ 120 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def device_process(config: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`margo device run --json` on `config` in its own process; SIGTERM afterwards."""
    log = open(config.parent / "device.log", "w")  # noqa: SIM115 (the child writes it)
    process = subprocess.Popen(
        [sys.executable, "-m", "margo_cli.main", "device", "run", "--config", str(config),
         "--json", "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
        preexec_fn=die_with_parent)
    log.close()
    try:
        yield process
    finally:
        stop(process)


def cycles_of(process: subprocess.Popen[bytes], log: Path) -> Iterator[dict[str, Any]]:
    """The device's cycles (`--json` lines) as they end; RuntimeError (with its log) when
    it exits, or is killed after `TIMEOUT` seconds, while more are wanted."""
    timer = threading.Timer(TIMEOUT, process.kill)
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            yield json.loads(line)
    finally:
        timer.cancel()
    raise RuntimeError(f"the device client stopped: {log.read_text()[-3000:]}")


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


def report(label: str, process: subprocess.Popen[bytes], breakdown: bool) -> None:
    """The process's peak and steady resident memory (and, optionally, what it holds)."""
    pid = process.pid
    print(f"  [{label}] resident memory: peak (VmHWM) {memory_kib('VmHWM', pid) / 1024:.1f} "
          f"MiB, steady (VmRSS) {memory_kib('VmRSS', pid) / 1024:.1f} MiB")
    if breakdown:
        mappings = resident_by_mapping(pid)
        for name, kib in mappings[:12]:
            print(f"      {kib / 1024:6.1f} MiB  {name}")
        rest = sum(kib for _, kib in mappings[12:])
        print(f"      {rest / 1024:6.1f} MiB  {len(mappings) - 12} other mappings")


def compose_device_memory(work: Path, registry: str, n: int, cycles: int,
                          breakdown: bool) -> None:
    """A Compose-only device: N web deployments on a private Docker engine."""
    reason = why_unavailable()
    if reason is not None:
        print(f"Compose-only device: skipped ({reason})")
        return
    with compose_box(work, registry, "bench-compose", n, **SCHEDULE) as (_, config):
        print(f"margo device run, Compose driver on a real Docker engine, {n} deployments "
              f"(health check, wait: true), REST source, then {cycles} unchanged cycles")
        with device_process(config) as process:
            settle(cycles_of(process, config.parent / "device.log"), n, cycles)
            report("compose", process, breakdown)


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


def helm_device_memory(work: Path, registry: str, n: int, cycles: int,
                       breakdown: bool) -> None:
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
            print(f"margo device run, Helm driver on the real control plane "
                  f"({len(THREE_NODES)} nodes), {n} Hello World releases (wait: true), "
                  f"REST source, then {cycles} unchanged cycles")
            with device_process(config) as process:
                results = cycles_of(process, config.parent / "device.log")
                next(results)  # the cluster's capabilities reported: the server places on them
                for index in range(n):
                    server.edit_intent(f"hello-{index}", HELLO_INTENT.format(
                        name=f"hello-{index}", index=index, greeting=f"Hello{index}",
                        device="bench-helm"))
                settle(results, n, cycles)
                report("helm", process, breakdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true",
                        help="also print what the steady resident memory is made of")
    parser.add_argument("--only", choices=["compose", "helm"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        with running_registry(work / "registry") as registry:
            publish_example_charts(registry)
            if args.only != "helm":
                compose_device_memory(work, registry, args.deployments, args.cycles,
                                      args.breakdown)
            if args.only != "compose":
                helm_device_memory(work, registry, args.deployments, args.cycles,
                                   args.breakdown)
    print("targets (issue 34): Compose-only ≤ 64 MiB, Helm driver ≤ 120 MiB")


if __name__ == "__main__":
    main()
