"""HelmDriver on a real Kubernetes control plane: the real Helm v4 engine installing real
charts (pulled from the real OCI registry) into a real kube-apiserver, with the production
options (namespace creation, server-side apply, OpenAPI validation by the server) and
Helm's Secret storage, as the device client's ServiceAccount under the documented RBAC.

The controller manager turns Deployments into pods, the scheduler places them (a pod that
requests more CPU than any node has stays Pending) and kwok marks placed pods Ready, so
`wait` waits for real Deployment availability. A crash in the middle of an operation is a
real SIGKILL of another process holding the operation; its release stays `pending-*` in
Helm's records, which the next driver finds.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pyrage
import pytest
from kits.chartkit import (
    DEPLOYMENT_ID,
    actions,
    converge,
    greeter,
    make_deployment,
    publish_chart,
    publish_example_charts,
    write_chart,
)
from kits.kubekit import ROOT as REPO_ROOT
from kits.kubekit import SINGLE_NODE, KubeCluster, SimNode

from margo.sealing import seal
from reconciler.charts import ChartCache
from reconciler.desired import DesiredDeployment
from reconciler.drivers.helm import HelmDriver
from reconciler.encryption_key import DeviceKey
from reconciler.errors import ApplyError
from reconciler.planner import Action, Step, plan
from reconciler.releases import (
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_SPEC,
    MANAGER,
    ReleaseState,
    release_name,
    short_digest,
)

RELEASE = release_name(DEPLOYMENT_ID, "greeter")


@pytest.fixture(scope="module")
def repos(registry: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`greeter`: 1.0.0 and 2.0.0 (ConfigMap and a Deployment), 3.0.0 (broken template);
    `hungry`: 1.0.0 whose pod asks for 64 CPUs (never schedulable on our nodes), and
    `hungry-greeter`: greeter 2.0.0 asking for as much;
    `service`: a Service the API server refuses (port 99999); `clusterwide`: a ClusterRole,
    which the device's RBAC does not allow."""
    src = tmp_path_factory.mktemp("charts")
    for version in ("1.0.0", "2.0.0"):
        publish_chart(registry, write_chart(src / "a", version=version, deployment=True),
                      repo_path="helm")
    greeter_repo = publish_chart(registry, write_chart(src / "a", version="3.0.0", broken=True),
                                 repo_path="helm")
    hungry_greeter = publish_chart(registry, write_chart(src / "h", version="2.0.0",
                                                         deployment=True, cpu="64"),
                                   repo_path="helm-hungry")
    hungry = publish_chart(registry, write_chart(src / "b", name="hungry", deployment=True,
                                                 cpu="64"), repo_path="helm")
    refused = write_chart(src / "c", name="refused")
    (refused / "templates" / "service.yaml").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Service
        metadata: {name: {{ .Release.Name }}}
        spec:
          ports: [{port: 99999}]
        """))
    clusterwide = write_chart(src / "d", name="clusterwide")
    (clusterwide / "templates" / "role.yaml").write_text(textwrap.dedent("""\
        apiVersion: rbac.authorization.k8s.io/v1
        kind: ClusterRole
        metadata: {name: {{ .Release.Name }}-reader}
        rules: [{apiGroups: [""], resources: [pods], verbs: [get]}]
        """))
    return {"greeter": greeter_repo, "hungry": hungry, "hungry-greeter": hungry_greeter,
            "refused": publish_chart(registry, refused, repo_path="helm"),
            "clusterwide": publish_chart(registry, clusterwide, repo_path="helm")}


@pytest.fixture
def charts(tmp_path: Path) -> Iterator[ChartCache]:
    with ChartCache(tmp_path / "cache") as cache:
        yield cache


@pytest.fixture
def device_kubeconfig(kube: KubeCluster) -> Path:
    return kube.device_kubeconfig()


@pytest.fixture
def driver(device_kubeconfig: Path, charts: ChartCache) -> Iterator[HelmDriver]:
    """The driver as a device runs it: the device's ServiceAccount, Secret storage."""
    helm_driver = HelmDriver(charts, kubeconfig=device_kubeconfig)
    yield helm_driver
    helm_driver.close()


