"""Session fixtures for the device client's tests: one real OCI registry, one real
Kubernetes control plane (built from the pinned Go modules on first use) with simulated
nodes, a second one with two real nodes (kubelet, containerd, kube-proxy: containers run),
one real Docker engine with locally built test images, and one real OpenTelemetry
Collector, for all of them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# The fleet server's test kit (running `margo serve`, adding clients) is shared with tests/wfm.
from kits.dockerkit import DockerEngine, ImageSet, build_test_images, running_engine
from kits.kubekit import (
    DEVICE_RBAC,
    REAL_NODES,
    REAL_TEST_IMAGES,
    SINGLE_NODE,
    ControlPlane,
    KubeCluster,
    RealCluster,
    RealNodes,
)
from kits.otelkit import Collector, running_collector
from kits.registrykit import running_registry

from tools.kube.realnode import why_unavailable as real_nodes_unavailable


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`127.0.0.1:<port>` of a running docker-registry (plain HTTP)."""
    with running_registry(tmp_path_factory.mktemp("registry")) as host:
        yield host


@pytest.fixture(scope="session")
def otel_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A real OpenTelemetry Collector (tools/otel) on loopback, OTLP/HTTP and OTLP/gRPC in,
    everything it receives written to a file the tests read (kits/otelkit.py). Shared by
    the session: tests tell their records apart by attributes."""
    with running_collector(tmp_path_factory.mktemp("otel")) as collector:
        yield collector


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver (RBAC), controller manager, scheduler and kwok on loopback,
    with the device client's ServiceAccount and roles applied."""
    with ControlPlane(tmp_path_factory.mktemp("kube")) as plane:
        with plane.admin() as admin:
            admin.apply_file(DEVICE_RBAC)
        yield plane


@pytest.fixture
def kube(control_plane: ControlPlane, tmp_path: Path) -> Iterator[KubeCluster]:
    """The control plane with one schedulable node; namespaces the test creates are
    deleted afterwards."""
    cluster = KubeCluster(control_plane, tmp_path)
    cluster.set_nodes(SINGLE_NODE)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEngine]:
    """A private dockerd (its own data root, exec root and socket) and Compose v2."""
    with running_engine(tmp_path_factory.mktemp("docker")) as engine:
        yield engine


@pytest.fixture(scope="session")
def test_images(docker_engine: DockerEngine, registry: str) -> ImageSet:
    """busybox-based images, built here and pushed to the session registry."""
    return build_test_images(docker_engine, registry)


@pytest.fixture(scope="session")
def real_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodes]:
    """A control plane of their own with two real nodes (`REAL_NODES`) and cluster DNS
    (CoreDNS as a pod), the device's RBAC applied. Not skipped where nodes cannot start:
    `make venv` installs what they need, and the error says what is missing."""
    reason = real_nodes_unavailable()
    if reason is not None:
        raise RuntimeError(f"real Kubernetes nodes cannot start here: {reason}")
    folder = tmp_path_factory.mktemp("kube-real")
    with ControlPlane(folder / "plane") as plane:
        with plane.admin() as admin:
            admin.apply_file(DEVICE_RBAC)
        with RealNodes(plane, folder / "nodes", images=REAL_TEST_IMAGES,
                       cluster_dns=True) as nodes:
            nodes.start(*REAL_NODES)
            yield nodes


@pytest.fixture
def real_kube(real_nodes: RealNodes, tmp_path: Path) -> Iterator[RealCluster]:
    """The real nodes' cluster; what the test installed is removed afterwards."""
    cluster = RealCluster(real_nodes, tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()
