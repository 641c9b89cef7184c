"""Test clusters for capability discovery, assembled from recorded API objects
(tests/fixtures/kubernetes, recorded from real clusters and copied verbatim; its
README says where each object was recorded), plus a TLS API stand-in for the client's
credential tests.

How each cluster is assembled (every cluster also serves the recorded `/api`
(apiserver-api-apiversions.json) and `/apis` (kind-v1.34-apis-apigrouplist.json) bodies:
no recorded cluster has all three discovery answers):

- `k3s_single()`: a real single-node k3s v1.31 cluster as one support bundle recorded it:
  NodeList `k3s-v1.31-single-node-nodelist.json`, `/version` `k3s-v1.31-version.json`,
  StorageClassList `k3s-v1.31-storageclasslist.json`, the kube-system PodList
  `k3s-v1.31-kube-system-podlist.json` and its DaemonSetList (svclb, not a collector).
- `gpu_three_node()`: three nodes of different recordings, served with kind's `/version`
  (`kind-v1.20-version.json`): `kind-control-plane` (tainted NoSchedule under the legacy
  master key) and `kind-worker2` from `kind-v1.20-3-node-nodelist-taints.json`, and the GPU
  node `ip-172-31-21-92` (Tesla T4, GPU Feature Discovery and NFD labels) from
  `mixed-7-node-nodelist-with-gpu-nfd.json` with ONE edit: its `node-role.kubernetes.io/*`
  labels are removed, so it is the cluster's GPU worker (recorded, it is a kURL control
  plane without taints). Plus the recorded `nvidia` RuntimeClass
  (`k3s-v1.31-runtimeclass-nvidia.json`). No pods are recorded for these nodes.
- `mixed_arch()`: the k3d arm64 server `k3d-mycluster-server-0`
  (`k3d-arm64-k3s-v1.24-nodelist.json`, `/version` `k3d-arm64-k3s-v1.24-version.json`) and
  the amd64 AKS agent `aks-agentpool-30520393-vmss000000`
  (`aks-v1.18-3-node-nodelist-topology.json`, zone 0, region southcentralus), unchanged.

Synthetic objects (no recording exists) are built here and named as such: pods with chosen
requests (`make_pod`), a CRD (`make_crd`), and the recorded OpenTelemetry collector
DaemonSet given a `status` (`otel_daemonset`; recorded, it is a rendered manifest without
one).
"""

from __future__ import annotations

import copy
import datetime
import http.server
import ipaddress
import json
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kits.kubeemu import Emulator
from kits.stubserver import serving, url

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes"
NODES = "v1/nodes"
PODS = "v1/pods"
STORAGE_CLASSES = "storage.k8s.io/v1/storageclasses"
INGRESS_CLASSES = "networking.k8s.io/v1/ingressclasses"
RUNTIME_CLASSES = "node.k8s.io/v1/runtimeclasses"
DAEMONSETS = "apps/v1/daemonsets"
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"


def recorded(name: str) -> Any:
    """A recorded object or list, parsed (a fresh copy each time)."""
    text = (FIXTURES / name).read_text(encoding="utf-8")
    return yaml.safe_load(text) if name.endswith(".yaml") else json.loads(text)


def recorded_node(file: str, name: str) -> dict[str, Any]:
    doc = recorded(file)
    for item in doc.get("items", [doc]):
        if item["metadata"]["name"] == name:
            return dict(item)
    raise KeyError(f"{file} has no node {name!r}")


@dataclass
class Cluster:
    """What the emulator serves: discovery bodies and objects by resource."""

    version: dict[str, Any]
    objects: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    api: dict[str, Any] = field(default_factory=lambda: recorded("apiserver-api-apiversions.json"))
    apis: dict[str, Any] = field(
        default_factory=lambda: recorded("kind-v1.34-apis-apigrouplist.json"))

    def add(self, resource: str, *objects: dict[str, Any]) -> Cluster:
        self.objects.setdefault(resource, []).extend(objects)
        return self


def _items(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc.get("items", [doc]))


def k3s_single() -> Cluster:
    cluster = Cluster(version=recorded("k3s-v1.31-version.json"))
    cluster.add(NODES, *_items(recorded("k3s-v1.31-single-node-nodelist.json")))
    cluster.add(PODS, *_items(recorded("k3s-v1.31-kube-system-podlist.json")))
    cluster.add(STORAGE_CLASSES, *_items(recorded("k3s-v1.31-storageclasslist.json")))
    cluster.add(DAEMONSETS, *_items(recorded("k3s-v1.31-kube-system-daemonsetlist.json")))
    return cluster


GPU_NODE = "ip-172-31-21-92"


