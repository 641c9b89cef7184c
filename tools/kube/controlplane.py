"""A real Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC, TLS, service
account tokens), kube-controller-manager, kube-scheduler and kwok playing the kubelets.

Everything is upstream code built from the pinned Go modules (`kubebuild.py`). Nothing
here imitates the API: objects are stored in etcd, admission and RBAC are the server's,
Deployments become ReplicaSets and pods through the real controllers, the real scheduler
places pods on nodes (resources, taints, topology spread), and kwok (sigs.k8s.io/kwok)
marks scheduled pods Running and Ready and keeps node leases fresh, as kubelets would.
On those simulated nodes no container ever runs: a pod is Ready when kwok says so, which
is what readiness waits, Deployment availability and DaemonSet coverage are computed
from. Real nodes, whose kubelets run containers, are added by realnode.py.

The API server sends its traffic to nodes and pods (logs, exec, proxies) through an HTTP
CONNECT proxy on a Unix socket (relay.py, its egress selector): to real nodes
(realnode.py) inside their own namespaces, and nowhere else.

`ControlPlane(folder).start()` takes a few seconds once the binaries are built; `stop()`
(or leaving the `with` block) stops every process. Each process is started with a parent
death signal, so a test run that is killed does not leave a cluster behind. Logs go to
`folder/logs/<component>.log`; `admin_kubeconfig` is a superuser kubeconfig.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tools.kube.kubeadmin import KubeAdmin, tls_context
from tools.kube.kubebuild import STAGES_FILE, binaries, kubernetes_version
from tools.kube.kubepki import Pki, create_pki
from tools.processes import die_with_parent, free_port

__all__ = ["ControlPlane", "write_kubeconfig"]

SERVICE_RANGE = "10.0.0.0/24"
POD_RANGE = "10.244.0.0/16"
#: The API server's advertised address (the `kubernetes` Service's endpoint). No host
#: interface has it: each real node serves it on its own loopback and relays to the API
#: server on the host's (relay.py), so pods reach the API server through the Service.
API_ADDRESS = "172.31.255.1"
ROOT = Path(__file__).resolve().parents[2]
#: kwok manages only nodes carrying this annotation (the node objects tests create do).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")




def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: Path | None = None,
                     key: Path | None = None, token: str | None = None,
                     user: str = "user", namespace: str | None = None) -> Path:
    """A kubeconfig with one context: a client certificate or a bearer token."""
    credentials: dict[str, Any] = {}
    if cert is not None and key is not None:
        credentials = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        credentials = {"token": token}
    context: dict[str, Any] = {"cluster": "margo-test", "user": user}
    if namespace:
        context["namespace"] = namespace
    document = {
        "apiVersion": "v1", "kind": "Config", "current-context": "margo-test",
        "clusters": [{"name": "margo-test", "cluster": {"server": server,
                                                         "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "margo-test", "context": context}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)
    return path


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class ControlPlane:
    """One cluster in `folder` (created; emptied of a previous cluster's state first)."""

    folder: Path
    bin_dir: Path | None = None
    #: etcd without fsync: tests need speed, not durability across power loss.
    fast_etcd: bool = True
    processes: list[_Process] = field(default_factory=list)
    server: str = ""
    pki: Pki | None = None
    admin_kubeconfig: Path | None = None
    version: str = field(default_factory=kubernetes_version)
    #: A short folder of /tmp (Unix socket paths are limited to about 104 bytes) for the
    #: API server's egress proxy and the real nodes' sockets (`egress_dir`).
    runtime: Path | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        bin_dir = self.bin_dir or binaries()
        for stale in ("etcd", "pki", "logs", "kubeconfigs"):
            shutil.rmtree(self.folder / stale, ignore_errors=True)
        (self.folder / "logs").mkdir(parents=True)
        pki = self.pki = create_pki(self.folder / "pki", service_ip="10.0.0.1")
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        configs = self.folder / "kubeconfigs"
        kubeconfig = {stem: write_kubeconfig(configs / f"{stem}.kubeconfig", self.server,
                                             pki.ca_cert, cert=client.cert, key=client.key,
                                             user=stem)
                      for stem, client in pki.clients.items()}
        self.admin_kubeconfig = kubeconfig["admin"]
        _remove_stale_runtimes()
        self.runtime = Path(tempfile.mkdtemp(prefix="margo-kube-", dir="/tmp"))
        (self.runtime / "nodes").mkdir()
        try:
            self._start_etcd(bin_dir, etcd_port, peer_port)
            self._start_egress()
            self._start_apiserver(bin_dir, etcd_port, api_port)
            self._start_components(bin_dir, kubeconfig)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every process (newest first), SIGKILL what has not exited after `grace`
        seconds (the API server's graceful shutdown waits for long-running watches)."""
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                process.popen.terminate()
        deadline = time.monotonic() + grace
        for process in reversed(self.processes):
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self.processes.clear()
        if self.runtime is not None:
            shutil.rmtree(self.runtime, ignore_errors=True)
            self.runtime = None

    @property
    def api_port(self) -> int:
        return int(self.server.rsplit(":", 1)[1])

    @property
    def egress_dir(self) -> Path:
        """Where each running real node puts its CONNECT socket and the addresses it owns
        (`<node>.sock`, `<node>.json`), for the API server's egress proxy."""
        if self.runtime is None:
            raise RuntimeError("the control plane is not started")
        return self.runtime / "nodes"

    def admin(self) -> KubeAdmin:
        pki = self._pki()
        client = pki.clients["admin"]
        return KubeAdmin(self.server, ca=pki.ca_cert, cert=client.cert, key=client.key)

    def service_account_kubeconfig(self, path: Path, account: str, namespace: str, *,
                                   seconds: int = 86400) -> Path:
        """A kubeconfig that authenticates as a ServiceAccount with a bound token (what a
        pod of that account is given), for `seconds`."""
        with self.admin() as admin:
            token = admin.create_token(account, namespace, seconds=seconds)
        return write_kubeconfig(path, self.server, self._pki().ca_cert, token=token,
                                user=f"{namespace}-{account}")

    def check(self) -> None:
        """Raise when a component has exited (its log's tail says why)."""
        for process in self.processes:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n"
                                   + self.log_tail(process.name))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.folder / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # --- the components ---------------------------------------------------------------------

    def _pki(self) -> Pki:
        if self.pki is None:
            raise RuntimeError("the control plane is not started")
        return self.pki

    def _spawn(self, name: str, argv: list[str],
               env: dict[str, str] | None = None) -> _Process:
        log = self.folder / "logs" / f"{name}.log"
        with open(log, "ab") as output:
            popen = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.folder, env=env,
                                     preexec_fn=die_with_parent)
        process = _Process(name, popen, log)
        self.processes.append(process)
        return process

    def _wait(self, what: str, ready: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            with contextlib.suppress(httpx.HTTPError, OSError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def _start_etcd(self, bin_dir: Path, port: int, peer: int) -> None:
        client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        argv = [str(bin_dir / "etcd"), "--name", "margo-test", "--data-dir",
                str(self.folder / "etcd"), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"margo-test={peer_url}", "--log-level", "warn"]
        if self.fast_etcd:
            argv.append("--unsafe-no-fsync")
        self._spawn("etcd", argv)
        self._wait("etcd", lambda: httpx.get(f"{client}/health", timeout=2).json().get(
            "health") == "true")

    def _start_egress(self) -> None:
        """The HTTP CONNECT proxy the API server sends node and pod traffic through
        (relay.py): only to real nodes' namespaces, never to the network."""
        runtime = self.runtime
        assert runtime is not None
        socket_path = runtime / "egress.sock"
        (self.folder / "egress.yaml").write_text(yaml.safe_dump({
            "apiVersion": "apiserver.k8s.io/v1beta1", "kind": "EgressSelectorConfiguration",
            "egressSelections": [{"name": "cluster", "connection": {
                "proxyProtocol": "HTTPConnect",
                "transport": {"uds": {"udsName": str(socket_path)}}}}]}))
        self._spawn("egress", [sys.executable, "-m", "tools.kube.relay", "egress",
                               str(socket_path), str(self.egress_dir)],
                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._wait("the egress proxy", socket_path.exists, timeout=30)

    def _start_apiserver(self, bin_dir: Path, etcd_port: int, port: int) -> None:
        pki = self._pki()
        kubelet_client = pki.clients["kubelet-client"]
        self._spawn("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", f"--advertise-address={API_ADDRESS}",
            f"--secure-port={port}", f"--cert-dir={self.folder / 'pki'}",
            f"--tls-cert-file={pki.server_cert}", f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC", f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--allow-privileged=true", "--profiling=false",
            # Real nodes: the API server authenticates to kubelets with a client
            # certificate and reaches them by their InternalIP, through the egress proxy.
            f"--kubelet-client-certificate={kubelet_client.cert}",
            f"--kubelet-client-key={kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--egress-selector-config-file={self.folder / 'egress.yaml'}", "--v=1"])
        client = pki.clients["admin"]
        context = tls_context(pki.ca_cert, client.cert, client.key)

        def ready() -> bool:
            answer = httpx.get(f"{self.server}/readyz", verify=context, timeout=2)
            return answer.status_code == 200

        self._wait("kube-apiserver", ready, timeout=90)

    def _start_components(self, bin_dir: Path, kubeconfig: dict[str, Path]) -> None:
        pki = self._pki()
        manager, scheduler = kubeconfig["controller-manager"], kubeconfig["scheduler"]
        self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={manager}",
            f"--authentication-kubeconfig={manager}", f"--authorization-kubeconfig={manager}",
            "--secure-port=0", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca_cert}", f"--service-cluster-ip-range={SERVICE_RANGE}",
            f"--cluster-cidr={POD_RANGE}", "--controllers=*,-nodeipam", "--v=1"])
        self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={scheduler}",
            f"--authentication-kubeconfig={scheduler}", f"--authorization-kubeconfig={scheduler}",
            "--secure-port=0", "--v=1"])
        self._spawn("kwok", [str(bin_dir / "kwok"), f"--kubeconfig={kubeconfig['kwok']}",
                             f"--config={self._kwok_config()}",
                             f"--config={bin_dir / STAGES_FILE}"])
        with self.admin() as admin:
            # Both components hold a leader-election Lease while they run (kwok has none).
            for lease in ("kube-controller-manager", "kube-scheduler"):
                self._wait(lease, lambda name=lease: admin.find("Lease", name, "kube-system"),
                           timeout=60)
            self._wait("the default service account",
                       lambda: admin.find("ServiceAccount", "default", "default"), timeout=60)

    def _kwok_config(self) -> Path:
        """kwok's options: it manages only the nodes annotated as simulated, renews their
        leases like kubelets do, and gives pods addresses from the pod range. (The
        parallelism settings are kwok's documented defaults, which it does not apply to
        a configuration file that sets options.)"""
        key, value = KWOK_ANNOTATION
        path = self.folder / "kwok.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
            "options": {
                "manageAllNodes": False, "manageNodesWithAnnotationSelector": f"{key}={value}",
                "cidr": POD_RANGE.replace("/16", "/24"), "nodeIP": "10.244.0.1",
                "nodeLeaseDurationSeconds": 40, "nodeLeaseParallelism": 4,
                "nodePlayStageParallelism": 4, "podPlayStageParallelism": 4,
                "podsOnNodeSyncParallelism": 4}}))
        return path


def _remove_stale_runtimes(older_than: float = 120.0) -> None:
    """Runtime folders of control planes killed before they could remove them: their
    egress socket no longer answers."""
    for folder in Path("/tmp").glob("margo-kube-*"):
        with contextlib.suppress(OSError):
            if time.time() - folder.stat().st_mtime < older_than:
                continue
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(str(folder / "egress.sock"))
            except OSError:
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                probe.close()


@contextlib.contextmanager
def running_control_plane(folder: Path) -> Iterator[ControlPlane]:
    with ControlPlane(folder) as plane:
        yield plane
