"""`make cluster`: a real Kubernetes control plane on loopback for people to try things on.

    .venv/bin/python -m tools.kube.cluster [--dir .cluster] [--workers 2] [--no-gpu]
                                           [--real-nodes N]

Builds the control plane once (kubebuild.py), starts it (controlplane.py), registers a
control-plane node and the workers with kwok (the last worker has an NVIDIA GPU unless
`--no-gpu`), starts `--real-nodes` real nodes (realnode.py: kubelet, containerd and
kube-proxy, containers run; labelled `margo-gitops.dev/real-node=true`, untainted, so the
scheduler may place any pod there) with cluster DNS (clusterdns.py), applies the device
client's RBAC (examples/kubernetes/device-rbac.yaml), prints the kubeconfigs and keeps
running until Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from tools.kube.controlplane import ControlPlane
from tools.kube.kubenodes import SimNode, apply_nodes
from tools.kube.realnode import RealNode, RealNodes, why_unavailable

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "examples" / "kubernetes" / "device-rbac.yaml"


def topology(workers: int, gpu: bool) -> list[SimNode]:
    nodes = [SimNode("control-plane", cpu="2", memory="4Gi", roles=("control-plane",),
                     zone="zone-a", taints=({"key": "node-role.kubernetes.io/control-plane",
                                             "effect": "NoSchedule"},))]
    for index in range(workers):
        last = index == workers - 1
        nodes.append(SimNode(f"worker-{index}", cpu="4", memory="8Gi",
                             zone=f"zone-{'abc'[index % 3]}",
                             gpus=1 if gpu and last else 0,
                             gpu_product="Tesla-T4" if gpu and last else None))
    return nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".cluster")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument("--real-nodes", type=int, default=0, metavar="N",
                        help="also start N real nodes (real-0, ...) that run containers")
    args = parser.parse_args(argv)
    if args.real_nodes and (reason := why_unavailable()) is not None:
        parser.error(f"real nodes cannot start here: {reason}")
    started = time.monotonic()
    plane = ControlPlane(args.dir.resolve())
    plane.start()
    real = RealNodes(plane, args.dir.resolve() / "nodes", cluster_dns=args.real_nodes > 0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with plane.admin() as admin:
            apply_nodes(admin, topology(args.workers, not args.no_gpu),
                        server_version=plane.version)
            admin.apply_file(RBAC)
        real.start(*(RealNode(f"real-{i}", zone=f"zone-{'abc'[i % 3]}", taints=())
                     for i in range(args.real_nodes)))
        device = plane.service_account_kubeconfig(
            args.dir.resolve() / "kubeconfigs" / "margo-device.kubeconfig",
            "margo-device", "margo-system")
        print(f"Kubernetes {plane.version} on {plane.server}: etcd, kube-apiserver, "
              f"kube-controller-manager, kube-scheduler and kwok with {args.workers + 1} "
              f"simulated nodes, {args.real_nodes} real nodes, ready in "
              f"{time.monotonic() - started:.1f} s")
        for node in real.nodes.values():
            print(f"  real:    {node.name} ({node.ip}, pods {node.pod_cidr}), logs in "
                  f"{node.folder / 'logs'}/")
        print(f"  admin:   export KUBECONFIG={plane.admin_kubeconfig}")
        print(f"  device:  {device}  (ServiceAccount margo-system/margo-device, "
              "examples/kubernetes/device-rbac.yaml; token valid 24 h)")
        print(f"  logs:    {plane.folder / 'logs'}/")
        print("Ctrl-C stops it.", flush=True)
        while not stop.wait(1.0):
            plane.check()
            for node in real.nodes.values():
                node.check()
    except KeyboardInterrupt:
        pass
    finally:
        real.stop()
        plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
