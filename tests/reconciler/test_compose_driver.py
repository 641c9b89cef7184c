"""The Compose driver on a real Docker engine: Debian's dockerd (private to the test
session), Docker's own Compose v2 binary, images built here from busybox and pulled by the
engine from the real registry, packages pulled by our OCI client from the same registry.

What is asserted is what the engine did: containers created with our labels and the
parameters in their environment, replaced on an upgrade, health checks waited for, a
crash's own log lines in the error, containers killed, stopped, paused, removed or
recreated out of band found as drift and repaired (or only reported), foreign projects
untouched, and registry credentials used without a trace.
"""

from __future__ import annotations

import gzip
import io
import os
import secrets
import socket
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyrage
import pytest
from kits.chartkit import converge as converge_all
from kits.composekit import DEPLOYMENT_ID, PROJECT, compose_deployment
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    compose_package,
    environment,
    inspect,
    web_service,
    worker_command,
)
from kits.registrykit import running_registry

from margo.sealing import seal
from reconciler.desired import DesiredDeployment
from reconciler.drivers.compose import ENV_FILE, OVERRIDE_FILE, ComposeDriver, project_files
from reconciler.drivers.compose_drift import APPLIED_FILE
from reconciler.drivers.compose_engine import LABEL_SERVICES, detect_compose_command
from reconciler.encryption_key import DeviceKey
from reconciler.errors import ApplyError
from reconciler.oci import OciClient
from reconciler.planner import Action, Plan, Step, plan
from reconciler.registry_credentials import RegistryCredential
from reconciler.releases import (
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGER,
    ReleaseState,
)


def deployment(repository: str, **options: Any) -> DesiredDeployment:
    return compose_deployment(repository, **options)


@pytest.fixture
def oci() -> Iterator[OciClient]:
    with OciClient(timeout=10.0) as client:
        yield client


@pytest.fixture
def engine(docker_engine: DockerEngine, test_images: ImageSet) -> Iterator[DockerEngine]:
    """The session's engine, emptied of containers, networks and our pulled images after
    the test (so every test's driver pulls its images, as a new device would)."""
    yield docker_engine
    ids = docker_engine.text("ps", "-aq").split()
    if ids:
        docker_engine.run("rm", "-f", *ids)
    docker_engine.run("network", "prune", "-f")
    for ref in (test_images.web_1, test_images.web_2, test_images.crash):
        docker_engine.run("rmi", "-f", ref, check=False)


@pytest.fixture
def repository(registry: str, request: pytest.FixtureRequest) -> str:
    """A package repository of this test's own."""
    return f"oci://{registry}/compose-tests/{request.node.name.lower().replace('_', '-')[:60]}"


def make_driver(engine: DockerEngine, oci: OciClient, work_dir: Path, **options) -> ComposeDriver:
    options.setdefault("grace_seconds", 5.0)
    options.setdefault("command_timeout", 60.0)
    return ComposeDriver(work_dir, oci, docker=engine.docker, compose=engine.compose,
                         docker_host=engine.host, **options)


@pytest.fixture
def driver(engine: DockerEngine, oci: OciClient, tmp_path: Path) -> ComposeDriver:
    return make_driver(engine, oci, tmp_path / "work")


def converge(driver: ComposeDriver, *deployments: DesiredDeployment) -> Plan:
    """One reconcile pass: read the engine, plan, apply every change."""
    return converge_all(driver, list(deployments))


def actions(result: Plan) -> list[str]:
    return [step.action.value for d in result.deployments for step in d.steps]


def containers(engine: DockerEngine, project: str = PROJECT) -> dict[str, str]:
    """Service → container name of a project, as the engine lists it."""
    listed = engine.text("ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
                         "--format", '{{.Label "com.docker.compose.service"}} {{.Names}}')
    return dict(line.split(" ", 1) for line in listed.splitlines())