def gpu_worker() -> dict[str, Any]:
    """The recorded Tesla T4 node, its node-role labels removed (the one edit)."""
    node = copy.deepcopy(recorded_node("mixed-7-node-nodelist-with-gpu-nfd.json", GPU_NODE))
    labels = node["metadata"]["labels"]
    for key in [k for k in labels if k.startswith("node-role.kubernetes.io/")]:
        del labels[key]
    return node


def gpu_three_node() -> Cluster:
    kind = "kind-v1.20-3-node-nodelist-taints.json"
    cluster = Cluster(version=recorded("kind-v1.20-version.json"))
    cluster.add(NODES, recorded_node(kind, "kind-control-plane"),
                recorded_node(kind, "kind-worker2"), gpu_worker())
    cluster.add(RUNTIME_CLASSES, recorded("k3s-v1.31-runtimeclass-nvidia.json"))
    return cluster


def mixed_arch() -> Cluster:
    cluster = Cluster(version=recorded("k3d-arm64-k3s-v1.24-version.json"))
    cluster.add(NODES, *_items(recorded("k3d-arm64-k3s-v1.24-nodelist.json")),
                recorded_node("aks-v1.18-3-node-nodelist-topology.json",
                              "aks-agentpool-30520393-vmss000000"))
    return cluster


def serve(emulator: Emulator, cluster: Cluster) -> Emulator:
    """Make the emulator answer as `cluster`."""
    emulator.set_version(cluster.version)
    emulator.set_discovery(api=cluster.api, apis=cluster.apis)
    for resource, objects in cluster.objects.items():
        emulator.load(resource, *objects)
    return emulator


# --- synthetic objects ----------------------------------------------------------------------

def make_pod(name: str, node: str | None, *, cpu: str | None = None, memory: str | None = None,
             namespace: str = "default", phase: str = "Running",
             extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod with one container requesting `cpu`/`memory` (and `extra` resources)."""
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    requests.update(extra or {})
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox",
                                            "resources": {"requests": requests}}]}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec,
            "status": {"phase": phase}}


def make_crd(group: str, kind: str, versions: list[tuple[str, bool]]) -> dict[str, Any]:
    """A CustomResourceDefinition serving the versions marked True."""
    plural = kind.lower() + "s"
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Cluster",
                     "names": {"kind": kind, "plural": plural},
                     "versions": [{"name": v, "served": served, "storage": i == 0}
                                  for i, (v, served) in enumerate(versions)]}}


def otel_daemonset(*, desired: int | None, ready: int | None) -> dict[str, Any]:
    """The recorded collector DaemonSet, with a status when `desired` is given."""
    daemonset = recorded("otel-collector-agent-daemonset-rendered-nostatus.yaml")
    daemonset["metadata"]["namespace"] = "observability"
    if desired is not None:
        daemonset["status"] = {"desiredNumberScheduled": desired, "numberReady": ready,
                               "currentNumberScheduled": desired, "numberMisscheduled": 0}
    return daemonset


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- TLS stand-in for the client's credential handling --------------------------------------

@dataclass
class Pki:
    """PEM files of a CA, a server certificate for 127.0.0.1, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _certificate("test-ca", ca_key, "test-ca", ca_key, ca=True)
    server = _certificate("apiserver", server_key, "test-ca", ca_key, server=True)
    client = _certificate("margo-device", client_key, "test-ca", ca_key)
    files = {}
    for name, data in (("ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
                       ("server.pem", server.public_bytes(serialization.Encoding.PEM)),
                       ("server-key.pem", _pem_key(server_key)),
                       ("client.pem", client.public_bytes(serialization.Encoding.PEM)),
                       ("client-key.pem", _pem_key(client_key))):
        (folder / name).write_bytes(data)
        files[name] = folder / name
    return Pki(files["ca.pem"], files["server.pem"], files["server-key.pem"],
               files["client.pem"], files["client-key.pem"])


class _EchoHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with what it saw: path, Authorization header, client certificate."""

    def do_GET(self) -> None:
        peer = self.connection.getpeercert() if hasattr(self.connection, "getpeercert") else None
        subject = dict(x[0] for x in (peer or {}).get("subject", ()))
        body = json.dumps({"gitVersion": "v1.31.2", "path": self.path,
                           "authorization": self.headers.get("Authorization"),
                           "clientCN": subject.get("commonName")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def https_echo(pki: Pki) -> Iterator[str]:
    """An HTTPS server on 127.0.0.1 (certificate from `pki`, client certificates optional
    but verified); yields its URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.load_verify_locations(pki.ca)
    context.verify_mode = ssl.CERT_OPTIONAL
    with serving(_EchoHandler, tls=context) as server:
        yield url(server)
