"""Kubernetes capability discovery against recorded clusters served by the API emulator
(kmock over real HTTP on loopback, see kubeemu.py; clusters assembled in clusterkit.py), the
read-only client's credentials against a real TLS server, and the provider's debounce.

Why the emulator here: these clusters are other distributions (k3s, kind, k3d, AKS, EKS)
whose `/version`, discovery documents and node labels a real control plane of ours cannot
produce on demand, and faults such as an expired continue token (410) come on request. What
real RBAC, the real scheduler and the DaemonSet controller do to the same reads is
tests/reconciler/test_kube_real.py.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import helm_python
import httpx
import pytest
import yaml
from kits.clusterkit import (
    CRDS,
    DAEMONSETS,
    GPU_NODE,
    NODES,
    PODS,
    RUNTIME_CLASSES,
    STORAGE_CLASSES,
    FakeClock,
    gpu_three_node,
    gpu_worker,
    https_echo,
    k3s_single,
    make_crd,
    make_pki,
    make_pod,
    mixed_arch,
    otel_daemonset,
    recorded,
    serve,
)
from kits.kubeemu import Emulator, running_emulator, write_kubeconfig

from margo.cluster import EXTENSION_KEY, LABEL_PREFIX, validate_cluster_manifest
from margo.kinds import Kind
from margo.validation import validate_value
from reconciler.kubernetes.client import (
    ClusterAccess,
    Forbidden,
    KubeClient,
    KubeConfigError,
    KubeError,
    Unauthorized,
    in_cluster_access,
    load_kubeconfig,
)
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.discovery import discover
from reconciler.kubernetes.facts import guess_platform, pod_requests
from reconciler.kubernetes.provider import KubernetesProvider, significant_change

DEVICE = "plant-a/cluster-1"


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Emulator]:
    with running_emulator(tmp_path / "emulator") as running:
        yield running


def document(emulator: Emulator, **identity: Any) -> dict[str, Any]:
    with KubeClient.from_kubeconfig(emulator.kubeconfig) as client:
        return capabilities_document(discover(client), device_id=DEVICE, **identity)


def body(doc: dict[str, Any]) -> dict[str, Any]:
    cluster: dict[str, Any] = doc[EXTENSION_KEY]["cluster"]
    return cluster


def node(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(n for n in body(doc)["resources"]["nodes"]
                                 if n["name"] == name)
    return found


def label(doc: dict[str, Any], key: str) -> Any:
    return doc["labels"][LABEL_PREFIX + key]


def unknown(doc: dict[str, Any]) -> dict[str, str]:
    return {u["what"]: u["reason"] for u in body(doc).get("unknown", [])}


def dead_server(tmp_path: Path) -> Path:
    """A kubeconfig for a loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return write_kubeconfig(tmp_path / "dead-kubeconfig", f"http://127.0.0.1:{port}")


# --- the client -----------------------------------------------------------------------------