def test_install_reconfigure_upgrade_and_remove(engine: DockerEngine, test_images: ImageSet,
                                                oci: OciClient, driver: ComposeDriver,
                                                repository: str, tmp_path: Path) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(
        test_images.web_1, labels={"com.example.tier": "front"},
        environment={"GREETING": "${GREETING}", "LEVEL": "${LEVEL:-unset}"})},
        env="LEVEL=info\n")
    work = tmp_path / "work"

    # Install: pulled by the engine, started, healthy (wait), labelled, configured.
    assert actions(converge(driver, deployment(repository))) == ["install"]
    web = containers(engine)["web"]
    state = inspect(engine, web)["State"]
    assert state["Status"] == "running" and state["Health"]["Status"] == "healthy"
    env = environment(engine, web)
    assert (env["GREETING"], env["LEVEL"]) == ("Hello", "info")
    labels = inspect(engine, web)["Config"]["Labels"]
    assert labels["com.example.tier"] == "front"  # the package's own labels stay
    assert (labels[LABEL_MANAGED_BY], labels[LABEL_DEPLOYMENT], labels[LABEL_SERVICES]) == (
        MANAGER, DEPLOYMENT_ID, "web")
    [release] = driver.installed()
    assert (release.release_name, release.component, release.healthy, release.detail) == (
        PROJECT, "hello-world", True, "running (1 container)")
    files = project_files(work, PROJECT, oci.pull(repository, "1.0.0").layer.digest,
                          package_env=True)
    assert oct(files.env_file.stat().st_mode & 0o777) == "0o600"

    # Nothing changed: nothing runs, the container is the same one.
    started = inspect(engine, web)["State"]["StartedAt"]
    assert actions(converge(driver, deployment(repository))) == ["unchanged"]
    assert inspect(engine, web)["State"]["StartedAt"] == started

    # Reconfigure: awkward text arrives intact through the env file and interpolation.
    awkward = "It's $HOME \"quoted\" \\ and ${NOT_EXPANDED}"
    assert actions(converge(driver, deployment(repository, greeting=awkward))) == [
        "reconfigure"]
    assert environment(engine, containers(engine)["web"])["GREETING"] == awkward

    # Upgrade: a new image tag and one more service; the old package directory goes.
    compose_package(oci, repository, "1.1.0", {
        "web": web_service(test_images.web_2),
        "worker": {"image": test_images.web_2, "command": worker_command()}})
    upgraded = deployment(repository, revision="1.1.0", greeting=awkward)
    assert actions(converge(driver, upgraded)) == ["upgrade"]
    running = containers(engine)
    assert sorted(running) == ["web", "worker"]
    assert inspect(engine, running["web"])["Config"]["Image"] == test_images.web_2
    assert engine.text("exec", running["web"], "wget", "-q", "-O-",
                       "http://127.0.0.1:8080/") == "web 2.0\n"
    new_digest = oci.pull(repository, "1.1.0").layer.digest
    assert sorted(p.name for p in (work / PROJECT).iterdir()) == sorted(
        [new_digest.partition(":")[2], ENV_FILE, OVERRIDE_FILE, APPLIED_FILE])

    # Remove: the deployment is no longer desired.
    assert actions(converge(driver)) == ["remove"]
    assert containers(engine) == {}
    assert not (work / PROJECT).exists()
    assert driver.installed() == []


def test_foreign_projects_are_never_reported_or_touched(engine: DockerEngine,
                                                        test_images: ImageSet, oci: OciClient,
                                                        driver: ComposeDriver, repository: str,
                                                        tmp_path: Path) -> None:
    engine.run("pull", test_images.web_1)
    engine.run("run", "-d", "--name", "by-hand-web-1", "--label",
               "com.docker.compose.project=by-hand", test_images.web_1)
    engine.run("run", "-d", "--name", "half-web-1", "--label", "com.docker.compose.project=half",
               "--label", f"{LABEL_MANAGED_BY}={MANAGER}", test_images.web_1)
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    assert {(r.release_name, r.state) for r in driver.installed()} == {
        ("by-hand", ReleaseState.UNMANAGED), ("half", ReleaseState.UNMANAGED)}
    converge(driver, deployment(repository))
    assert [r.release_name for r in driver.installed() if r.managed] == [PROJECT]
    converge(driver)
    names = engine.text("ps", "--format", "{{.Names}}").split()
    assert sorted(names) == ["by-hand-web-1", "half-web-1"]


def test_removing_twice_is_harmless(driver: ComposeDriver) -> None:
    remove = Step(Action.REMOVE, DEPLOYMENT_ID, "hello-world", PROJECT, "", None, None, "gone")
    driver.apply(remove, None)
    driver.apply(remove, None)


