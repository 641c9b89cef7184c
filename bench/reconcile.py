"""Benchmark: the device client's cycle against a real `margo serve` and OCI registry.

    .venv/bin/python bench/reconcile.py [--deployments 20] [--cycles 50]

Starts a registry (Debian docker-registry) with the example charts, a server with a fleet
of N intents that all target one device, and runs the device client in this process with
the `render` driver (the real Helm engine rendering into a directory). Prints:

* the first cycle: N deployments installed (wall and CPU seconds);
* an unchanged cycle (median and p90 of `--cycles` cycles, wall and CPU milliseconds) with
  the Margo REST source and with the Git source;
* a cycle applying N changed deployments (every intent's parameter changed);
* resident memory (RSS) when idle after the cycles, and the peak (VmHWM) during applies.

Then, next to those render figures, the `compose` driver on a real Docker engine
(tools/docker: a private dockerd, a busybox web image built here and pushed to the
registry, Compose v2): `--compose-deployments` (default 5) deployments with a health check
and `wait: true` on one Compose device, timing the first cycle (pull, create, wait healthy),
an unchanged cycle and a reconfigure cycle (every container recreated with its new
environment). Skipped with the reason printed when no engine can be started here.

Then the device client's own telemetry (issue 31): three more render devices with N
deployments each, one per process so that resident memory is theirs alone: telemetry off,
on (metrics every second and log records to a real OpenTelemetry Collector on loopback,
tools/otel), and on with the collector away (an address nobody answers). For each: the
first cycle, the unchanged cycle (median, p90, CPU) and the process's resident memory
(idle after the cycles, and peak).

Targets from the issue: unchanged cycle under 50 ms, resident memory under 150 MB.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.benchkit import HELLO_INTENT, digests, memory_kib, p90, timed
from bench.composefleet import compose_box
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.runner import Reconciler
from tools.charts import publish_example_charts
from tools.docker.dockerengine import why_unavailable
from tools.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from tools.otel.collector import running_collector
from tools.processes import unanswered_port
from tools.registry import running_registry

ROOT = Path(__file__).resolve().parents[1]

def device_home(workdir: Path, server: FleetServer, device_id: str, source: str,
                deployments: int) -> Path:
    home = workdir / device_id
    home.mkdir()
    (home / "token").write_text(server.token)
    doc = capabilities("k8s-single-amd64", device_id)
    # Room for every deployment: each asks for half a core, and the server places on a
    # device no more than its capacity holds (the example's 8 cores take 16).
    doc["properties"]["cpus"] = [{"cores": max(8, deployments), "architecture": "amd64"}]
    (home / "caps.json").write_text(json.dumps(doc))
    server.put_capabilities(doc)
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": device_id},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": source}, "driver": {"type": "render"}, "dataDir": "data",
        "capabilities": {"file": "caps.json"}}))
    return home / "device.yaml"


def unchanged(reconciler: Reconciler, cycles: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(cycles):
        wall, cpu, steps = timed(reconciler)
        assert steps == 0
        walls.append(wall * 1000)
        cpus.append(cpu * 1000)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--compose-deployments", type=int, default=5)
    parser.add_argument("--telemetry-only", action="store_true",
                        help="run only the device telemetry comparison")
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child), args.cycles)
        return
    n = args.deployments
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        with running_registry(work / "registry") as registry:
            publish_example_charts(registry)
            fleet = write_fleet(work / "fleet", registry=registry, intents={})
            with fleet_server(work, fleet=fleet) as server:
                if args.telemetry_only:
                    telemetry_overhead(work, server, n, args.cycles)
                    return
                configs = {source: device_home(work, server, f"bench-{source}", source, n)
                           for source in ("margo-rest", "git")}
                for source in configs:
                    for index in range(n):
                        server.edit_intent(f"{source}-{index}", HELLO_INTENT.format(
                            name=f"{source}-{index}", index=index, greeting=f"Hello{index}",
                            device=f"bench-{source}"))
                for source in configs:
                    server.wait_for_deployments(n, device_id=f"bench-{source}", timeout=60)
                print(f"device client, render driver, {n} deployments, one device per source")
                for source, config in configs.items():
                    with open_reconciler(load_config(config)) as reconciler:
                        wall, cpu, steps = timed(reconciler)
                        print(f"  [{source}] first cycle: {steps} steps, {wall:.2f} s wall, "
                              f"{cpu:.2f} s CPU")
                        timed(reconciler)  # statuses settle
                        walls, cpus = unchanged(reconciler, args.cycles)
                        print(f"  [{source}] unchanged cycle: median {statistics.median(walls):.1f}"
                              f" ms wall (p90 {p90(walls):.1f}), "
                              f"{statistics.median(cpus):.1f} ms CPU")
                        if source == "margo-rest":
                            before = digests(server, f"bench-{source}")
                            for index in range(n):
                                server.set_parameter(f"{source}-{index}", "greeting",
                                                     f"Changed{index}")
                            server.wait_for(
                                lambda b=before: not (digests(server, "bench-margo-rest") & b),
                                60, "every deployment to be recompiled")
                            wall, cpu, steps = timed(reconciler)
                            print(f"  [{source}] cycle applying {steps} changed deployments: "
                                  f"{wall:.2f} s wall, {cpu:.2f} s CPU")
                print(f"resident memory: idle {memory_kib('VmRSS') / 1024:.0f} MiB, "
                      f"peak {memory_kib('VmHWM') / 1024:.0f} MiB (target < 150 MB)")
                telemetry_overhead(work, server, n, args.cycles)
            compose_cycles(work, registry, args.compose_deployments, args.cycles)


def child(config: Path, cycles: int) -> None:
    """One device client in this process (`--child`): first cycle, unchanged cycles, memory;
    one JSON line on stdout. Logging as `margo device run` sets it up (INFO, to stderr)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    with open_reconciler(load_config(config)) as reconciler:
        first, _, steps = timed(reconciler)
        timed(reconciler)  # statuses settle
        walls, cpus = unchanged(reconciler, cycles)
        print(json.dumps({"first": first, "steps": steps, "median": statistics.median(walls),
                          "p90": p90(walls), "cpu": statistics.median(cpus),
                          "rss": memory_kib("VmRSS") / 1024, "peak": memory_kib("VmHWM") / 1024}))