def configmap(kube: KubeCluster, name: str = f"{RELEASE}-config",
              namespace: str = "edge") -> dict[str, str] | None:
    found = kube.admin.find("ConfigMap", name, namespace)
    return None if found is None else found["data"]


def install_by_hand(kube: KubeCluster, charts: ChartCache, repository: str, name: str,
                    labels: dict[str, str] | None = None) -> None:
    """A release someone installed with Helm directly, as the cluster's administrator."""
    chart = charts.load(charts.fetch(repository, "1.0.0"))
    with helm.Config(kubeconfig_path=str(kube.plane.admin_kubeconfig), namespace="edge") as admin:
        admin.install(chart, name, {}, namespace="edge", create_namespace=True, labels=labels)


def test_install_creates_the_namespace_objects_and_a_secret_record(
        driver: HelmDriver, kube: KubeCluster, repos: dict[str, str]) -> None:
    namespace = "fresh-install"
    assert namespace not in kube.namespaces()
    desired = greeter(repos["greeter"], greeting="Hi there", replicas=2, wait=True,
                      namespace=namespace)
    assert actions(converge(driver, [desired])) == ["install:greeter"]
    assert namespace in kube.namespaces()
    assert configmap(kube, namespace=namespace) == {
        "greeting": "Hi there", "replicas": "2", "chartVersion": "1.0.0"}
    deployment = kube.admin.get("Deployment", RELEASE, namespace)
    assert deployment["status"]["availableReplicas"] == 2  # `wait` waited for it
    assert {p["spec"]["nodeName"] for p in kube.running_pods(namespace)} == {"edge-0"}
    # Server-side apply: the fields are owned by Helm's field manager (reconciler.helm_engine
    # says why it is still the interpreter's name).
    managers = {m["manager"]: m["operation"] for m in deployment["metadata"]["managedFields"]}
    assert "Apply" in managers.values(), managers
    assert kube.release_secrets(namespace) == {f"sh.helm.release.v1.{RELEASE}.v1": "deployed"}
    [installed] = driver.installed()
    assert (installed.release_name, installed.namespace, installed.component) == (
        RELEASE, namespace, "greeter")
    assert (installed.healthy, installed.detail, installed.chart_version, installed.drift) == (
        True, "deployed", "1.0.0", "")
    record = driver.config(namespace).status(RELEASE)
    assert record["labels"][LABEL_DEPLOYMENT] == DEPLOYMENT_ID
    assert driver.config(namespace).get_values(RELEASE) == {
        "config": {"greeting": "Hi there"}, "replicaCount": 2}
    assert actions(converge(driver, [desired])) == []  # converged


def test_upgrade_moves_the_release_to_the_new_chart(driver: HelmDriver, kube: KubeCluster,
                                                     repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "1.0.0", wait=True)])
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0", wait=True)])) == [
        "upgrade:greeter"]
    assert configmap(kube)["chartVersion"] == "2.0.0"
    images = {p["spec"]["containers"][0]["image"] for p in kube.running_pods("edge")}
    assert images == {"registry.example.com/greeter:2.0.0"}
    [installed] = driver.installed()
    assert (installed.healthy, installed.chart_version) == (True, "2.0.0")
    history = driver.config("edge").history(RELEASE)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"),
                                                                 (2, "deployed")]


def test_reconfigure_sets_exactly_the_desired_values(driver: HelmDriver, kube: KubeCluster,
                                                      repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Hello", replicas=3)])
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Servus")])) \
        == ["reconfigure:greeter"]
    assert configmap(kube) == {"greeting": "Servus", "replicas": "1", "chartVersion": "2.0.0"}
    # No parameters left: the chart's defaults again, not the previous values reused.
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0")])) == [
        "reconfigure:greeter"]
    assert configmap(kube)["greeting"] == "Hello"
    assert not driver.config("edge").get_values(RELEASE)  # no values of our own (null)


def test_remove_uninstalls_the_objects_and_the_records(driver: HelmDriver, kube: KubeCluster,
                                                       repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "2.0.0", wait=True)])
    assert configmap(kube) is not None
    the_plan = converge(driver, [])
    assert actions(the_plan) == ["remove:greeter"]
    assert configmap(kube) is None
    assert kube.admin.find("Deployment", RELEASE, "edge") is None
    assert kube.release_secrets("edge") == {}
    assert driver.installed() == []
    driver.apply(the_plan.changes[0], None)  # removing again is fine