def test_a_container_crashing_at_start_fails_with_its_last_log_lines(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1),
                                               "migrate": {"image": test_images.crash}})
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository))
    assert caught.value.code == "INSTALL_FAILED"
    message = caught.value.message
    assert f"{PROJECT}-migrate-1 exited with code 3; its last log lines:" in message
    assert "loading configuration\nfatal: DATABASE_URL is not set" in message
    # Read back from the engine: the project is there, and not healthy, so the next pass
    # upgrades it instead of believing it installed.
    [release] = driver.installed()
    assert release.healthy is False
    assert release.detail == f"{PROJECT}-migrate-1 exited with code 3"
    assert actions(plan([deployment(repository)], driver.installed())) == ["upgrade"]


def test_without_wait_an_exit_at_start_fails_the_read_back(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str) -> None:
    """Without `wait`, `up` succeeds once the containers are started, and the job exits
    with code 3 right after. `front` waits for `web`'s health check, so `up` returns only
    after the job has exited: the read-back sees it. Without the read-back, this step would
    be reported installed (`converge` returns)."""
    compose_package(oci, repository, "1.0.0", {
        "job": {"image": test_images.crash},
        "web": web_service(test_images.web_1),
        "front": {"image": test_images.web_1, "command": worker_command(),
                  "depends_on": {"web": {"condition": "service_healthy"}}}})
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository, wait=False))
    assert caught.value.code == "READBACK_MISMATCH"
    assert caught.value.retryable
    assert caught.value.message == (
        f"Compose project {PROJECT} on the engine is not what was applied: {PROJECT}-job-1: "
        "expected running, or finished with code 0, found exited with code 3")
    assert engine.text("wait", containers(engine)["job"]).strip() == "3"
    # The next pass reads the same from the engine: a failure, applied again.
    [release] = driver.installed()
    assert release.healthy is False
    assert actions(plan([deployment(repository, wait=False)], driver.installed())) == [
        "upgrade"]


OUT_OF_BAND = {  # what a person does to a container, and the drift it is found as
    "kill": (("kill",), "worker", "{name} was stopped (exited with code 137)"),
    "stop": (("stop", "-t", "5"), "web", "{name} was stopped (exited with code 0)"),
    "pause": (("pause",), "web", "{name} was paused"),
    "rm": (("rm", "-f"), "worker", "service worker has no container"),
}


def two_services(oci: OciClient, repository: str, test_images: ImageSet) -> DesiredDeployment:
    """A web service (health-checked: it keeps running) and a quiet worker, installed."""
    compose_package(oci, repository, "1.0.0", {
        "web": web_service(test_images.web_1),
        "worker": {"image": test_images.web_1, "command": worker_command()}})
    return deployment(repository)


@pytest.mark.parametrize("how", sorted(OUT_OF_BAND))
def test_containers_stopped_paused_or_removed_out_of_band_are_drift_and_repaired(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str, how: str) -> None:
    desired = two_services(oci, repository, test_images)
    converge(driver, desired)
    command, service, sentence = OUT_OF_BAND[how]
    victim = containers(engine)[service]
    engine.run(*command, victim)
    expected = sentence.format(name=victim)
    [release] = driver.installed()
    assert (release.healthy, release.repair, release.drift) == (True, True, expected)
    the_plan = converge(driver, desired)
    assert [(s.action, s.reason) for s in the_plan.changes] == [
        (Action.REPAIR, f"drifted: {expected}")]
    running = containers(engine)
    assert sorted(running) == ["web", "worker"]
    assert {inspect(engine, name)["State"]["Status"] for name in running.values()} == {
        "running"}
    assert driver.installed()[0].drift == ""


