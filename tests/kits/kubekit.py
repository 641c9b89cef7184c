"""Test kit: the real Kubernetes control plane (tools/kube) as a test cluster.

Two kinds of node: simulated ones (kwok, `KubeCluster.set_nodes`), and real ones
(tools/kube/realnode.py: a kubelet, containerd and kube-proxy each, running containers)
on a control plane of their own (`RealCluster`, the `real_nodes` session fixture), so the
simulated nodes' tests never see them. A real node's pods can be read (`pod_log`) and
entered (`pod_exec`) through the API server, as with kubectl.

One control plane runs for the whole session (`control_plane` in conftest.py: etcd,
kube-apiserver with RBAC, controller manager, scheduler and kwok, built from the pinned
Go modules); each test gets a `KubeCluster` that sets the simulated nodes it needs,
makes a kubeconfig for the device client's ServiceAccount (bound by
examples/kubernetes/device-rbac.yaml, exactly as documented) and, when the test ends,
uninstalls every Helm release and waits until their pods are gone, so the next test starts
from a cluster without workloads. Namespaces are kept: the namespace controller takes 5 s
or more to delete even an empty one, and a test reusing a terminating namespace would fail.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

# websockets comes with uvicorn[standard] (pyproject.toml): exec is a WebSocket protocol.
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from reconciler.helm_engine import helm
from tools.kube.controlplane import ControlPlane
from tools.kube.kubeadmin import KubeAdmin, NotFound, tls_context
from tools.kube.kubenodes import CONTROL_PLANE_TAINT, THREE_NODES, SimNode, apply_nodes
from tools.kube.nodeimages import Image, serve_http
from tools.kube.realnode import RealNode, RealNodes

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["CONTROL_PLANE_TAINT", "DEVICE_RBAC", "GPU_WORKER", "REAL_NODES", "REAL_TEST_IMAGES",
           "SINGLE_NODE", "THREE_NODES", "ControlPlane", "KubeAdmin", "KubeCluster",
           "RealCluster", "RealNode", "RealNodes", "SimNode"]

DEVICE_RBAC = ROOT / "examples" / "kubernetes" / "device-rbac.yaml"
#: Namespaces that exist in every cluster (and the one the RBAC file creates).
SYSTEM_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease", "margo-system"}

SINGLE_NODE = (SimNode("edge-0", cpu="4", memory="8Gi", roles=("control-plane",)),)
GPU_WORKER = SimNode("gpu-worker", cpu="8", memory="32Gi", zone="zone-b", gpus=1,
                     gpu_product="Tesla-T4")
#: The real nodes' cluster: two nodes in two zones, untainted (no simulated node shares
#: their control plane). There is no GPU on these machines: GPU nodes stay simulated.
REAL_NODES = (RealNode("real-a", zone="zone-a", taints=()),
              RealNode("real-b", zone="zone-b", taints=()))
#: The test charts' images on real nodes: `greeter` serves HTTP on 8080 and logs its
#: version and greeting; `crasher` fails during start-up (two lines, then exit code 3).
REAL_TEST_IMAGES = (
    *(Image(f"registry.example.com/greeter:{version}",
            serve_http(f'"greeter {version} says: ${{GREETING:-nothing}}"'),
            {"www/index.html": f"greeter {version}\n"}) for version in ("1.0.0", "2.0.0")),
    Image("registry.example.com/crasher:1.0.0",
          ("sh", "-c", 'echo "loading configuration"; echo "fatal: DATABASE_URL is not set"'
                       " >&2; exit 3")),
)



class _UpgradeBroken(Exception):
    """An exec's WebSocket upgrade failed before any byte of its stream (`pod_exec`)."""