def test_a_restarted_driver_finds_its_releases_and_reinstalls_nothing(
        device_kubeconfig: Path, tmp_path: Path, kube: KubeCluster,
        repos: dict[str, str]) -> None:
    desired = [greeter(repos["greeter"], "2.0.0", greeting="Persisted", wait=True)]
    with ChartCache(tmp_path / "one") as cache:
        first = HelmDriver(cache, kubeconfig=device_kubeconfig)
        converge(first, desired)
        first.close()
    # A new process would start with an empty chart cache and a new driver: Helm's own
    # records in the cluster are all it needs.
    with ChartCache(tmp_path / "two") as cache:
        second = HelmDriver(cache, kubeconfig=device_kubeconfig)
        try:
            assert [r.release_name for r in second.installed()] == [RELEASE]
            assert actions(converge(second, desired)) == []
        finally:
            second.close()
    assert kube.release_secrets("edge") == {f"sh.helm.release.v1.{RELEASE}.v1": "deployed"}


def test_releases_without_our_labels_are_never_returned_or_touched(
        driver: HelmDriver, kube: KubeCluster, charts: ChartCache,
        repos: dict[str, str]) -> None:
    install_by_hand(kube, charts, repos["greeter"], "by-hand")
    install_by_hand(kube, charts, repos["greeter"], "half-labelled",
                    labels={LABEL_MANAGED_BY: MANAGER})  # no deployment/component labels
    converge(driver, [greeter(repos["greeter"], "2.0.0")])
    found = {r.release_name: r.state for r in driver.installed()}
    assert found == {RELEASE: ReleaseState.DEPLOYED, "by-hand": ReleaseState.UNMANAGED,
                     "half-labelled": ReleaseState.UNMANAGED}
    converge(driver, [])  # removes ours only
    assert {r.release_name for r in driver.installed()} == {"by-hand", "half-labelled"}
    assert set(kube.release_secrets("edge")) == {"sh.helm.release.v1.by-hand.v1",
                                                  "sh.helm.release.v1.half-labelled.v1"}
    assert configmap(kube, "by-hand-config") is not None


def test_a_foreign_release_with_our_name_is_left_alone(driver: HelmDriver, kube: KubeCluster,
                                                       charts: ChartCache,
                                                       repos: dict[str, str]) -> None:
    install_by_hand(kube, charts, repos["greeter"], RELEASE)
    [foreign] = driver.installed()
    assert foreign.state is ReleaseState.UNMANAGED
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Mine now")])
    assert caught.value.code == "INSTALL_FAILED"
    assert "not managed by margo-gitops" in caught.value.message
    assert not caught.value.retryable
    assert configmap(kube) == {"greeting": "Hello", "replicas": "1", "chartVersion": "1.0.0"}


def test_readiness_that_never_comes_is_a_timeout_until_the_cluster_can_place_the_pod(
        driver: HelmDriver, kube: KubeCluster, repos: dict[str, str]) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["hungry"], wait=True, timeout="0m3s")])
    assert caught.value.code == "TIMEOUT"
    assert "context deadline exceeded" in caught.value.message
    assert f"Deployment/edge/{RELEASE} not ready" in caught.value.message
    assert caught.value.retryable
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    [pod] = kube.pods("edge")
    assert pod["status"]["phase"] == "Pending"  # the scheduler found no node with 64 CPUs
    assert any(c["reason"] == "Unschedulable" for c in pod["status"]["conditions"])
    # A node that can take it joins: the next attempt upgrades the failed release and the
    # wait succeeds, on that node.
    kube.set_nodes([*SINGLE_NODE, SimNode("big-0", cpu="96", memory="64Gi")])
    assert actions(converge(driver, [greeter(repos["hungry"], wait=True, timeout="1m0s")])) \
        == ["upgrade:greeter"]
    assert driver.installed()[0].healthy
    assert {p["spec"]["nodeName"] for p in kube.running_pods("edge")} == {"big-0"}