def kubeconfig(path: Path, contexts: dict[str, tuple[dict[str, Any], dict[str, Any]]],
               current: str) -> Path:
    """A kubeconfig with one cluster and user per context."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": current,
        "clusters": [{"name": n, "cluster": c} for n, (c, _) in contexts.items()],
        "users": [{"name": n, "user": u} for n, (_, u) in contexts.items()],
        "contexts": [{"name": n, "context": {"cluster": n, "user": n}} for n in contexts]}))
    return path


def test_kubeconfig_current_and_named_contexts_with_relative_files(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.pem").write_bytes(b"CA")
    (tmp_path / "token").write_text("from-file\n")
    path = kubeconfig(tmp_path / "config", {
        "edge": ({"server": "https://10.0.0.1:6443/", "certificate-authority": "certs/ca.pem"},
                 {"token": "t0k3n"}),
        "lab": ({"server": "https://lab:6443", "insecure-skip-tls-verify": True},
                {"tokenFile": "token"}),
    }, current="edge")

    edge = load_kubeconfig(path)
    assert (edge.server, edge.ca_pem, edge.token, edge.insecure) == (
        "https://10.0.0.1:6443", b"CA", "t0k3n", False)
    lab = load_kubeconfig(path, "lab")
    assert (lab.server, lab.insecure, lab.token_file) == ("https://lab:6443", True,
                                                          tmp_path / "token")
    assert "t0k3n" not in repr(edge)  # credentials never reach logs
    with pytest.raises(KubeConfigError, match="no context named 'nope'"):
        load_kubeconfig(path, "nope")


@pytest.mark.parametrize(("user", "message"), [
    ({"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}},
     "exec credential plugin"),
    ({"auth-provider": {"name": "oidc"}}, "auth-provider plugins are not supported"),
    ({"client-certificate-data": "%%%not base64"}, "client-certificate-data is not base64"),
])
def test_kubeconfig_users_it_refuses(tmp_path: Path, user: dict[str, Any],
                                     message: str) -> None:
    path = kubeconfig(tmp_path / "config", {"c": ({"server": "https://x"}, user)}, "c")
    with pytest.raises(KubeConfigError, match=message):
        load_kubeconfig(path)


def test_kubeconfig_that_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "config").write_text("- a list\n")
    with pytest.raises(KubeConfigError, match="not a kubeconfig"):
        load_kubeconfig(tmp_path / "config")
    (tmp_path / "config").write_text("clusters: []\n")
    with pytest.raises(KubeConfigError, match="no current-context"):
        load_kubeconfig(tmp_path / "config")


def test_in_cluster_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_bytes(b"CA")
    access = in_cluster_access({"KUBERNETES_SERVICE_HOST": "fd00::1",
                                "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert (access.server, access.token_file, access.ca_pem) == (
        "https://[fd00::1]:443", tmp_path / "token", b"CA")
    with pytest.raises(KubeConfigError, match="not running in a cluster"):
        in_cluster_access({}, tmp_path)
    (tmp_path / "token").unlink()
    with pytest.raises(KubeConfigError, match="no service account token"):
        in_cluster_access({"KUBERNETES_SERVICE_HOST": "10.43.0.1",
                           "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)


def test_tls_with_inline_ca_client_certificate_and_token(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    with https_echo(pki) as url:
        path = kubeconfig(tmp_path / "config", {
            "mtls": ({"server": url, "certificate-authority-data": b64(pki.ca)},
                     {"client-certificate-data": b64(pki.client_cert),
                      "client-key-data": b64(pki.client_key), "token": "abc"}),
            "files": ({"server": url, "certificate-authority": str(pki.ca)},
                      {"client-certificate": str(pki.client_cert),
                       "client-key": str(pki.client_key)}),
            "untrusted": ({"server": url}, {}),
            "skip": ({"server": url, "insecure-skip-tls-verify": True}, {}),
        }, current="mtls")
        with KubeClient.from_kubeconfig(path) as client:
            seen = client.get("/version")
        assert (seen["authorization"], seen["clientCN"]) == ("Bearer abc", "margo-device")
        with KubeClient.from_kubeconfig(path, "files") as client:
            assert client.get("/version")["clientCN"] == "margo-device"
        with KubeClient.from_kubeconfig(path, "untrusted") as client, \
                pytest.raises(KubeError) as failed:
            client.get("/version")
        assert failed.value.unreachable and "CERTIFICATE_VERIFY_FAILED" in failed.value.message
        with KubeClient.from_kubeconfig(path, "skip") as client:
            assert client.get("/version") == {"gitVersion": "v1.31.2", "path": "/version",
                                              "authorization": None, "clientCN": None}
    assert not list(Path(tmp_path).glob("margo-kube-*"))  # key files did not linger


def test_token_file_is_read_for_every_request(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    token = tmp_path / "token"
    token.write_text("first\n")
    with https_echo(pki) as url, KubeClient(ClusterAccess(
            server=url, ca_pem=pki.ca.read_bytes(), token_file=token)) as client:
        assert client.get("/version")["authorization"] == "Bearer first"
        token.write_text("rotated\n")
        assert client.get("/version")["authorization"] == "Bearer rotated"


def test_list_follows_continue_tokens_and_restarts_when_they_expire(
        emulator: Emulator) -> None:
    pods = recorded("k3s-v1.31-kube-system-podlist.json")
    names = sorted(emulator.load(PODS, pods))
    with KubeClient.from_kubeconfig(emulator.kubeconfig, page_size=2) as client:
        assert sorted(p["metadata"]["name"] for p in client.list("/api/v1/pods")) == names
        emulator.expire_continue_tokens()
        assert sorted(p["metadata"]["name"] for p in client.list("/api/v1/pods")) == names
    assert len(names) == 7


def test_errors_say_forbidden_not_found_and_unreachable(emulator: Emulator,
                                                        tmp_path: Path) -> None:
    emulator.forbid(NODES)
    with KubeClient.from_kubeconfig(emulator.kubeconfig) as client:
        with pytest.raises(Forbidden) as forbidden:
            client.list("/api/v1/nodes")
        assert (forbidden.value.status, forbidden.value.reason) == (403, "Forbidden")
        assert "nodes is forbidden" in forbidden.value.message
        with pytest.raises(KubeError) as missing:
            client.list("/apis/example.com/v1/widgets")
        assert missing.value.status == 404 and not isinstance(missing.value, Forbidden)
    with KubeClient.from_kubeconfig(dead_server(tmp_path)) as client, \
            pytest.raises(KubeError) as dead:
        client.get("/version")
    assert dead.value.status is None and dead.value.unreachable
    unauthorized = KubeError.from_response(httpx.Response(401, json={
        "kind": "Status", "reason": "Unauthorized", "message": "Unauthorized"}))
    assert isinstance(unauthorized, Unauthorized) and unauthorized.status == 401


# --- discovery, cluster by cluster ---------------------------------------------------------

def test_k3s_single_node_field_by_field(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    doc = document(emulator, vendor="Acme", labels={"example.com/site": "plant-a"})
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)

    properties = doc["properties"]
    assert {k: properties[k] for k in ("id", "vendor", "modelNumber", "serialNumber")} == {
        "id": DEVICE, "vendor": "Acme", "modelNumber": "unknown", "serialNumber": "unknown"}
    # 4 cores allocatable; coredns and metrics-server request 100m/70Mi each, the finished
    # helm-install jobs and request-less pods count nothing.
    assert properties["cpus"] == [{"cores": 3.8, "architecture": "amd64"}]
    assert properties["memory"] == "15Gi"  # 16379772Ki - 140Mi = 15.5Gi, rounded down
    assert properties["storage"] == "68Gi"    # ephemeral 73958691987 bytes
    assert properties["peripherals"] == [] and properties["interfaces"] == []
    assert (properties["supportedDeploymentTypes"], properties["supportedRuntimes"],
            properties["otelCollector"]) == (["helm"], ["oci"], False)

    assert doc["labels"] == {
        "example.com/site": "plant-a",
        LABEL_PREFIX + "architectures": ["amd64"], LABEL_PREFIX + "control-plane-nodes": 1,
        LABEL_PREFIX + "default-storage-class": "local-path", LABEL_PREFIX + "gpu-vendors": [],
        LABEL_PREFIX + "gpus": 0, LABEL_PREFIX + "minor": 31, LABEL_PREFIX + "nodes": 1,
        LABEL_PREFIX + "platform": "k3s", LABEL_PREFIX + "regions": [],
        LABEL_PREFIX + "schedulable-nodes": 1, LABEL_PREFIX + "version": "1.31.2",
        LABEL_PREFIX + "zones": []}

    cluster = body(doc)
    assert cluster["metadata"] == {"id": DEVICE, "kubernetesVersion": "1.31.2+k3s1",
                                   "platform": "k3s"}
    groups = {g["name"]: g["versions"] for g in cluster["apiSurface"]["apiGroups"]}
    assert groups[""] == ["v1"] and groups["apps"] == ["v1"]
    assert groups["autoscaling"] == ["v2", "v1"]  # the preferred version first
    assert len(groups) == 21 and list(groups) == sorted(groups)
    assert cluster["apiSurface"]["customResourceDefinitions"] == []
    assert cluster["resources"]["allocatable"] == {
        "cpu": "4", "memory": "16379772Ki", "ephemeralStorage": "73958691987"}
    assert (cluster["resources"]["nodeCount"], cluster["resources"]["nodeSummary"]) == (1, [
        {"architecture": "amd64", "allocatableCpu": "4", "allocatableMemory": "16379772Ki"}])
    assert node(doc, "primary-node") == {
        "name": "primary-node", "roles": ["control-plane", "master"], "controlPlane": True,
        "ready": True, "schedulable": True, "architecture": "amd64", "os": "linux",
        "kubeletVersion": "v1.31.2+k3s1", "containerRuntime": "containerd://1.7.22-k3s1",
        "allocatable": {"cpu": 4, "memory": "16379772Ki", "ephemeralStorage": "73958691987"},
        "requested": {"cpu": 0.2, "memory": "140Mi", "ephemeralStorage": "0"},
        "available": {"cpu": 3.8, "memory": "16236412Ki", "ephemeralStorage": "73958691987"},
        "gpus": [], "taints": [], "labels": {}, "workloads": []}
    assert cluster["capabilities"] == {
        "supportedDeploymentTypes": ["helm"],
        "storageClasses": [{"name": "local-path", "provisioner": "rancher.io/local-path",
                            "isDefault": True}],
        "ingressClasses": [], "runtimeClasses": [], "otelCollector": False}
    assert cluster["helmVersion"] == helm_python.helm_sdk_version()
    assert "unknown" not in cluster
    assert validate_cluster_manifest(cluster_manifest_of(doc)) == []


def cluster_manifest_of(doc: dict[str, Any]) -> dict[str, Any]:
    from margo.cluster import cluster_manifest_from_capabilities
    return cluster_manifest_from_capabilities(doc)


def test_three_node_cluster_with_a_gpu_worker(emulator: Emulator) -> None:
    serve(emulator, gpu_three_node())
    emulator.load(PODS, make_pod("inference", GPU_NODE, cpu="250m", memory="1Gi",
                                 extra={"nvidia.com/gpu": "1"}),
                  make_pod("done", "kind-worker2", cpu="7", phase="Succeeded"),
                  make_pod("pending", None, cpu="64"),
                  make_pod("elsewhere", "kind-worker", cpu="1"))
    doc = document(emulator)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)

    # The tainted control plane takes no pods: one cpus entry per schedulable node.
    assert doc["properties"]["cpus"] == [{"cores": 0.75, "architecture": "amd64"},
                                         {"cores": 8, "architecture": "amd64"}]
    # The inference pod holds the only GPU: not offered, and named as its holder.
    assert doc["properties"]["peripherals"] == []
    assert body(doc)["resources"]["gpus"] == [
        {"node": GPU_NODE, "resource": "nvidia.com/gpu", "index": 0, "manufacturer": "NVIDIA",
         "model": "Tesla-T4", "allocatedTo": "pod:default/inference"}]
    assert (label(doc, "nodes"), label(doc, "schedulable-nodes"),
            label(doc, "control-plane-nodes"), label(doc, "gpus"),
            label(doc, "gpu-vendors"), label(doc, "version")) == (3, 2, 1, 1, ["nvidia"],
                                                                 "1.20.0")
    assert LABEL_PREFIX + "platform" not in doc["labels"]  # kind says nothing: no guess
    assert LABEL_PREFIX + "default-storage-class" not in doc["labels"]

    gpu = node(doc, GPU_NODE)
    assert (gpu["roles"], gpu["controlPlane"], gpu["schedulable"]) == ([], False, True)
    assert gpu["architecture"] == "amd64"  # the label, not nodeInfo's edited "x86_64"
    assert gpu["gpus"] == [{"resource": "nvidia.com/gpu", "count": 1, "manufacturer": "NVIDIA",
                            "model": "Tesla-T4"}]
    assert gpu["requested"] == {"cpu": 0.25, "memory": "1Gi", "ephemeralStorage": "0",
                                "nvidia.com/gpu": 1}
    assert gpu["available"]["nvidia.com/gpu"] == 0 and gpu["available"]["cpu"] == 0.75
    assert gpu["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert gpu["labels"]["feature.node.kubernetes.io/cpu-cpuid.AVX512F"] == "true"
    assert not [k for k in gpu["labels"] if k.startswith(("nvidia.com/gpu.deploy.",
                                                          "nvidia.com/gfd.", "kubernetes.io/"))]
    control = node(doc, "kind-control-plane")
    assert (control["controlPlane"], control["schedulable"], control["taints"]) == (
        True, False, [{"key": "node-role.kubernetes.io/master", "effect": "NoSchedule"}])
    assert node(doc, "kind-worker2")["requested"]["cpu"] == 0  # its pod has Succeeded

    resources = body(doc)["resources"]
    assert resources["allocatable"] == {"cpu": "17", "memory": "77708552Ki",
                                        "ephemeralStorage": "735529008998",
                                        "gpu": {"nvidia.com/gpu": 1}}
    assert resources["nodeCount"] == 3
    assert resources["nodeSummary"][0] == {
        "architecture": "amd64", "allocatableCpu": "1", "allocatableMemory": "16064760Ki",
        "allocatableGpu": {"nvidia.com/gpu": 1}}
    assert body(doc)["capabilities"]["runtimeClasses"] == [{"name": "nvidia",
                                                           "handler": "nvidia"}]


def test_mixed_amd64_and_arm64_cluster(emulator: Emulator) -> None:
    serve(emulator, mixed_arch())
    doc = document(emulator)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert doc["properties"]["cpus"] == [{"cores": 1.9, "architecture": "amd64"},
                                         {"cores": 2, "architecture": "arm64"}]
    assert doc["properties"]["memory"] == "11Gi"  # 11579780Ki, rounded down
    assert (label(doc, "architectures"), label(doc, "zones"), label(doc, "regions"),
            label(doc, "version"), label(doc, "minor"), label(doc, "platform")) == (
        ["amd64", "arm64"], ["0"], ["southcentralus"], "1.24.4", 24, "k3s")
    aks = node(doc, "aks-agentpool-30520393-vmss000000")
    assert (aks["roles"], aks["zone"], aks["region"], aks["containerRuntime"]) == (
        ["agent"], "0", "southcentralus", "docker://19.3.14")
    assert node(doc, "k3d-mycluster-server-0")["architecture"] == "arm64"
    assert [s["architecture"] for s in body(doc)["resources"]["nodeSummary"]] == [
        "amd64", "arm64"]


def test_output_is_deterministic_whatever_order_the_server_lists(tmp_path: Path) -> None:
    docs = []
    for index, order in enumerate((1, -1)):
        cluster = gpu_three_node()
        cluster.objects[NODES] = cluster.objects[NODES][::order]
        with running_emulator(tmp_path / str(index)) as emulator:
            serve(emulator, cluster)
            emulator.load(CRDS, *[make_crd(g, k, [("v1", True)])
                                  for g, k in [("b.example", "B"), ("a.example", "A")][::order]])
            docs.append(document(emulator))
    assert docs[0] == docs[1]
    assert [c["group"] for c in body(docs[0])["apiSurface"]["customResourceDefinitions"]] == [
        "a.example", "b.example"]


def test_crds_report_served_versions_only(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    emulator.load(CRDS, make_crd("gpu-operator.nvidia.com", "ClusterPolicy",
                                 [("v1", True), ("v1alpha1", False)]),
                  make_crd("retired.example.com", "Gone", [("v1", False)]))
    assert body(document(emulator))["apiSurface"]["customResourceDefinitions"] == [
        {"group": "gpu-operator.nvidia.com", "kind": "ClusterPolicy", "versions": ["v1"]}]


def test_pod_requests_follow_the_scheduler() -> None:
    pod = {"spec": {
        "containers": [{"resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
                       {"resources": {"requests": {"cpu": "200m"}}}],
        "initContainers": [
            {"resources": {"requests": {"cpu": "1", "memory": "32Mi"}}},
            {"restartPolicy": "Always", "resources": {"requests": {"cpu": "50m"}}},
            {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}],
        "overhead": {"cpu": "10m", "memory": "1Mi"}}}
    # containers 300m + sidecar 50m = 350m, but the first init step needs 1 core, the last
    # 500m + the running sidecar: max is 1 core; memory: the last init step (1Gi) wins.
    assert pod_requests(pod) == {"cpu": Decimal("1.010"),
                                 "memory": Decimal(1024**3 + 1024**2)}
    assert pod_requests({"spec": {"containers": [{}]}}) == {}


# --- what cannot be read is said, never claimed ----------------------------------------------

def test_pods_forbidden_claims_no_available_resources(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    emulator.forbid(PODS)
    doc = document(emulator)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert not {"cpus", "memory", "storage"} & set(doc["properties"])
    primary = node(doc, "primary-node")
    assert "requested" not in primary and "available" not in primary
    assert primary["allocatable"]["cpu"] == 4  # what is known is still reported
    reasons = unknown(doc)
    assert list(reasons) == ["resources.nodes.available"]
    assert "forbidden by RBAC" in reasons["resources.nodes.available"]
    assert label(doc, "nodes") == 1
    assert validate_cluster_manifest(cluster_manifest_of(doc)) == []


def test_storage_classes_and_crds_forbidden(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    emulator.forbid(STORAGE_CLASSES, CRDS)
    doc = document(emulator)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert "storageClasses" not in body(doc)["capabilities"]
    assert "customResourceDefinitions" not in body(doc)["apiSurface"]
    assert LABEL_PREFIX + "default-storage-class" not in doc["labels"]
    assert set(unknown(doc)) == {"capabilities.storageClasses",
                                 "apiSurface.customResourceDefinitions"}
    assert doc["properties"]["cpus"] == [{"cores": 3.8, "architecture": "amd64"}]


def test_nodes_forbidden_leaves_resources_and_collector_unknown(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    emulator.forbid(NODES, "/apis")
    doc = document(emulator)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert "resources" not in body(doc)
    assert not {"cpus", "memory", "storage", "peripherals", "otelCollector"} & set(
        doc["properties"])
    assert not {"nodes", "gpus", "architectures", "zones"} & {
        k.removeprefix(LABEL_PREFIX) for k in doc["labels"]}
    assert set(unknown(doc)) == {"resources", "capabilities.otelCollector",
                                 "apiSurface.apiGroups"}
    # /api still answered: the core group is reported, the rest is said to be unknown
    assert body(doc)["apiSurface"]["apiGroups"] == [{"name": "", "versions": ["v1"]}]
    assert validate_cluster_manifest(cluster_manifest_of(doc)) == []


def test_unreachable_api_server_fails_discovery(tmp_path: Path) -> None:
    with KubeClient.from_kubeconfig(dead_server(tmp_path)) as client, \
            pytest.raises(KubeError) as failed:
        discover(client)
    assert failed.value.unreachable


@pytest.mark.parametrize(("daemonset", "expected"), [
    (otel_daemonset(desired=None, ready=None), False),  # no status: not seen working
    (otel_daemonset(desired=2, ready=2), True),
    (otel_daemonset(desired=3, ready=3), True),           # also on the tainted control plane
    (otel_daemonset(desired=2, ready=1), False),          # one node without a collector
    (otel_daemonset(desired=1, ready=1), False),          # does not cover every node
])
def test_opentelemetry_collector_must_cover_every_schedulable_node(
        emulator: Emulator, daemonset: dict[str, Any], expected: bool) -> None:
    serve(emulator, gpu_three_node())
    emulator.load(DAEMONSETS, daemonset)
    assert document(emulator)["properties"]["otelCollector"] is expected


def test_daemonsets_forbidden_leaves_the_collector_unknown(emulator: Emulator) -> None:
    serve(emulator, gpu_three_node())
    emulator.load(DAEMONSETS, otel_daemonset(desired=2, ready=2))
    emulator.forbid(DAEMONSETS)
    doc = document(emulator)
    assert "otelCollector" not in doc["properties"]
    assert "otelCollector" not in body(doc)["capabilities"]
    # DaemonSets own pods too: without them, no node says whose pods it runs.
    assert set(unknown(doc)) == {"capabilities.otelCollector", "resources.nodes.workloads"}
    assert all("workloads" not in n for n in body(doc)["resources"]["nodes"])


def test_platform_is_guessed_from_versions_then_labels() -> None:
    assert guess_platform("v1.31.6+rke2r1") == "rke2"
    assert guess_platform("v1.29.1-eks-b9c9ed7") == "eks"
    assert guess_platform("v1.30.2", node_labels=[{"kubernetes.azure.com/cluster": "x"}]) == (
        "aks")
    assert guess_platform("v1.30.2", node_labels=[{"kubernetes.io/os": "linux"}]) is None


# --- the provider: debounce, threshold, unreachable -----------------------------------------

def provider(emulator: Emulator, clock: FakeClock, **options: Any) -> KubernetesProvider:
    return KubernetesProvider(DEVICE, kubeconfig=emulator.kubeconfig, clock=clock,
                              serial_number="SN-1", **options)


def test_small_request_churn_is_not_a_change(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    clock = FakeClock()
    kube = provider(emulator, clock)
    first = kube.gather()
    assert first["properties"]["serialNumber"] == "SN-1"
    emulator.load(PODS, make_pod("small", "primary-node", cpu="300m", memory="512Mi"))
    clock.advance(60)
    assert kube.gather() == first and not kube.change_pending
    clock.advance(60)
    assert kube.gather() == first  # 0.3 of 4 cores and 512Mi of 15.6Gi: under 10%


def test_a_large_change_is_returned_after_the_debounce(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    clock = FakeClock()
    kube = provider(emulator, clock)
    first = kube.gather()
    emulator.load(PODS, make_pod("big", "primary-node", cpu="2", memory="1Gi"))
    assert kube.gather() == first and kube.change_pending   # seen once
    clock.advance(29)
    assert kube.gather() == first                            # not yet 30 s
    clock.advance(1)
    changed = kube.gather()
    assert changed["properties"]["cpus"] == [{"cores": 1.8, "architecture": "amd64"}]
    assert not kube.change_pending and kube.document == changed


def test_a_change_that_goes_away_is_never_returned(emulator: Emulator) -> None:
    serve(emulator, k3s_single())
    clock = FakeClock()
    kube = provider(emulator, clock)
    first = kube.gather()
    emulator.load(PODS, make_pod("burst", "primary-node", cpu="3"))
    assert kube.gather() == first and kube.change_pending
    emulator.remove(PODS, "burst", "default")
    clock.advance(40)
    assert kube.gather() == first and not kube.change_pending
    emulator.load(PODS, make_pod("burst", "primary-node", cpu="3"))
    clock.advance(40)
    assert kube.gather() == first  # seen again: the debounce starts over


def test_gpu_node_joining_and_leaving_is_re_reported(emulator: Emulator) -> None:
    cluster = gpu_three_node()
    cluster.objects[NODES] = [n for n in cluster.objects[NODES]
                              if n["metadata"]["name"] != GPU_NODE]
    serve(emulator, cluster)
    clock = FakeClock()
    kube = provider(emulator, clock, debounce_seconds=10)
    before = kube.gather()
    assert label(before, "gpus") == 0 and before["properties"]["peripherals"] == []
    emulator.load(NODES, gpu_worker())
    assert kube.gather() == before
    clock.advance(10)
    joined = kube.gather()
    assert label(joined, "gpus") == 1 and label(joined, "nodes") == 3
    emulator.remove(NODES, GPU_NODE)
    kube.gather()
    clock.advance(10)
    assert kube.gather() == before


def test_unreachable_server_keeps_the_last_document(tmp_path: Path) -> None:
    clock = FakeClock()
    with running_emulator(tmp_path / "emulator") as emulator:
        serve(emulator, k3s_single())
        kube = provider(emulator, clock)
        good = kube.gather()
        emulator.load(PODS, make_pod("big", "primary-node", cpu="2"))
        kube.gather()
        assert kube.change_pending
    clock.advance(60)
    assert kube.gather() == good  # the emulator is gone
    assert isinstance(kube.last_error, KubeError) and kube.last_error.unreachable
    assert not kube.change_pending  # the change was not seen twice in a row

    never = KubernetesProvider(DEVICE, kubeconfig=dead_server(tmp_path))
    with pytest.raises(KubeError):
        never.gather()
    assert never.document is None and isinstance(never.last_error, KubeError)


def test_significant_change_thresholds() -> None:
    def doc(cpu: float, memory: str, *, ready: bool = True) -> dict[str, Any]:
        return {"properties": {"id": "x"}, EXTENSION_KEY: {"cluster": {"resources": {"nodes": [
            {"name": "n1", "ready": ready, "allocatable": {"cpu": 4, "memory": "16Gi"},
             "available": {"cpu": cpu, "memory": memory}}]}}}}
    assert not significant_change(doc(3.8, "15Gi"), doc(3.5, "14Gi"))
    assert significant_change(doc(3.8, "15Gi"), doc(3.3, "15Gi"))
    assert significant_change(doc(3.8, "15Gi"), doc(3.8, "13Gi"))
    assert significant_change(doc(3.8, "15Gi"), doc(3.8, "15Gi", ready=False))
    assert not significant_change(doc(3.8, "15Gi"), doc(3.3, "15Gi"), threshold=0.2)


def test_provider_rejects_nonsense_settings(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="threshold"):
        KubernetesProvider(DEVICE, kubeconfig=tmp_path / "k", threshold=1.5)
    with pytest.raises(ValueError, match="debounce"):
        KubernetesProvider(DEVICE, kubeconfig=tmp_path / "k", debounce_seconds=-1)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigError, match="not running in a cluster"):
        KubernetesProvider(DEVICE).observe()


def test_rbac_runtime_class_listing_is_optional(emulator: Emulator) -> None:
    serve(emulator, gpu_three_node())
    emulator.forbid(RUNTIME_CLASSES)
    doc = document(emulator)
    assert "runtimeClasses" not in body(doc)["capabilities"]
    assert set(unknown(doc)) == {"capabilities.runtimeClasses"}