def test_a_project_whose_containers_are_all_gone_is_repaired_not_reinstalled(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    converge(driver, deployment(repository))
    engine.run("rm", "-f", containers(engine)["web"])
    [release] = driver.installed()
    assert (release.component, release.repair, release.drift) == (
        "hello-world", True, "every container of the project is gone")
    assert actions(converge(driver, deployment(repository))) == ["repair"]
    assert inspect(engine, containers(engine)["web"])["State"]["Health"]["Status"] == "healthy"


def recreate_by_hand(engine: DockerEngine, oci: OciClient, repository: str,
                     tmp_path: Path) -> str:
    """What a person does with `docker compose up` and an edited environment: the project's
    `web` container recreated from the driver's files with GREETING=Hacked. Its name."""
    files = project_files(tmp_path / "work", PROJECT, oci.pull(repository, "1.0.0").layer.digest)
    edited = tmp_path / "by-hand.env"
    edited.write_text("GREETING=Hacked\n")
    engine.compose_run(PROJECT, "--env-file", str(edited), "up", "-d",
                       files=[files.compose_file, files.override_file])
    return containers(engine)["web"]


def test_a_container_recreated_from_another_configuration_is_drift_and_repaired(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str, tmp_path: Path) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    converge(driver, deployment(repository, greeting="Hello"))
    web = recreate_by_hand(engine, oci, repository, tmp_path)
    assert environment(engine, web)["GREETING"] == "Hacked"
    [release] = driver.installed()
    assert release.drift == f"{web} was recreated from another configuration"
    assert actions(converge(driver, deployment(repository, greeting="Hello"))) == ["repair"]
    assert environment(engine, containers(engine)["web"])["GREETING"] == "Hello"
    assert driver.installed()[0].drift == ""


def test_a_container_recreated_before_the_read_back_fails_it(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str, tmp_path: Path) -> None:
    """A test double for a race: between `up` and the read-back, someone recreates the
    container by hand from another environment. The read-back compares each container's
    config-hash with Compose's own hash of the files the driver wrote, and names both."""
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    desired = deployment(repository, greeting="Hello")
    [step] = plan([desired], driver.installed()).changes
    driver.apply(step, desired)
    written = inspect(engine, containers(engine)["web"])["Config"]["Labels"][
        "com.docker.compose.config-hash"]
    web = recreate_by_hand(engine, oci, repository, tmp_path)
    recreated = inspect(engine, web)["Config"]["Labels"]["com.docker.compose.config-hash"]
    with pytest.raises(ApplyError) as caught:
        driver.confirm(step, desired)
    assert caught.value.code == "READBACK_MISMATCH"
    assert caught.value.message.startswith(
        f"Compose project {PROJECT} on the engine is not what was applied: ")
    assert f"{web} config-hash: expected {written}, found {recreated}" in caught.value.message


def test_with_warn_drift_is_reported_and_nothing_is_touched(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, repository: str,
        tmp_path: Path) -> None:
    driver = make_driver(engine, oci, tmp_path / "work", drift="warn")
    desired = two_services(oci, repository, test_images)
    converge(driver, desired)
    victim = containers(engine)["worker"]
    engine.run("kill", victim)
    [release] = driver.installed()
    assert (release.healthy, release.repair, release.drift) == (
        True, False, f"{victim} was stopped (exited with code 137)")
    assert actions(converge(driver, desired)) == ["unchanged"]
    assert inspect(engine, victim)["State"]["Status"] == "exited"


@pytest.mark.parametrize("record", ["off", "unreadable"])
def test_unchecked_a_stopped_container_is_a_failure_applied_again(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, repository: str,
        tmp_path: Path, record: str, caplog: pytest.LogCaptureFixture) -> None:
    """With `off`, or without a readable record of what was applied, a project is judged
    by its containers' health, as before drift checks existed."""
    driver = make_driver(engine, oci, tmp_path / "work", drift="off" if record == "off"
                         else "repair")
    desired = two_services(oci, repository, test_images)
    converge(driver, desired)
    damaged = tmp_path / "work" / PROJECT / APPLIED_FILE
    if record == "unreadable":
        damaged.write_text("{not json")
    victim = containers(engine)["worker"]
    engine.run("kill", victim)
    with caplog.at_level("WARNING", logger="margo.device"):
        [release] = driver.installed()
    assert (release.healthy, release.detail, release.drift) == (
        False, f"{victim} exited with code 137", "")
    if record == "unreadable":
        assert str(damaged) in caplog.text
    assert actions(converge(driver, desired)) == ["upgrade"]
    assert inspect(engine, containers(engine)["worker"])["State"]["Status"] == "running"


def test_a_project_the_engine_refuses_reports_composes_message(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, driver: ComposeDriver,
        repository: str) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(
        test_images.web_1, network_mode="container:no-such-container")})
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository))
    assert (caught.value.code, caught.value.retryable) == ("INSTALL_FAILED", True)
    assert "no-such-container" in caught.value.message


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A TCP server that accepts connections and never answers: a registry that hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for connection in held:
        connection.close()
    server.close()