def test_a_failed_upgrade_leaves_the_previous_revision_serving(
        driver: HelmDriver, kube: KubeCluster, repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "1.0.0", wait=True)])
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["hungry-greeter"], "2.0.0", wait=True,
                                  timeout="0m3s")])
    assert caught.value.code == "TIMEOUT"
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    running = kube.running_pods("edge")
    assert [p["spec"]["containers"][0]["image"] for p in running] == [
        "registry.example.com/greeter:1.0.0"]  # the old ReplicaSet still serves
    history = driver.config("edge").history(RELEASE)
    # Helm 4 leaves the last good revision `deployed` next to the failed one.
    assert [(h["revision"], h["status"]) for h in history] == [(1, "deployed"), (2, "failed")]


def test_rollback_on_failure_restores_the_last_good_revision(
        device_kubeconfig: Path, charts: ChartCache, kube: KubeCluster,
        repos: dict[str, str]) -> None:
    driver = HelmDriver(charts, kubeconfig=device_kubeconfig, rollback_on_failure=True)
    try:
        converge(driver, [greeter(repos["greeter"], "1.0.0", greeting="Good", wait=True)])
        with pytest.raises(ApplyError) as caught:
            converge(driver, [greeter(repos["hungry-greeter"], "2.0.0", wait=True,
                                      timeout="0m3s")])
        assert caught.value.code == "TIMEOUT"
        assert "has been rolled back" in caught.value.message
        history = driver.config("edge").history(RELEASE)
        assert [(h["revision"], h["status"], h["chart_version"]) for h in history] == [
            (1, "superseded", "1.0.0"), (2, "failed", "2.0.0"), (3, "deployed", "1.0.0")]
        assert configmap(kube)["greeting"] == "Good"
        kube.until("only the old pods", lambda: [
            p["spec"]["containers"][0]["image"] for p in kube.pods("edge")
            if not p["metadata"].get("deletionTimestamp")] == [
            "registry.example.com/greeter:1.0.0"])
        # The rolled-back release is healthy but not what is desired: the planner upgrades
        # it again (the runner waits its retry back-off first).
        [installed] = driver.installed()
        assert installed.healthy
        again = plan([greeter(repos["hungry-greeter"], "2.0.0")], [installed]).changes
        assert [s.reason for s in again] == [
            f"package changed (now {repos['hungry-greeter']}:2.0.0)"]
    finally:
        driver.close()


HOLD_OPERATION = """\
import sys
sys.path[:0] = {paths!r}
from pathlib import Path
from kits.chartkit import converge, greeter
from reconciler.charts import ChartCache
from reconciler.drivers.helm import HelmDriver
with ChartCache(Path({cache!r})) as cache:
    converge(HelmDriver(cache, kubeconfig=Path({kubeconfig!r})),
             [greeter({repository!r}, wait=True, timeout="5m0s")])
"""


def kill_during(kube: KubeCluster, tmp_path: Path, kubeconfig: Path, repository: str,
                state: str) -> None:
    """Start a driver in another process on `repository` (which never becomes ready) and
    SIGKILL it once Helm's record of the release reaches `state`."""
    script = HOLD_OPERATION.format(
        paths=[str(REPO_ROOT), str(REPO_ROOT / "tests")],
        cache=str(tmp_path / "killed-cache"), kubeconfig=str(kubeconfig), repository=repository)
    log = tmp_path / "killed.log"
    with open(log, "wb") as output:
        process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        kube.until(f"the release to be {state}", lambda: state in kube.release_secrets(
            "edge").values() or process.poll() is not None, timeout=60)
        assert process.poll() is None, log.read_text()
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def test_a_killed_install_is_uninstalled_and_installed_again(
        driver: HelmDriver, device_kubeconfig: Path, kube: KubeCluster, charts: ChartCache,
        tmp_path: Path, repos: dict[str, str]) -> None:
    kill_during(kube, tmp_path, device_kubeconfig, repos["hungry"], "pending-install")
    [pending] = driver.installed()
    assert (pending.healthy, pending.detail) == (False, "pending-install")
    # Helm itself refuses to touch a release with an operation in progress:
    with pytest.raises(helm.HelmReleaseError, match="another operation"):
        driver.config("edge").upgrade(charts.load(charts.fetch(repos["greeter"], "1.0.0")),
                                      RELEASE)
    the_plan = converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Recovered",
                                         wait=True)])
    assert [s.reason for s in the_plan.changes] == ["the installed release is pending-install"]
    [installed] = driver.installed()
    assert (installed.healthy, installed.chart_version) == (True, "2.0.0")
    assert configmap(kube)["greeting"] == "Recovered"
    assert [h["status"] for h in driver.config("edge").history(RELEASE)] == ["deployed"]


