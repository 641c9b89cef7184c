"""HelmDriver: the real Helm v4 engine installing real charts (pulled from the real OCI
registry) into a Kubernetes API emulator (kmock, real HTTP on loopback; see kubeemu.py).

Against the emulator the driver runs in `compat` mode (no OpenAPI, no server-side apply)
with Helm's `memory` storage driver, because the emulator cannot read the protobuf Secrets
Helm stores its records in. Memory records live in one process and in the Helm
configuration that wrote them, so each test drives one `HelmDriver` from start to end:
"restarting the device" cannot be shown here, and a crash mid-operation is shown instead by
an operation left waiting in a background thread (its release stays `pending-*`) while the
same driver converges again. Listing across namespaces with a persistent storage driver
(`list --all-namespaces`) cannot be exercised against the emulator either; only its error
path (cluster unreachable) is.

What the emulator shows about waiting: a ConfigMap is ready as soon as it exists, a
Deployment never is (nothing runs pods), so `wait` succeeds on ConfigMap-only charts and
runs into the component's timeout on charts with a Deployment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest
from chartkit import (
    DEPLOYMENT_ID,
    actions,
    converge,
    greeter,
    make_deployment,
    publish_chart,
    publish_example_charts,
    write_chart,
)
from helm_python import _native
from helm_python.config import _opts
from kubeemu import Emulator, running_emulator, write_kubeconfig

from reconciler.charts import ChartCache
from reconciler.desired import DesiredDeployment
from reconciler.drivers.base import ApplyError
from reconciler.drivers.helm import HelmDriver
from reconciler.planner import plan
from reconciler.releases import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER, release_name

RELEASE = release_name(DEPLOYMENT_ID, "greeter")
CONFIGMAPS = "v1/configmaps"


@pytest.fixture(scope="module")
def repos(registry: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`greeter`: 1.0.0 and 2.0.0 (ConfigMap only), 3.0.0 (broken template);
    `slow`: greeter 1.0.0 with a Deployment (never ready on the emulator)."""
    src = tmp_path_factory.mktemp("charts")
    publish_chart(registry, write_chart(src / "a", version="1.0.0"), repo_path="helm")
    publish_chart(registry, write_chart(src / "a", version="2.0.0"), repo_path="helm")
    greeter_repo = publish_chart(registry, write_chart(src / "a", version="3.0.0", broken=True),
                                 repo_path="helm")
    slow = publish_chart(registry, write_chart(src / "b", deployment=True),
                         repo_path="helm-slow")
    return {"greeter": greeter_repo, "slow": slow}


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Emulator]:
    with running_emulator(tmp_path / "kube") as running:
        yield running


@pytest.fixture
def charts(tmp_path: Path) -> Iterator[ChartCache]:
    with ChartCache(tmp_path / "cache") as cache:
        yield cache


@pytest.fixture
def driver(emulator: Emulator, charts: ChartCache) -> Iterator[HelmDriver]:
    helm_driver = HelmDriver(charts, kubeconfig=emulator.kubeconfig, storage_driver="memory",
                             compat=True)
    yield helm_driver
    helm_driver.close()


def configmap(emulator: Emulator, name: str = f"{RELEASE}-config",
              namespace: str = "edge") -> dict[str, str] | None:
    found = emulator.get(CONFIGMAPS, namespace, name)
    return None if found is None else found["data"]


def install_by_hand(driver: HelmDriver, charts: ChartCache, repository: str, name: str,
                    labels: dict[str, str] | None = None) -> None:
    """A release someone installed with Helm directly (in the driver's own record store,
    the only one the memory storage driver shares), optionally with labels."""
    chart = charts.load(charts.fetch(repository, "1.0.0"))
    config = driver.config("edge")
    _native.call_string("helm_install", config._raw(), helm.Config._context_arg(None),
                        chart._raw(), None, name, "{}",
                        _opts(labels=labels, disable_openapi_validation=True,
                              server_side_apply=False))


def wait_for_state(driver: HelmDriver, detail: str) -> None:
    """Until the driver reports the release in `detail` (an operation in another thread
    reached it); fails after 30 s instead of hanging."""
    deadline = time.monotonic() + 30
    while not any(r.detail == detail for r in driver.installed()):
        assert time.monotonic() < deadline, f"release never reached {detail}"
        time.sleep(0.02)