def telemetry_overhead(work: Path, server: FleetServer, n: int, cycles: int) -> None:
    """The same render device with its own telemetry off, on, and on with the collector
    away, each in a process of its own."""
    with running_collector(work / "otel") as collector, unanswered_port() as away:
        modes = {"off": None, "on": {"collector": collector.http, "interval": "1s"},
                 "away": {"collector": f"http://127.0.0.1:{away}", "interval": "1s",
                          "timeout": "2s"}}
        configs = {}
        for mode, telemetry in modes.items():
            device = f"bench-telemetry-{mode}"
            configs[mode] = device_home(work, server, device, "margo-rest", n)
            if telemetry is not None:
                doc = yaml.safe_load(configs[mode].read_text())
                doc["telemetry"] = telemetry
                configs[mode].write_text(yaml.safe_dump(doc))
            for index in range(n):
                server.edit_intent(f"{device}-{index}", HELLO_INTENT.format(
                    name=f"{device}-{index}", index=index, greeting=f"Hello{index}",
                    device=device))
        for mode in modes:
            server.wait_for_deployments(n, device_id=f"bench-telemetry-{mode}", timeout=120)
        print(f"device client's own telemetry, render driver, {n} deployments, a process per "
              "mode (metrics every 1 s, log records as they come)")
        for mode, config in configs.items():
            done = subprocess.run([sys.executable, "-m", "bench.reconcile", "--child",
                                   str(config), "--cycles", str(cycles)], cwd=ROOT,
                                  capture_output=True, text=True, check=True)
            found = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"  [telemetry {mode}] first cycle {found['first']:.2f} s; unchanged cycle "
                  f"median {found['median']:.1f} ms wall (p90 {found['p90']:.1f}), "
                  f"{found['cpu']:.1f} ms CPU; resident memory idle {found['rss']:.0f} MiB, "
                  f"peak {found['peak']:.0f} MiB")
        points = len(collector.received().metrics)
        print(f"  the collector received {points} metric points and "
              f"{len(collector.received().logs)} log records")


def compose_cycles(work: Path, registry: str, n: int, cycles: int) -> None:
    """The compose driver on a real engine: first install, unchanged, reconfigure."""
    reason = why_unavailable()
    if reason is not None:
        print(f"compose driver on a real Docker engine: skipped ({reason})")
        return
    with compose_box(work, registry, "bench-compose", n) as (server, config):
        print(f"device client, compose driver on a real Docker engine, {n} deployments "
              "(health check, wait: true)")
        with open_reconciler(load_config(config)) as reconciler:
            wall, cpu, steps = timed(reconciler)
            print(f"  first cycle: {steps} installs (image pull, create, healthy) in "
                  f"{wall:.1f} s wall, {cpu:.2f} s CPU")
            timed(reconciler)  # statuses settle
            walls, cpus = unchanged(reconciler, cycles)
            print(f"  unchanged cycle: median {statistics.median(walls):.1f} ms wall "
                  f"(p90 {p90(walls):.1f}), {statistics.median(cpus):.1f} ms CPU")
            before = digests(server, "bench-compose")
            for index in range(n):
                server.set_parameter(f"web-{index}", "greeting", f"Changed{index}")
            server.wait_for(lambda: not (digests(server, "bench-compose") & before), 60,
                            "every deployment to be recompiled")
            wall, cpu, steps = timed(reconciler)
            print(f"  reconfigure cycle: {steps} containers recreated in {wall:.1f} s "
                  f"wall, {cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