def test_a_killed_upgrade_is_rolled_back_then_upgraded(
        driver: HelmDriver, device_kubeconfig: Path, kube: KubeCluster, tmp_path: Path,
        repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "1.0.0", greeting="First", wait=True)])
    kill_during(kube, tmp_path, device_kubeconfig, repos["hungry"], "pending-upgrade")
    assert driver.installed()[0].detail == "pending-upgrade"
    converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Second", wait=True)])
    history = driver.config("edge").history(RELEASE)
    assert [(h["revision"], h["status"]) for h in history] == [
        (1, "superseded"), (2, "pending-upgrade"), (3, "superseded"), (4, "deployed")]
    assert driver.installed()[0].healthy
    assert configmap(kube)["greeting"] == "Second"


def test_drift_is_reported_by_default_and_repaired_when_asked(
        driver: HelmDriver, device_kubeconfig: Path, charts: ChartCache, kube: KubeCluster,
        repos: dict[str, str]) -> None:
    desired = [greeter(repos["greeter"], "2.0.0", wait=True)]
    converge(driver, desired)
    kube.admin.delete("Deployment", RELEASE, "edge")
    kube.until("the Deployment gone", lambda: kube.admin.find(
        "Deployment", RELEASE, "edge") is None)
    [warned] = driver.installed()
    assert warned.healthy  # warn: noticed and reported, not repaired
    assert warned.drift == f"missing from the cluster: Deployment edge/{RELEASE}"
    assert actions(converge(driver, desired)) == []
    repairing = HelmDriver(charts, kubeconfig=device_kubeconfig, drift="repair")
    try:
        [drifted] = repairing.installed()
        assert (drifted.healthy, drifted.repair, drifted.drift) == (
            True, True, f"missing from the cluster: Deployment edge/{RELEASE}")
        assert actions(converge(repairing, desired)) == ["repair:greeter"]
        history = repairing.config("edge").history(RELEASE)  # an upgrade onto the same chart
        assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"),
                                                                     (2, "deployed")]
        assert repairing.installed()[0].chart_version == "2.0.0"
        assert kube.admin.get("Deployment", RELEASE, "edge")["status"][
            "availableReplicas"] == 1
        assert repairing.installed()[0].drift == ""
    finally:
        repairing.close()
    unchecked = HelmDriver(charts, kubeconfig=device_kubeconfig, drift="off")
    try:
        kube.admin.delete("ConfigMap", f"{RELEASE}-config", "edge")
        assert unchecked.installed()[0].drift == ""
        assert driver.installed()[0].drift == \
            f"missing from the cluster: ConfigMap edge/{RELEASE}-config"
    finally:
        unchecked.close()


@pytest.mark.parametrize(("desired", "expected"), [
    (lambda r: greeter(r, "2.0.0", greeting="x" * 40), "maxLength"),
    (lambda r: greeter(r, "2.0.0", replicas="three"), "got string, want integer"),
    (lambda r: greeter(r, "3.0.0"), "config.token must be set"),
])
def test_values_or_templates_the_chart_rejects_fail_for_good(driver: HelmDriver,
                                                             kube: KubeCluster,
                                                             repos: dict[str, str],
                                                             desired, expected: str) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [desired(repos["greeter"])])
    assert caught.value.code == "INSTALL_FAILED"
    assert expected in caught.value.message
    assert not caught.value.retryable
    assert configmap(kube) is None


def test_an_object_the_api_server_refuses_fails_the_install(driver: HelmDriver,
                                                            kube: KubeCluster,
                                                            repos: dict[str, str]) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["refused"])])
    assert caught.value.code == "INSTALL_FAILED"
    assert "99999" in caught.value.message and "65535" in caught.value.message
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")


