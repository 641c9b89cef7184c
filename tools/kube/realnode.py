"""Real Kubernetes nodes beside the loopback control plane: a kubelet, containerd and
kube-proxy per node, running real containers.

Each node is one process tree, `unshare --mount --pid --fork` around nodeinit.py, which
gives it private mounts, its own PID and network namespaces and a cgroup root of its own,
and starts Debian's containerd (CRI plugin, Debian's CNI bridge plugin), the kubelet and
kube-proxy built from the pinned module (kubebuild.py). The host is left as it was found:
every mount, interface, iptables rule and process of the node is inside its namespaces
and ends with them; its cgroups and files are removed when it stops.

    with RealNodes(plane, folder) as nodes:
        nodes.start(RealNode("real-a"), RealNode("real-b", zone="zone-b"))

`start` waits until every node is Ready. Nodes are labelled `margo-gitops.dev/real-node:
"true"` and, unless told otherwise (`taints=()`), tainted with the same key
(`NoSchedule`), so workloads meant for simulated nodes never land on them. No image can be
pulled here: each node imports the pause image, the example fleet's images and any the
caller adds (nodeimages.py). `why_unavailable()` says, before trying, why nodes cannot start here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.kube.clusterdns import DNS_ADDRESS, deploy_cluster_dns, dns_image
from tools.kube.controlplane import API_ADDRESS, POD_RANGE, ROOT, ControlPlane, write_kubeconfig
from tools.kube.kubeadmin import KubeAdmin
from tools.kube.kubebuild import binaries
from tools.kube.kubenodes import node_ready
from tools.kube.kubepki import issue_client_cert
from tools.kube.nodeconfig import (
    CNI_PLUGINS,
    CNI_SOURCE,
    NodeLayout,
    containerd_toml,
    kube_proxy_yaml,
    kubelet_yaml,
    write_cni,
)
from tools.kube.nodeimages import EXAMPLE_IMAGES, PAUSE, Image, archive
from tools.kube.nodeinit import cgroup_mounts, make_cgroup_root, remove_cgroups
from tools.processes import die_with_parent

__all__ = ["REAL_NODE_LABEL", "REAL_NODE_TAINT", "RealNode", "RealNodes", "RunningNode",
           "tree", "why_unavailable"]

REAL_NODE_LABEL = ("margo-gitops.dev/real-node", "true")
REAL_NODE_TAINT = {"key": "margo-gitops.dev/real-node", "value": "true",
                   "effect": "NoSchedule"}
#: The nodes' fabric (nodeinit.setup_network): node IPs, and the fabric's own address
#: (the last one), through which nodes reach each other's pods. Only inside namespaces.
NODE_NETWORK = ipaddress.ip_network("172.31.250.0/24")
FABRIC_ADDRESS = str(NODE_NETWORK[-2])
_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "unshare", "ip", "iptables",
          "mount")


def _which(name: str) -> str | None:
    return shutil.which(name, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")


def why_unavailable() -> str | None:
    """None when real nodes can start here; otherwise why not, for people."""
    if sys.platform != "linux":
        return "real nodes need Linux namespaces and cgroups"
    if os.geteuid() != 0:
        return "real nodes need root (containerd, mounts, namespaces)"
    missing = [name for name in _TOOLS if _which(name) is None]
    if missing:
        return (f"missing {', '.join(missing)} (Debian packages containerd, runc, iproute2, "
                "iptables, util-linux)")
    plugins = [p for p in CNI_PLUGINS if not (CNI_SOURCE / p).exists()]
    if plugins:
        return f"missing CNI plugins {', '.join(plugins)} (Debian containernetworking-plugins)"
    if not Path("/bin/busybox").is_file():
        return "no /bin/busybox for the node images (Debian busybox-static)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay file system (containerd's snapshotter)"
    probe = subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make namespaces here: {probe.stderr.strip()[-300:]}"
    return None


@dataclass(frozen=True)
class RealNode:
    """What a node is to be: its name, zone, extra labels and its taints."""

    name: str
    zone: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = (REAL_NODE_TAINT,)
    kube_proxy: bool = True

    def node_labels(self) -> dict[str, str]:
        found = {REAL_NODE_LABEL[0]: REAL_NODE_LABEL[1], **self.labels}
        if self.zone:
            found["topology.kubernetes.io/zone"] = self.zone
        return found


@dataclass
class RunningNode:
    spec: RealNode
    folder: Path
    ip: str
    pod_cidr: str
    cgroup_root: str
    process: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return self.spec.name

    def log_tail(self, component: str = "init", lines: int = 30) -> str:
        """The end of a component's log: init, containerd, kubelet or kube-proxy."""
        path = self.folder / "logs" / f"{component}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check(self) -> None:
        if self.process.poll() is not None:
            tails = "\n".join(f"--- {component}:\n{self.log_tail(component, 15)}"
                              for component in ("containerd", "kubelet", "kube-proxy"))
            raise RuntimeError(f"real node {self.name} exited with {self.process.returncode}:"
                               f"\n{self.log_tail('init')}\n{tails}")


