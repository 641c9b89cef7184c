"""Cluster DNS for real nodes: CoreDNS (built by kubebuild.py from tools/kube/dns) run as a
pod, the way kubeadm runs it: a Deployment in kube-system with its ServiceAccount and the
read rights of CoreDNS's own `system:coredns` role, behind the `kube-dns` Service at
`DNS_ADDRESS`, which every real node's kubelet gives its pods as their name server.

CoreDNS reads Services, EndpointSlices, pods and namespaces through the `kubernetes`
Service with its ServiceAccount token, so a Ready CoreDNS is also a pod that reached the
API server. It answers `cluster.local` and the reverse zones only: there is no upstream
to forward other names to (no network), so they fail at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.kube.kubeadmin import KubeAdmin
from tools.kube.kubebuild import DNS_BINARY
from tools.kube.nodeimages import Image

__all__ = ["DNS_ADDRESS", "DNS_IMAGE", "deploy_cluster_dns", "dns_image"]

DNS_ADDRESS = "10.0.0.10"
DNS_IMAGE = "margo-gitops.dev/coredns:1"
COREFILE = """\
.:53 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
}
"""


def dns_image(bin_dir: Path) -> Image:
    """CoreDNS and its Corefile on the busybox root file system."""
    return Image(DNS_IMAGE, ("/coredns", "-conf", "/etc/coredns/Corefile"),
                 {"coredns": (bin_dir / DNS_BINARY).read_bytes(),
                  "etc/coredns/Corefile": COREFILE}, executable=("coredns",))


def _objects() -> list[dict[str, Any]]:
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": "kube-system"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods",
                                                     "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns",
                       "namespace": "kube-system"}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {
                 "serviceAccountName": "coredns", "dnsPolicy": "Default",
                 "priorityClassName": "system-cluster-critical",
                 "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
                 "containers": [{
                     "name": "coredns", "image": DNS_IMAGE,
                     "ports": [{"containerPort": 53, "protocol": "UDP", "name": "dns"},
                               {"containerPort": 53, "protocol": "TCP", "name": "dns-tcp"}],
                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181},
                                        "periodSeconds": 1},
                     "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                     "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"clusterIP": DNS_ADDRESS, "selector": labels, "ports": [
             {"name": "dns", "port": 53, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}},
    ]


def deploy_cluster_dns(admin: KubeAdmin, *, timeout: float = 90.0) -> None:
    """Apply CoreDNS's objects and wait until it is Ready (it has read the cluster)."""
    for obj in _objects():
        admin.apply(obj)
    admin.until("CoreDNS Ready", lambda: (admin.get("Deployment", "coredns", "kube-system")
                                          .get("status") or {}).get("readyReplicas") == 1,
                timeout=timeout)