def test_rbac_forbids_what_the_device_role_does_not_grant(driver: HelmDriver,
                                                          kube: KubeCluster,
                                                          repos: dict[str, str]) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["clusterwide"])])
    assert caught.value.code == "INSTALL_FAILED"
    assert "forbidden" in caught.value.message
    assert "clusterroles" in caught.value.message
    assert "system:serviceaccount:margo-system:margo-device" in caught.value.message


def test_a_chart_that_cannot_be_pulled_installs_nothing(driver: HelmDriver,
                                                        kube: KubeCluster) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter("oci://127.0.0.1:1/helm/greeter")])
    assert caught.value.code == "PULL_FAILED"
    assert driver.installed() == []


def test_an_unreachable_cluster_is_engine_unavailable(tmp_path: Path, charts: ChartCache,
                                                      repos: dict[str, str]) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Config
        current-context: gone
        clusters: [{name: gone, cluster: {server: "https://127.0.0.1:1"}}]
        users: [{name: gone, user: {token: x}}]
        contexts: [{name: gone, context: {cluster: gone, user: gone}}]
        """))
    desired = greeter(repos["greeter"])
    driver = HelmDriver(charts, kubeconfig=kubeconfig)
    try:
        with pytest.raises(ApplyError) as caught:
            driver.installed()
        assert caught.value.code == "ENGINE_UNAVAILABLE"
        assert "connection refused" in caught.value.message
        with pytest.raises(ApplyError) as caught:
            driver.apply(plan([desired], []).changes[0], desired)
        assert caught.value.code == "ENGINE_UNAVAILABLE"
        assert "127.0.0.1:1" in caught.value.message
        assert caught.value.retryable
    finally:
        driver.close()


def test_components_install_in_order_across_namespaces(driver: HelmDriver, kube: KubeCluster,
                                                       registry: str) -> None:
    examples = publish_example_charts(registry)
    repo, version = examples["hello-world"]
    first = make_deployment({"hello-world": (repo, version)},
                            parameters={"greeting": ("Hi", "config.greeting", ["hello-world"])},
                            namespace="site-a", wait=True)
    second = make_deployment({"model-cache": examples["model-cache"],
                              "inference-server": examples["inference-server"]},
                             namespace="site-b", wait=True,
                             deployment_id="8d1e5f0a-2b3c-4d5e-8f90-a1b2c3d4e5f6")
    kube.set_nodes([SimNode("edge-0", cpu="8", memory="16Gi", gpus=1,
                            gpu_product="Tesla-T4")])
    assert actions(converge(driver, [first, second])) == [
        "install:hello-world", "install:model-cache", "install:inference-server"]
    assert {(r.namespace, r.component) for r in driver.installed()} == {
        ("site-a", "hello-world"), ("site-b", "model-cache"), ("site-b", "inference-server")}
    name = release_name(first.deployment_id, "hello-world")
    assert configmap(kube, f"{name}-config", "site-a") == {"GREETING": "Hi"}
    # With wait, the second component started only after the first was available.
    cache, server = (kube.admin.get("Deployment", release_name(second.deployment_id, c),
                                    "site-b") for c in ("model-cache", "inference-server"))
    available = next(c["lastTransitionTime"] for c in cache["status"]["conditions"]
                     if c["type"] == "Available")
    assert server["metadata"]["creationTimestamp"] >= available
    # A release cannot move between namespaces: removed there, installed here.
    moved = make_deployment({"hello-world": (repo, version)}, namespace="site-c")
    assert actions(converge(driver, [moved, second])) == ["remove:hello-world",
                                                          "install:hello-world"]
    assert kube.admin.find("Deployment", name, "site-a") is None
    assert kube.admin.find("Deployment", name, "site-c") is not None
    assert actions(converge(driver, [second])) == ["remove:hello-world"]
    assert kube.admin.find("Deployment", name, "site-c") is None


class RacedDriver(HelmDriver):
    """A test double for a fault the driver's own call cannot see: right after each install
    or upgrade returns, and before the driver reads it back, another Helm client upgrades
    the same release and is killed in the middle (`kill_during`), so the Helm engine leaves
    the release `pending-upgrade` in its storage."""

    def __init__(self, *args: Any, race: Callable[[], None], **options: Any) -> None:
        super().__init__(*args, **options)
        self.race = race

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        super().apply(step, deployment)
        if step.action is not Action.REMOVE:
            self.race()


def test_a_release_left_pending_by_the_engine_fails_the_read_back(
        device_kubeconfig: Path, charts: ChartCache, kube: KubeCluster, tmp_path: Path,
        repos: dict[str, str]) -> None:
    """Without the read-back, this install would be reported installed (`converge` returns);
    with it, the step fails naming what Helm's storage holds instead of what was applied."""
    driver = RacedDriver(charts, kubeconfig=device_kubeconfig, race=lambda: kill_during(
        kube, tmp_path, device_kubeconfig, repos["hungry"], "pending-upgrade"))
    desired = greeter(repos["greeter"], "1.0.0", wait=True)
    try:
        with pytest.raises(ApplyError) as caught:
            converge(driver, [desired])
    finally:
        driver.close()
    assert caught.value.code == "READBACK_MISMATCH"
    assert caught.value.retryable
    assert caught.value.message.startswith(
        f"release edge/{RELEASE} in Helm's storage is not what was applied: status: expected "
        "deployed, found pending-upgrade; revision: expected 1, found 2; chart: expected "
        "greeter 1.0.0, found hungry 1.0.0; "), caught.value.message
    assert f"label {LABEL_SPEC}: expected " in caught.value.message  # the other package
    # The next pass finds the crashed upgrade and recovers from it.
    helm_driver = HelmDriver(charts, kubeconfig=device_kubeconfig)
    try:
        assert actions(converge(helm_driver, [desired])) == ["recover:greeter"]
        assert helm_driver.installed()[0].chart_version == "1.0.0"
    finally:
        helm_driver.close()


