"""Benchmark: the device client's Helm driver on the real Kubernetes control plane.

    .venv/bin/python bench/kube.py [--deployments 10] [--cycles 20]

Starts the control plane from tools/kube (built once per machine; the build time is
printed when this run had to build it), a registry with the example charts and a `margo
serve` with N intents of Hello World (Helm, `wait: true`) for one device on a three-node
cluster. Then runs the device client in this process, as its ServiceAccount with the
documented RBAC, Secret storage and drift detection on (the defaults), and prints:

* the control plane's start time (warm binaries) and, when built now, the build time;
* the first cycle: N releases installed, each waiting for its Deployment to be available
  (seconds per release);
* an unchanged cycle (median and p90; Helm's list plus the drift check of every object);
* a cycle upgrading the N releases to new values (reconfigure, with wait);
* resident memory of the device client process (RSS) idle and peak (the Go runtime of the
  Helm engine included).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.benchkit import HELLO_INTENT, memory_kib, p90, timed
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from tools.charts import publish_example_charts
from tools.fleetserver import FleetServer, fleet_server, write_fleet
from tools.kube.controlplane import ControlPlane
from tools.kube.kubebuild import binaries
from tools.kube.kubenodes import THREE_NODES, apply_nodes
from tools.registry import running_registry

ROOT = Path(__file__).resolve().parents[1]
DEVICE_RBAC = ROOT / "examples" / "kubernetes" / "device-rbac.yaml"

DEVICE = "bench-cluster"


def device_config(work: Path, server: FleetServer, kubeconfig: Path) -> Path:
    home = work / DEVICE
    home.mkdir()
    (home / "token").write_text(server.token)
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": DEVICE},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "helm", "kubeconfig": str(kubeconfig)},
        "dataDir": "data",
        "capabilities": {"kubernetes": {"debounce": "0s"}}}))
    return home / "device.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    n = args.deployments
    started = time.perf_counter()
    messages: list[str] = []
    bin_dir = binaries(log=messages.append)
    if messages:
        print(f"control plane built in {time.perf_counter() - started:.0f} s (first run on "
              "this machine)")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        started = time.perf_counter()
        with ControlPlane(work / "kube", bin_dir=bin_dir) as plane:
            print(f"control plane {plane.version} started in "
                  f"{time.perf_counter() - started:.1f} s")
            with plane.admin() as admin:
                apply_nodes(admin, THREE_NODES, server_version=plane.version)
                admin.apply_file(DEVICE_RBAC)
            kubeconfig = plane.service_account_kubeconfig(work / "device.kubeconfig",
                                                          "margo-device", "margo-system")
            with running_registry(work / "registry") as registry:
                publish_example_charts(registry)
                fleet = write_fleet(work / "fleet", registry=registry, intents={})
                with fleet_server(work, fleet=fleet) as server:
                    config = device_config(work, server, kubeconfig)
                    with open_reconciler(load_config(config)) as reconciler:
                        reconciler.cycle()  # reports the cluster's capabilities
                        for index in range(n):
                            server.edit_intent(f"hello-{index}", HELLO_INTENT.format(
                                name=f"hello-{index}", index=index, greeting=f"Hello{index}",
                                device=DEVICE))
                        server.wait_for_deployments(n, device_id=DEVICE, timeout=120)
                        print(f"device client, Helm driver on {len(THREE_NODES)} nodes, {n} "
                              "deployments of Hello World (wait: true)")
                        wall, _, steps = timed(reconciler)
                        print(f"  first cycle: {steps} installs in {wall:.1f} s "
                              f"({wall / max(1, steps):.2f} s per release)")
                        timed(reconciler)  # statuses settle
                        walls = [timed(reconciler)[0] * 1000 for _ in range(args.cycles)]
                        print(f"  unchanged cycle: median {statistics.median(walls):.0f} ms "
                              f"(p90 {p90(walls):.0f}), list and drift check of {n} releases")
                        before = {d["digest"] for d in server.device(DEVICE)["deployments"]}
                        for index in range(n):
                            server.set_parameter(f"hello-{index}", "greeting", f"Changed{index}")
                        server.wait_for(lambda: not ({
                            d["digest"] for d in server.device(DEVICE)["deployments"]}
                            & before), 120, "every deployment recompiled")
                        wall, _, steps = timed(reconciler)
                        print(f"  reconfigure cycle: {steps} upgrades in {wall:.1f} s "
                              f"({wall / max(1, steps):.2f} s per release)")
                        print(f"  resident memory: idle {memory_kib('VmRSS') / 1024:.0f} MiB, "
                              f"peak {memory_kib('VmHWM') / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
