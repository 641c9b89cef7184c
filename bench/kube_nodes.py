"""What real Kubernetes nodes cost (tools/kube/realnode.py), on this machine.

    .venv/bin/python bench/kube_nodes.py [--nodes 2] [--idle 10]

Starts a control plane and `--nodes` real nodes, then prints: the time until every node
is Ready, the time from creating a pod to it being Ready (one per node, a busybox HTTP
server with a readiness probe), each node's resident memory by component, the CPU the
nodes use while idle over `--idle` seconds, and the time to stop them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

from tools.kube.controlplane import ControlPlane
from tools.kube.realnode import RealNode, RealNodes, tree
from tools.processes import cpu_seconds


def rss_by_component(pid: int) -> dict[str, int]:
    """Resident memory (bytes) of a process tree, by command name."""
    found: dict[str, int] = {}
    for each in tree(pid):
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{each}/comm").read_text().strip()
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[name] = found.get(name, 0) + int(line.split()[1]) * 1024
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process tree (live processes only)."""
    total = 0.0
    for each in tree(pid):
        with contextlib.suppress(OSError):
            total += sum(cpu_seconds(each, children=False))
    return total


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--idle", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="margo-bench-nodes-") as scratch, \
            ControlPlane(Path(scratch) / "plane") as plane, \
            RealNodes(plane, Path(scratch) / "nodes") as nodes:
        started = time.monotonic()
        nodes.start(*(RealNode(f"real-{i}", taints=()) for i in range(args.nodes)))
        print(f"{args.nodes} real nodes Ready in {time.monotonic() - started:.1f} s")
        with plane.admin() as admin:
            created = time.monotonic()
            for name in nodes.nodes:
                admin.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": f"web-{name}", "namespace": "default"}, "spec": {
                    "nodeName": name, "terminationGracePeriodSeconds": 1, "containers": [{
                        "name": "web", "image": "registry.example.com/ha-web:1.0.0",
                        "readinessProbe": {"httpGet": {"path": "/", "port": 8080},
                                           "periodSeconds": 1}}]}})
            admin.until("the pods Ready", lambda: all(
                ready(admin.get("Pod", f"web-{name}", "default")) for name in nodes.nodes))
            print(f"a pod per node Ready {time.monotonic() - created:.2f} s after creation")
        for name, node in nodes.nodes.items():
            parts = rss_by_component(node.process.pid)
            detail = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(
                parts.items(), key=lambda kv: -kv[1]))
            print(f"{name}: {sum(parts.values()) / 2**20:.0f} MiB resident ({detail})")
        before = {n: tree_cpu_seconds(node.process.pid) for n, node in nodes.nodes.items()}
        time.sleep(args.idle)
        for name, node in nodes.nodes.items():
            share = (tree_cpu_seconds(node.process.pid) - before[name]) / args.idle
            print(f"{name}: {share * 100:.1f} % of one core while idle (one pod running)")
        stopping = time.monotonic()
        nodes.stop()
        print(f"stopped {args.nodes} nodes in {time.monotonic() - stopping:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
