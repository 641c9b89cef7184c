"""The configuration files of one real node (realnode.py): containerd's, the CNI network's,
the kubelet's and kube-proxy's, each with the settings these machines need and why.

Every path a component would otherwise take from the host (`/var/lib/containerd`,
`/etc/cni/net.d`, `/opt/cni/bin`, `/var/lib/kubelet`, ...) points into the node's folder;
what cannot be pointed elsewhere lands on the node's private tmpfs mounts (nodeinit.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CNI_PLUGINS", "CNI_SOURCE", "NodeLayout", "containerd_toml", "kube_proxy_yaml",
           "kubelet_yaml", "write_cni"]

#: Debian's containernetworking-plugins; only these are linked into a node's CNI folder.
CNI_SOURCE = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
SANDBOX_IMAGE = "margo-gitops.dev/pause:1"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"


@dataclass(frozen=True)
class NodeLayout:
    """Where one node keeps its files (all under `folder`)."""

    folder: Path

    @property
    def containerd_root(self) -> Path:
        return self.folder / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.folder / "kubelet"

    @property
    def cni_bin(self) -> Path:
        return self.folder / "cni" / "bin"

    @property
    def cni_conf(self) -> Path:
        return self.folder / "cni" / "net.d"

    @property
    def cni_state(self) -> Path:
        return self.folder / "cni" / "ipam"

    @property
    def logs(self) -> Path:
        return self.folder / "logs"


def containerd_toml(layout: NodeLayout) -> str:
    """containerd 1.6 with its CRI plugin, private in every path.

    - `restrict_oom_score_adj = true`: runc sets each container's oom_score_adj, and
      lowering it needs CAP_SYS_RESOURCE, which root lacks on these machines; without this
      every container fails with `can't get final child's PID from pipe: EOF`.
    - `SystemdCgroup = false`: no systemd here; cgroupfs like the kubelet (`cgroupDriver`).
    - the `opt` plugin is disabled: it would create /opt/containerd on the host.
    - no registry is configured: nothing can be pulled here; images are imported
      (nodeimages.py), and the kubelet's default `IfNotPresent` finds them.
    """
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    lines = [
        "version = 2",
        f'root = "{layout.containerd_root}"',
        'state = "/run/containerd"',
        "oom_score = 0",
        'disabled_plugins = ["io.containerd.internal.v1.opt", '
        '"io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", '
        '"io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", '
        '"io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]',
        "[grpc]",
        f'  address = "{CONTAINERD_SOCKET}"',
        "[ttrpc]",
        f'  address = "{CONTAINERD_SOCKET}.ttrpc"',
        f"[{cri}]",
        f'  sandbox_image = "{SANDBOX_IMAGE}"',
        "  restrict_oom_score_adj = true",
        "  enable_selinux = false",
        "  disable_apparmor = true",
        f"[{cri}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"[{cri}.containerd.runtimes.runc]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"[{cri}.containerd.runtimes.runc.options]",
        "  SystemdCgroup = false",
        f"[{cri}.cni]",
        f'  bin_dir = "{layout.cni_bin}"',
        f'  conf_dir = "{layout.cni_conf}"',
    ]
    return "\n".join(lines) + "\n"


def write_cni(layout: NodeLayout, pod_cidr: str) -> None:
    """A bridge network for the node's pods (its own range, its own IPAM state), and the
    plugins it needs linked from Debian's package."""
    layout.cni_bin.mkdir(parents=True, exist_ok=True)
    layout.cni_conf.mkdir(parents=True, exist_ok=True)
    for plugin in CNI_PLUGINS:
        link = layout.cni_bin / plugin
        if not link.exists():
            link.symlink_to(CNI_SOURCE / plugin)
    network = {
        "cniVersion": "0.4.0", "name": "margo-pods",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(layout.cni_state),
                      "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}
    (layout.cni_conf / "10-margo-pods.conflist").write_text(json.dumps(network, indent=2))


def kubelet_yaml(*, ca: Path, cgroup_root: str,
                 taints: list[dict[str, str]], cluster_dns: str | None) -> str:
    """The kubelet's configuration.

    - `failCgroupV1: false`: these machines have cgroup v1, which the kubelet refuses
      since 1.35 unless told otherwise.
    - `cgroupRoot`: below the caller's own memory cgroup (nodeinit.py), removed at stop.
    - client certificates only (`x509`), anonymous off: the API server's kubelet client
      certificate is the one caller (logs, exec); any holder of a CA-signed certificate
      may, since `AlwaysAllow` is its authorization (there is no other client).
    - `resolvConf: ""`: pods get no host name servers (the host's are not reachable
      from the node's namespace, and must not be tried).
    - eviction thresholds and image garbage collection low/off: a shared test machine's
      disk and memory must not evict test pods or the imported images (nothing can be
      pulled again).
    """
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "address": "0.0.0.0", "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "staticPodPath": "", "resolvConf": "", "failSwapOn": False,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "registerWithTaints": taints, "serializeImagePulls": False,
        "podLogsDir": "/var/log/pods", "shutdownGracePeriod": "0s",
        "nodeStatusUpdateFrequency": "5s",
    }
    if cluster_dns:
        config["clusterDNS"] = [cluster_dns]
        config["clusterDomain"] = "cluster.local"
    return yaml.safe_dump(config, sort_keys=False)


def kube_proxy_yaml(kubeconfig: Path, *, name: str, cluster_cidr: str) -> str:
    """kube-proxy in iptables mode, inside the node's network namespace.

    - `masqueradeAll`: a Service's reply from a pod on the same bridge would otherwise go
      straight back to the client, un-NATed (that needs br_netfilter's bridge hooks,
      which a node cannot count on); SNAT sends it back through the node.
    - conntrack sizes and timeouts left as they are (0): those settings are machine-wide.
    - `oomScoreAdj: 0`: lowering it needs CAP_SYS_RESOURCE (see containerd_toml).
    """
    return yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)}, "hostnameOverride": name,
        "mode": "iptables", "clusterCIDR": cluster_cidr,
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "oomScoreAdj": 0, "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249"}, sort_keys=False)