def test_a_pull_that_hangs_is_stopped_at_the_timeout(engine: DockerEngine, oci: OciClient,
                                                     tmp_path: Path, repository: str,
                                                     silent_registry: str) -> None:
    """The engine pulls from a registry that never answers; our deadline stops Compose."""
    compose_package(oci, repository, "1.0.0", {"web": {"image": f"{silent_registry}/x:1"}})
    driver = make_driver(engine, oci, tmp_path / "work", command_timeout=3.0)
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository))
    assert caught.value.code == "TIMEOUT"
    assert "did not finish within 3 s" in caught.value.message


def test_an_unreachable_engine_is_engine_unavailable(engine: DockerEngine, oci: OciClient,
                                                     repository: str, test_images: ImageSet,
                                                     tmp_path: Path) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    gone = ComposeDriver(tmp_path / "w", oci, docker=engine.docker, compose=engine.compose,
                         docker_host=f"unix://{tmp_path}/no-daemon.sock")
    with pytest.raises(ApplyError) as caught:
        gone.installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert "no-daemon.sock" in caught.value.message
    with pytest.raises(ApplyError) as caught:
        converge(gone, deployment(repository))
    assert caught.value.code == "ENGINE_UNAVAILABLE"


def test_compose_as_a_plugin_or_a_binary_and_neither(engine: DockerEngine, oci: OciClient,
                                                     tmp_path: Path) -> None:
    config = tmp_path / "docker-config"
    (config / "cli-plugins").mkdir(parents=True)
    (config / "cli-plugins" / "docker-compose").symlink_to(engine.compose)
    plugin_env = {**engine.env(), "DOCKER_CONFIG": str(config)}
    assert detect_compose_command(engine.docker, "plugin", env=plugin_env) == [
        engine.docker, "compose"]
    assert detect_compose_command(engine.docker, engine.compose, env=engine.env()) == [
        engine.compose]
    empty = {**engine.env(), "DOCKER_CONFIG": str(tmp_path / "empty")}
    with pytest.raises(ApplyError) as caught:
        detect_compose_command(engine.docker, "plugin", env=empty)
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    with pytest.raises(ApplyError) as caught:
        ComposeDriver(tmp_path / "w", oci, docker=str(tmp_path / "no-such-docker")).installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"


def unsafe_archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        compose = b"services: {web: {image: x}}\n"
        info = tarfile.TarInfo("hello/compose.yaml")
        info.size = len(compose)
        tar.addfile(info, io.BytesIO(compose))
        link = tarfile.TarInfo("hello/keys")
        link.type, link.linkname = tarfile.SYMTYPE, "/root/.ssh"
        tar.addfile(link)
    return gzip.compress(raw.getvalue())


def test_an_unsafe_package_is_refused_before_anything_is_written(
        engine: DockerEngine, oci: OciClient, driver: ComposeDriver, repository: str,
        tmp_path: Path) -> None:
    oci.push_artifact(repository, "1.0.0", unsafe_archive())
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository))
    assert (caught.value.code, caught.value.retryable) == ("UNSAFE_PACKAGE", False)
    assert "'hello/keys'" in caught.value.message
    assert containers(engine) == {} and not (tmp_path / "work").exists()


def test_a_missing_package_is_a_retryable_pull_failure(driver: ComposeDriver,
                                                       repository: str) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(repository, revision="7.7.7"))
    assert (caught.value.code, caught.value.retryable) == ("PULL_FAILED", True)


def test_leftovers_of_interrupted_steps_are_cleaned_up(engine: DockerEngine,
                                                       test_images: ImageSet, oci: OciClient,
                                                       driver: ComposeDriver, repository: str,
                                                       tmp_path: Path) -> None:
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    digest_hex = oci.pull(repository, "1.0.0").layer.digest[7:]
    project_dir = tmp_path / "work" / PROJECT
    stale = [project_dir / ("c" * 64), project_dir / f".{digest_hex}.partial-0a1b2c"]
    for directory in stale:
        directory.mkdir(parents=True)
        (directory / "compose.yaml").write_text("old")
    (project_dir / digest_hex).mkdir()  # an incomplete package dir (no compose.yaml)
    (project_dir / "notes.txt").write_text("someone's notes stay")
    converge(driver, deployment(repository))
    assert sorted(p.name for p in project_dir.iterdir()) == sorted(
        [digest_hex, ENV_FILE, OVERRIDE_FILE, APPLIED_FILE, "notes.txt"])
    assert (project_dir / digest_hex / "compose.yaml").is_file()