def test_a_sealed_value_reaches_helm_in_memory_only(
        device_kubeconfig: Path, charts: ChartCache, kube: KubeCluster, tmp_path: Path,
        repos: dict[str, str]) -> None:
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    driver = HelmDriver(charts, kubeconfig=device_kubeconfig, key=key)
    secret, other = f"pw-{secrets.token_hex(10)}", f"pw-{secrets.token_hex(10)}"

    def sealed(text: str, recipient: str, mac: str) -> DesiredDeployment:
        return greeter(repos["greeter"], greeting=seal(text, recipient, mac=mac * 32),
                       namespace="sealed")

    try:
        # Installed and read back (the values compared under a per-step key).
        assert actions(converge(driver, [sealed(secret, key.recipient(), "a")])) == [
            "install:greeter"]
        assert configmap(kube, namespace="sealed")["greeting"] == secret
        [release] = driver.installed()
        assert release.values_digest == short_digest(
            sealed(secret, key.recipient(), "a").components[0].values_digest)
        # Sealed again with the same mac: no upgrade; Helm's record is unchanged.
        assert actions(converge(driver, [sealed(secret, key.recipient(), "a")])) == []
        # Sealed to another key: refused before Helm is asked; revision 1 keeps running.
        stranger = str(pyrage.x25519.Identity.generate().to_public())
        with pytest.raises(ApplyError) as raised:
            converge(driver, [sealed(other, stranger, "b")])
        assert raised.value.code == "SECRET_UNREADABLE" and not raised.value.retryable
        assert other not in raised.value.message
        status = driver.config("sealed").status(RELEASE)
        assert (status["revision"], status["status"]) == (1, "deployed")
        assert configmap(kube, namespace="sealed")["greeting"] == secret
        # Helm's own errors lose the plaintext (the chart's schema allows 32 characters).
        too_long = f"{secret}-{'x' * 40}"
        with pytest.raises(ApplyError) as raised:
            converge(driver, [sealed(too_long, key.recipient(), "c")])
        assert raised.value.code == "UPGRADE_FAILED" and too_long not in raised.value.message
    finally:
        driver.close()
    # Nothing on the device's disk holds it (the chart cache, the key's folder).
    stored = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p for p in stored if secret.encode() in p.read_bytes()] == []