def in_background(driver: HelmDriver, desired: DesiredDeployment) -> tuple[threading.Thread,
                                                                           list[BaseException]]:
    """Converge `desired` in a thread, collecting what it raises."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            converge(driver, [desired])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_install_creates_the_objects_and_a_labelled_release(driver: HelmDriver,
                                                             emulator: Emulator,
                                                             repos: dict[str, str]) -> None:
    desired = greeter(repos["greeter"], greeting="Hi there", replicas=2)
    assert actions(converge(driver, [desired])) == ["install:greeter"]
    assert configmap(emulator) == {"greeting": "Hi there", "replicas": "2",
                                   "chartVersion": "1.0.0"}
    [installed] = driver.installed()
    assert (installed.release_name, installed.namespace, installed.component) == (
        RELEASE, "edge", "greeter")
    assert (installed.healthy, installed.detail, installed.chart_version) == (
        True, "deployed", "1.0.0")
    status = driver.config("edge").status(RELEASE)
    assert status["labels"][LABEL_DEPLOYMENT] == DEPLOYMENT_ID
    assert driver.config("edge").get_values(RELEASE) == {
        "config": {"greeting": "Hi there"}, "replicaCount": 2}
    assert actions(converge(driver, [desired])) == []  # converged


def test_upgrade_moves_the_release_to_the_new_chart(driver: HelmDriver, emulator: Emulator,
                                                     repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "1.0.0")])
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0")])) == [
        "upgrade:greeter"]
    assert configmap(emulator)["chartVersion"] == "2.0.0"
    [installed] = driver.installed()
    assert (installed.healthy, installed.chart_version) == (True, "2.0.0")
    history = driver.config("edge").history(RELEASE)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"),
                                                                 (2, "deployed")]


def test_reconfigure_sets_exactly_the_desired_values(driver: HelmDriver, emulator: Emulator,
                                                      repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Hello")])
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Servus")])) \
        == ["reconfigure:greeter"]
    assert configmap(emulator)["greeting"] == "Servus"
    # No parameters left: the chart's defaults again, not the previous values reused.
    assert actions(converge(driver, [greeter(repos["greeter"], "2.0.0")])) == [
        "reconfigure:greeter"]
    assert configmap(emulator)["greeting"] == "Hello"
    assert driver.config("edge").get_values(RELEASE) == {}


def test_remove_uninstalls_and_deletes_the_objects(driver: HelmDriver, emulator: Emulator,
                                                   repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "2.0.0")])
    assert configmap(emulator) is not None
    the_plan = converge(driver, [])
    assert actions(the_plan) == ["remove:greeter"]
    assert configmap(emulator) is None
    assert driver.installed() == []
    driver.apply(the_plan.changes[0], None)  # removing again is fine


def test_releases_without_our_labels_are_never_returned_or_touched(
        driver: HelmDriver, emulator: Emulator, charts: ChartCache,
        repos: dict[str, str]) -> None:
    install_by_hand(driver, charts, repos["greeter"], "by-hand")
    install_by_hand(driver, charts, repos["greeter"], "half-labelled",
                    labels={LABEL_MANAGED_BY: MANAGER})  # no deployment/component labels
    converge(driver, [greeter(repos["greeter"], "2.0.0")])
    assert [r.release_name for r in driver.installed()] == [RELEASE]
    converge(driver, [])
    assert driver.installed() == []
    assert {r["name"] for r in driver.config("edge").list(all_states=True)} == {
        "by-hand", "half-labelled"}
    assert configmap(emulator, "by-hand-config") is not None


def test_a_foreign_release_with_our_name_is_left_alone(driver: HelmDriver, emulator: Emulator,
                                                       charts: ChartCache,
                                                       repos: dict[str, str]) -> None:
    install_by_hand(driver, charts, repos["greeter"], RELEASE)
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Mine now")])
    assert caught.value.code == "INSTALL_FAILED"
    assert "not managed by margo-gitops" in caught.value.message
    assert not caught.value.retryable
    assert configmap(emulator) == {"greeting": "Hello", "replicas": "1",
                                   "chartVersion": "1.0.0"}


def test_wait_succeeds_for_objects_the_emulator_reports_ready(driver: HelmDriver,
                                                              emulator: Emulator,
                                                              repos: dict[str, str]) -> None:
    assert actions(converge(driver, [greeter(repos["greeter"], wait=True)])) == [
        "install:greeter"]
    assert driver.installed()[0].healthy


def test_a_wait_that_runs_out_is_a_timeout_and_a_failed_release(driver: HelmDriver,
                                                                 emulator: Emulator,
                                                                 repos: dict[str, str]) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repos["slow"], wait=True, timeout="0m1s")])
    assert caught.value.code == "TIMEOUT"
    assert "context deadline exceeded" in caught.value.message
    assert f"Deployment/edge/{RELEASE} not ready" in caught.value.message
    assert caught.value.retryable
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    # The objects were created; not waiting, the next attempt upgrades the failed release.
    assert emulator.get("apps/v1/deployments", "edge", RELEASE) is not None
    assert actions(converge(driver, [greeter(repos["slow"])])) == ["upgrade:greeter"]
    assert driver.installed()[0].healthy


def test_a_crashed_install_is_uninstalled_and_installed_again(driver: HelmDriver,
                                                              emulator: Emulator,
                                                              charts: ChartCache,
                                                              repos: dict[str, str]) -> None:
    thread, errors = in_background(driver, greeter(repos["slow"], wait=True, timeout="5m0s"))
    try:
        wait_for_state(driver, "pending-install")
        # Helm itself refuses to upgrade a pending release:
        with pytest.raises(helm.HelmReleaseError, match="another operation"):
            driver.config("edge").upgrade(
                charts.load(charts.fetch(repos["greeter"], "1.0.0")), RELEASE)
        desired = greeter(repos["greeter"], "2.0.0", greeting="Recovered")
        the_plan = converge(driver, [desired])
        assert [s.reason for s in the_plan.changes] == [
            "the installed release is pending-install"]
        [installed] = driver.installed()
        assert (installed.healthy, installed.chart_version) == (True, "2.0.0")
        assert configmap(emulator)["greeting"] == "Recovered"
        assert [h["status"] for h in driver.config("edge").history(RELEASE)] == ["deployed"]
    finally:
        driver.cancel()
        thread.join(timeout=60)
    [error] = errors
    assert isinstance(error, ApplyError) and error.code == "CANCELLED"


def test_a_crashed_upgrade_is_rolled_back_then_upgraded(driver: HelmDriver, emulator: Emulator,
                                                        repos: dict[str, str]) -> None:
    converge(driver, [greeter(repos["greeter"], "1.0.0", greeting="First")])
    thread, errors = in_background(driver, greeter(repos["slow"], wait=True, timeout="5m0s"))
    try:
        wait_for_state(driver, "pending-upgrade")
        converge(driver, [greeter(repos["greeter"], "2.0.0", greeting="Second")])
        history = driver.config("edge").history(RELEASE)
        assert [(h["revision"], h["status"]) for h in history] == [
            (1, "superseded"), (2, "pending-upgrade"), (3, "superseded"), (4, "deployed")]
        assert driver.installed()[0].healthy
        assert configmap(emulator)["greeting"] == "Second"
    finally:
        driver.cancel()
        thread.join(timeout=60)
    assert [getattr(e, "code", e) for e in errors] == ["CANCELLED"]


@pytest.mark.parametrize(("desired", "expected"), [
    (lambda r: greeter(r, "2.0.0", greeting="x" * 40), "maxLength"),
    (lambda r: greeter(r, "2.0.0", replicas="three"), "got string, want integer"),
    (lambda r: greeter(r, "3.0.0"), "config.token must be set"),
])
def test_values_or_templates_the_chart_rejects_fail_for_good(driver: HelmDriver,
                                                             emulator: Emulator,
                                                             repos: dict[str, str],
                                                             desired, expected: str) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [desired(repos["greeter"])])
    assert caught.value.code == "INSTALL_FAILED"
    assert expected in caught.value.message
    assert not caught.value.retryable
    assert configmap(emulator) is None


def test_a_chart_that_cannot_be_pulled_installs_nothing(driver: HelmDriver) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter("oci://127.0.0.1:1/helm/greeter")])
    assert caught.value.code == "PULL_FAILED"
    assert driver.installed() == []


def test_an_unreachable_cluster_is_engine_unavailable(tmp_path: Path, charts: ChartCache,
                                                      repos: dict[str, str]) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1")
    desired = greeter(repos["greeter"])
    for storage in ("secret", "memory"):
        driver = HelmDriver(charts, kubeconfig=kubeconfig, storage_driver=storage,
                            compat=True)
        try:
            if storage == "secret":  # lists cluster-wide, which needs the cluster
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


def test_without_compat_the_emulator_rejects_installs(emulator: Emulator, charts: ChartCache,
                                                      repos: dict[str, str]) -> None:
    """Why compat mode exists: the emulator serves no OpenAPI documents."""
    driver = HelmDriver(charts, kubeconfig=emulator.kubeconfig, storage_driver="memory")
    try:
        with pytest.raises(ApplyError) as caught:
            converge(driver, [greeter(repos["greeter"])])
        assert caught.value.code == "INSTALL_FAILED"
        assert "openapi" in caught.value.message
    finally:
        driver.close()


def test_releases_in_several_namespaces_and_components_in_order(
        driver: HelmDriver, emulator: Emulator, registry: str) -> None:
    examples = publish_example_charts(registry)
    repo, version = examples["hello-world"]
    first = make_deployment({"hello-world": (repo, version)},
                            parameters={"greeting": ("Hi", "config.greeting", ["hello-world"])},
                            namespace="site-a")
    second = make_deployment({"model-cache": examples["model-cache"],
                              "inference-server": examples["inference-server"]},
                             namespace="site-b",
                             deployment_id="8d1e5f0a-2b3c-4d5e-8f90-a1b2c3d4e5f6")
    assert actions(converge(driver, [first, second])) == [
        "install:hello-world", "install:model-cache", "install:inference-server"]
    assert {(r.namespace, r.component) for r in driver.installed()} == {
        ("site-a", "hello-world"), ("site-b", "model-cache"), ("site-b", "inference-server")}
    name = release_name(first.deployment_id, "hello-world")
    assert configmap(emulator, f"{name}-config", "site-a") == {"GREETING": "Hi"}
    assert emulator.get("apps/v1/deployments", "site-a", name) is not None
    assert actions(converge(driver, [second])) == ["remove:hello-world"]
    assert set(emulator.objects(CONFIGMAPS)) == {
        ("site-b", release_name(second.deployment_id, c) + "-config")
        for c in ("model-cache", "inference-server")}