# --------------------------------------------------------------------------- credentials


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry that refuses anonymous pulls (htpasswd: deployer / s3cret-pw)."""
    with running_registry(tmp_path_factory.mktemp("private"),
                          users={"deployer": "s3cret-pw"}) as host:
        yield host


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_images_and_packages_from_a_registry_that_needs_credentials(
        engine: DockerEngine, test_images: ImageSet, private_registry: str,
        tmp_path: Path) -> None:
    private_image = f"{private_registry}/margo-test/web:1.0"
    with OciClient(credentials={private_registry: ("deployer", "s3cret-pw")}) as admin:
        engine.run("pull", test_images.web_1)
        engine.run("tag", test_images.web_1, private_image)
        login = engine.run("login", "-u", "deployer", "--password-stdin", private_registry,
                           input=b"s3cret-pw", check=False)
        assert login.returncode == 0, login.stderr
        engine.run("push", private_image)
        engine.run("logout", private_registry)
        engine.run("rmi", private_image, test_images.web_1)
        repository = compose_package(admin, f"oci://{private_registry}/compose/private",
                                     "1.0.0", {"web": web_service(private_image)})
    good = RegistryCredential(private_registry, "deployer",
                              secret_file(tmp_path / "password", "s3cret-pw"))
    wrong = RegistryCredential(private_registry, "deployer",
                               secret_file(tmp_path / "wrong", "not-the-password"))
    # Wrong package credentials (the OCI client's pull), then right package credentials
    # with wrong image credentials (the engine's pull): PULL_FAILED naming the registry,
    # never the secret.
    for package, images in ((wrong, wrong), (good, wrong)):
        with OciClient(credentials={private_registry: package.pair()}) as oci, \
                pytest.raises(ApplyError) as caught:
            converge(make_driver(engine, oci, tmp_path / "work", credentials=[images]),
                     deployment(repository))
        assert caught.value.code == "PULL_FAILED"
        assert private_registry in caught.value.message
        assert "not-the-password" not in caught.value.message
    # Both right: installed, and no credentials file is left behind.
    with OciClient(credentials={private_registry: good.pair()}) as oci:
        driver = make_driver(engine, oci, tmp_path / "work", credentials=[good])
        assert actions(converge(driver, deployment(repository))) == ["install"]
    assert inspect(engine, containers(engine)["web"])["State"]["Health"]["Status"] == "healthy"
    leftovers = [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(
        "margo-docker-config-*")]
    assert leftovers == []
    assert "s3cret-pw" not in repr(good)


def test_a_sealed_value_reaches_the_containers_through_the_environment_only(
        engine: DockerEngine, test_images: ImageSet, oci: OciClient, repository: str,
        tmp_path: Path) -> None:
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    driver = make_driver(engine, oci, tmp_path / "work", key=key)
    # The package's own .env has a default: the opened value, from the environment, wins.
    compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)},
                    env="GREETING=packaged\n")
    secret, other = f"pw-{secrets.token_hex(10)}", f"pw-{secrets.token_hex(10)}"
    sealed = deployment(repository, greeting=seal(secret, key.recipient(), mac="c" * 32))
    assert actions(converge(driver, sealed)) == ["install"]  # read back (config --hash) too
    web = containers(engine)["web"]
    assert environment(engine, web)["GREETING"] == secret
    env_file = project_files(tmp_path / "work", PROJECT, "sha256:" + "0" * 64).env_file
    assert "GREETING" not in env_file.read_text()  # not in any file of the project
    written = [p for p in (tmp_path / "work").rglob("*") if p.is_file()]
    assert written and [p for p in written if secret.encode() in p.read_bytes()] == []

    # Sealed again by the server (a new ciphertext, the same mac): nothing to do, no drift.
    again = deployment(repository, greeting=seal(secret, key.recipient(), mac="c" * 32))
    assert actions(converge(driver, again)) == ["unchanged"]
    assert [r.drift for r in driver.installed()] == [""]

    # Sealed to another key: SECRET_UNREADABLE before anything runs; the project as it was.
    stranger = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(ApplyError) as raised:
        converge(driver, deployment(repository, greeting=seal(other, stranger, mac="d" * 32)))
    assert (raised.value.code, raised.value.retryable) == ("SECRET_UNREADABLE", False)
    assert "GREETING" in raised.value.message and other not in raised.value.message
    assert inspect(engine, containers(engine)["web"])["Id"] == inspect(engine, web)["Id"]
    assert environment(engine, web)["GREETING"] == secret