def _memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


class RealNodes:
    """Real nodes joined to `plane`, with their files under `folder`. The nodes of one
    `RealNodes` share a fabric: a second one on the same plane gets node numbers of its
    own, but its pods do not reach the first one's."""

    def __init__(self, plane: ControlPlane, folder: Path, *, images: Sequence[Image] = (),
                 cluster_dns: bool = False) -> None:
        self.plane = plane
        self.folder = folder
        self.images = (PAUSE, *EXAMPLE_IMAGES, *images)
        #: Run CoreDNS (clusterdns.py) once the first nodes are Ready, and give pods its
        #: address as their name server.
        self.cluster_dns = cluster_dns
        self.nodes: dict[str, RunningNode] = {}
        self._archive: Path | None = None
        self._cgroup_parents: list[Path] = []
        self._fabric: subprocess.Popen[bytes] | None = None
        self._fabric_fd: int | None = None

    def __enter__(self) -> RealNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- starting -----------------------------------------------------------------------

    def start(self, *specs: RealNode, timeout: float = 90.0) -> list[RunningNode]:
        """Start every node at once and wait until all are Ready."""
        reason = why_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot start real nodes: {reason}")
        bin_dir = binaries()
        if not self.nodes:
            self._cgroup_parents = make_cgroup_root(_memory_cgroup() or "/")
            _remove_stale_cgroups()
        if self._fabric is None:
            self._start_fabric()
        with self.plane.admin() as admin:
            self._grant_node_rights(admin)
            started = [self._launch(spec, bin_dir) for spec in specs]
            try:
                for node in started:
                    admin.until(f"real node {node.name} Ready",
                                lambda node=node: node.check() or self._ready(admin, node.name),
                                timeout=timeout)
                if self.cluster_dns:
                    deploy_cluster_dns(admin, timeout=timeout)
            except BaseException:
                for node in started:
                    self.stop(node.name)
                raise
        return started

    @staticmethod
    def _ready(admin: KubeAdmin, name: str) -> bool:
        found = admin.find("Node", name)
        return found is not None and node_ready(found)

    def _grant_node_rights(self, admin: KubeAdmin) -> None:
        """The API server authorizes by RBAC only (no Node authorizer): kubelets get the
        built-in `system:node` role through their group."""
        admin.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                     "metadata": {"name": "margo-gitops:real-nodes"},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                 "kind": "ClusterRole", "name": "system:node"},
                     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                                   "name": "system:nodes"}]})

    def _start_fabric(self) -> None:
        """A network namespace held by a sleeping process, with a bridge that every
        node's veth joins and that routes between their pod ranges."""
        self._fabric = subprocess.Popen(["unshare", "--net", "sleep", "infinity"],
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        target = f"/proc/{self._fabric.pid}/ns/net"
        deadline = time.monotonic() + 10
        while os.readlink(target) == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline or self._fabric.poll() is not None:
                raise RuntimeError("the nodes' fabric namespace did not start")
            time.sleep(0.01)
        self._fabric_fd = os.open(target, os.O_RDONLY)
        prefix = NODE_NETWORK.prefixlen
        for argv in (["ip", "link", "set", "lo", "up"],
                     ["ip", "link", "add", "fabric", "type", "bridge"],
                     ["ip", "addr", "add", f"{FABRIC_ADDRESS}/{prefix}", "dev", "fabric"],
                     ["ip", "link", "set", "fabric", "up"],
                     ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]):
            subprocess.run(["nsenter", f"--net={target}", *argv], check=True,
                           capture_output=True, timeout=30)

    def _stop_fabric(self) -> None:
        if self._fabric_fd is not None:
            os.close(self._fabric_fd)
            self._fabric_fd = None
        if self._fabric is not None:
            self._fabric.terminate()
            self._fabric.wait(10)
            self._fabric = None

    def _index(self) -> int:
        """The lowest node number free on this control plane (nodes of other managers
        included: their cards are in the egress folder)."""
        taken = set()
        for card in self.plane.egress_dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                taken.add(int(json.loads(card.read_text())["index"]))
        return next(i for i in range(1, 250) if i not in taken)

    def _images(self, bin_dir: Path) -> Path:
        if self._archive is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._archive = self.folder / "images.tar"
            images = [*self.images, *([dns_image(bin_dir)] if self.cluster_dns else [])]
            self._archive.write_bytes(archive(images))
        return self._archive

    def _launch(self, spec: RealNode, bin_dir: Path) -> RunningNode:
        if spec.name in self.nodes:
            raise ValueError(f"real node {spec.name} is already running")
        index = self._index()
        ip, pod_cidr = str(NODE_NETWORK[index]), f"10.244.{index}.0/24"
        folder = self.folder / spec.name
        shutil.rmtree(folder, ignore_errors=True)
        layout = NodeLayout(folder)
        layout.logs.mkdir(parents=True)
        # The starting process's id too: two test runs may both have a `real-a`.
        cgroup_root = f"{_memory_cgroup()}/margo-node-{os.getpid()}-{spec.name}"
        spec_file = self._write_files(spec, layout, bin_dir, ip=ip, pod_cidr=pod_cidr,
                                      index=index, cgroup_root=cgroup_root)
        with open(layout.logs / "init.log", "ab") as log:
            process = subprocess.Popen(
                ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                 sys.executable, "-m", "tools.kube.nodeinit", str(spec_file)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=die_with_parent,
                pass_fds=(self._fabric_fd,) if self._fabric_fd is not None else ())
        node = RunningNode(spec, folder, ip, pod_cidr, cgroup_root, process)
        self.nodes[spec.name] = node
        return node

    def _write_files(self, spec: RealNode, layout: NodeLayout, bin_dir: Path, *, ip: str,
                     pod_cidr: str, index: int, cgroup_root: str) -> Path:
        plane, folder = self.plane, layout.folder
        pki = plane.pki
        assert pki is not None
        server = f"https://127.0.0.1:{plane.api_port}"
        kubelet_cert = issue_client_cert(pki, folder / "pki", "kubelet",
                                         f"system:node:{spec.name}", ("system:nodes",))
        proxy_cert = issue_client_cert(pki, folder / "pki", "kube-proxy", "system:kube-proxy")
        kubelet_kubeconfig = write_kubeconfig(folder / "kubelet.kubeconfig", server, pki.ca_cert,
                                              cert=kubelet_cert.cert, key=kubelet_cert.key)
        proxy_kubeconfig = write_kubeconfig(folder / "kube-proxy.kubeconfig", server,
                                            pki.ca_cert, cert=proxy_cert.cert,
                                            key=proxy_cert.key)
        (folder / "containerd.toml").write_text(containerd_toml(layout))
        write_cni(layout, pod_cidr)
        (folder / "kubelet.yaml").write_text(kubelet_yaml(
            ca=pki.ca_cert, cgroup_root=cgroup_root,
            taints=[dict(t) for t in spec.taints],
            cluster_dns=DNS_ADDRESS if self.cluster_dns else None))
        (folder / "kube-proxy.yaml").write_text(kube_proxy_yaml(
            proxy_kubeconfig, name=spec.name, cluster_cidr=POD_RANGE))
        labels = ",".join(f"{k}={v}" for k, v in spec.node_labels().items())
        egress = plane.egress_dir
        host_ports = [plane.api_port]
        node_spec = {
            "folder": str(folder), "nodeIP": ip, "apiAddress": API_ADDRESS, "index": index,
            "podCIDR": pod_cidr, "fabricFd": self._fabric_fd, "fabricAddress": FABRIC_ADDRESS,
            "fabricPrefix": NODE_NETWORK.prefixlen,
            "hostPorts": host_ports, "connectSocket": str(egress / f"{spec.name}.sock"),
            "cgroupRoot": cgroup_root, "ctr": _which("ctr"), "images": [str(self._images(bin_dir))],
            # The kubelet's folder, on disk, at a path short enough for its sockets.
            "binds": {"/var/lib/kubelet": str(layout.kubelet_root)},
            "containerd": [_which("containerd"), "--config", str(folder / "containerd.toml")],
            "kubelet": [str(bin_dir / "kubelet"), f"--config={folder / 'kubelet.yaml'}",
                        f"--kubeconfig={kubelet_kubeconfig}", f"--hostname-override={spec.name}",
                        f"--node-ip={ip}", f"--node-labels={labels}",
                        "--root-dir=/var/lib/kubelet", "--v=1"],
            "kubeProxy": [str(bin_dir / "kube-proxy"), f"--config={folder / 'kube-proxy.yaml'}",
                          "--v=1"] if spec.kube_proxy else None}
        spec_file = folder / "node.json"
        spec_file.write_text(json.dumps(node_spec, indent=2))
        # The egress proxy's card: which addresses this node answers for.
        (egress / f"{spec.name}.json").write_text(json.dumps(
            {"name": spec.name, "index": index, "addresses": [ip], "podCIDRs": [pod_cidr]}))
        return spec_file

    # --- stopping -----------------------------------------------------------------------

    def stop(self, name: str | None = None, *, forget: bool = True, grace: float = 20.0) -> None:
        """Stop one node (or all): its init stops the kubelet, kube-proxy and containerd
        and kills every container; then its cgroups and files are removed and, with
        `forget`, its Node object is deleted."""
        names = [name] if name is not None else list(self.nodes)
        for each in names:
            node = self.nodes.pop(each, None)
            if node is None:
                continue
            _stop_tree(node.process, grace)
            _remove_cgroups(node.cgroup_root)
            for suffix in (".json", ".sock"):
                with contextlib.suppress(OSError, RuntimeError):
                    (self.plane.egress_dir / f"{each}{suffix}").unlink()
            if forget and self.plane.processes:
                with contextlib.suppress(Exception), self.plane.admin() as admin:
                    admin.delete("Node", each)
            shutil.rmtree(node.folder, ignore_errors=True)
        if not self.nodes:
            # The folders of our own cgroup that other hierarchies lacked: made at the
            # first start, so that every node's root exists in every hierarchy.
            remove_cgroups(self._cgroup_parents)
            self._cgroup_parents = []
            self._stop_fabric()
            if self._archive is not None:
                self._archive.unlink(missing_ok=True)
                self._archive = None

    def memory(self) -> dict[str, int]:
        """Resident memory of each node's process tree, in bytes (for figures)."""
        return {name: _tree_rss(node.process.pid) for name, node in self.nodes.items()}


def children(pid: int) -> list[int]:
    """The child processes of `pid` (none once it is gone)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (a node's whole tree: for figures)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children(current)
    return found


def _tree_rss(pid: int) -> int:
    total = 0
    for each in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _stop_tree(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the node's init (unshare's child: unshare itself ignores SIGTERM while it
    waits), then SIGKILL unshare, whose `--kill-child` takes the namespace down."""
    for child in children(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _remove_stale_cgroups() -> None:
    """Cgroups of nodes whose starter was killed before it could remove them (named
    `margo-node-<its pid>-<node>`, that process gone)."""
    for mount in cgroup_mounts():
        parent = mount / (_memory_cgroup() or "/").lstrip("/")
        for stale in parent.glob("margo-node-*"):
            pid = stale.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                remove_cgroups([stale])


def _remove_cgroups(root: str) -> None:
    """What init could not remove (it was killed): the node's cgroups, deepest first,
    once the kernel has ended their processes."""
    tops = [mount / root.lstrip("/") for mount in cgroup_mounts()]
    deadline = time.monotonic() + 10
    while any(top.exists() for top in tops) and time.monotonic() < deadline:
        remove_cgroups([top for top in tops if top.exists()])
        if any(top.exists() for top in tops):
            time.sleep(0.1)