class KubeCluster:
    """The session's control plane, as one test sees it."""

    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        self.plane = plane
        self.workdir = workdir
        self.admin: KubeAdmin = plane.admin()
        self._namespaces_before = self.namespaces()
        self._applied: list[tuple[str, str, str | None]] = []

    @property
    def version(self) -> str:
        return self.plane.version

    def namespaces(self) -> set[str]:
        return {n["metadata"]["name"] for n in self.admin.list("Namespace")}

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as the administrator; it is deleted when the test ends."""
        meta = obj["metadata"]
        key = (obj["kind"], meta["name"], meta.get("namespace"))
        if key not in self._applied:
            self._applied.append(key)
        return self.admin.apply(obj)

    def set_nodes(self, nodes: Iterable[SimNode]) -> None:
        apply_nodes(self.admin, nodes, server_version=self.plane.version)

    def device_kubeconfig(self, name: str = "device.kubeconfig") -> Path:
        """A kubeconfig for the device client's ServiceAccount (margo-system/margo-device)."""
        return self.plane.service_account_kubeconfig(self.workdir / name, "margo-device",
                                                     "margo-system")

    def pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        return self.admin.list("Pod", namespace, selector=selector)

    def running_pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        """Pods that are Running and not being deleted."""
        return [p for p in self.pods(namespace, selector)
                if (p.get("status") or {}).get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")]

    def release_secrets(self, namespace: str) -> dict[str, str]:
        """Helm's release records in a namespace: Secret name → its `status` label."""
        return {s["metadata"]["name"]: s["metadata"]["labels"].get("status", "")
                for s in self.admin.list("Secret", namespace, selector="owner=helm")}

    def until(self, what: str, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
        return self.admin.until(what, predicate, timeout=timeout)

    def helm_releases(self) -> dict[str, list[str]]:
        """Every Helm release in the cluster (any state): namespace → names."""
        found: dict[str, list[str]] = defaultdict(list)
        for secret in self.admin.list("Secret", selector="owner=helm"):
            labels = secret["metadata"]["labels"]
            name = labels.get("name", "")
            if name and name not in found[secret["metadata"]["namespace"]]:
                found[secret["metadata"]["namespace"]].append(name)
        return dict(found)

    def clean(self) -> None:
        """Delete what the test applied, uninstall every Helm release (as the
        administrator) and delete the pods of the namespaces this test created."""
        for kind, name, namespace in reversed(self._applied):
            self.admin.delete(kind, name, namespace)
        self._applied.clear()
        for namespace, names in self.helm_releases().items():
            with helm.Config(kubeconfig_path=str(self.plane.admin_kubeconfig),
                             namespace=namespace) as admin:
                for name in names:
                    admin.uninstall(name, ignore_not_found=True)
        created = self.namespaces() - self._namespaces_before - SYSTEM_NAMESPACES
        for namespace in created:
            # Without a grace period: pods of a deleted node would otherwise wait for the
            # pod garbage collector (40 s), and kwok may take a while for the others.
            for pod in self.pods(namespace):
                with contextlib.suppress(NotFound):  # gone meanwhile
                    self.admin.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/"
                                       f"{pod['metadata']['name']}",
                                       params={"gracePeriodSeconds": "0"})
        self.until("the test's pods gone",
                   lambda: not any(self.pods(namespace) for namespace in created), timeout=120)

    def close(self) -> None:
        try:
            self.clean()
        finally:
            self.admin.close()


class RealCluster(KubeCluster):
    """The real nodes' control plane as one test sees it (nodes are started once per
    session: `set_nodes` does not apply)."""

    def __init__(self, nodes: RealNodes, workdir: Path) -> None:
        super().__init__(nodes.plane, workdir)
        self.nodes = nodes

    def set_nodes(self, nodes: Iterable[SimNode]) -> None:
        raise TypeError("a RealCluster's nodes are real; simulated nodes go on `kube`")

    def pod_log(self, namespace: str, pod: str, *, previous: bool = False) -> str:
        """The container's output, read through the API server from the kubelet."""
        params = {"previous": "true"} if previous else {}
        return self.admin.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log",
                                  params=params).text

    def pod_exec(self, namespace: str, pod: str, command: Sequence[str],
                 timeout: float = 30.0) -> tuple[int, str, str]:
        """Run `command` in the pod's container through the API server (exec over
        WebSocket, `v5.channel.k8s.io`, as kubectl does): exit code, stdout, stderr.

        Once more when the upgrade is not answered in time, or its connection breaks
        during it: on this 2-core machine, under the whole suite, an exec's WebSocket
        upgrade has gone unanswered for 30 s (seen in test_kube_real_nodes and
        test_telemetry_real_nodes), and once its TLS connection failed mid-handshake
        (`SSLError: internal error`, then `ConnectionClosedError`, in
        test_kube_real_nodes); no byte of the stream had arrived, and every command the
        tests run this way only reads."""
        try:
            return self._exec_once(namespace, pod, command, timeout)
        except (TimeoutError, _UpgradeBroken):
            return self._exec_once(namespace, pod, command, timeout)

    def _exec_once(self, namespace: str, pod: str, command: Sequence[str],
                   timeout: float) -> tuple[int, str, str]:
        pki = self.plane.pki
        assert pki is not None
        admin = pki.clients["admin"]
        query = urlencode([("command", c) for c in command]
                          + [("stdout", "true"), ("stderr", "true")])
        url = (self.plane.server.replace("https://", "wss://")
               + f"/api/v1/namespaces/{namespace}/pods/{pod}/exec?{query}")
        streams = {1: b"", 2: b"", 3: b""}
        try:
            opened = connect(url, ssl=tls_context(pki.ca_cert, admin.cert, admin.key),
                             subprotocols=["v5.channel.k8s.io"], open_timeout=timeout)
        except (ConnectionClosed, ssl.SSLError) as exc:
            raise _UpgradeBroken(f"exec upgrade broken: {exc}") from exc
        with opened as socket, contextlib.suppress(ConnectionClosed):
            while True:
                message = socket.recv(timeout)
                data = message.encode() if isinstance(message, str) else message
                if data and data[0] in streams:
                    streams[data[0]] += data[1:]
        status = json.loads(streams[3] or b"{}")
        code = 0 if status.get("status") == "Success" else next(
            (int(c["message"]) for c in (status.get("details") or {}).get("causes", [])
             if c.get("reason") == "ExitCode"), 1)
        return code, streams[1].decode(), streams[2].decode()
