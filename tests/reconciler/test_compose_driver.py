"""The Compose driver: pure command and file builders, then whole plan/apply cycles with
packages from a real OCI registry and the fake `docker` engine in ./fakedocker (the one test
double at the engine boundary: this machine has no Docker engine)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import stat
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from margo.archive import deterministic_targz
from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.base import ApplyError
from reconciler.drivers.compose import (
    ENV_FILE,
    OVERRIDE_FILE,
    PS_FORMAT,
    ComposeDriver,
    Container,
    ProjectFiles,
    compose_commands,
    container_healthy,
    detect_compose_command,
    env_file_text,
    override_document,
    parse_ps_output,
    project_files,
    releases_from_ps,
)
from reconciler.oci import OciClient
from reconciler.planner import Action, Plan, Step, plan
from reconciler.releases import (
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    MANAGER,
    ownership_labels,
    release_name,
    short_digest,
)

FAKE_DOCKER = Path(__file__).resolve().parent / "fakedocker" / "docker"
DEPLOYMENT_ID = "5f3c7a52-1f0e-4c1e-9a37-6f4f3f0c2b11"
PROJECT = release_name(DEPLOYMENT_ID, "hello-world")

DEPLOYMENT = """\
id: {id}
metadata: {{name: hello, namespace: hello, deviceId: compose-box}}
spec:
  applicationId: com-example-hello
  deploymentProfile:
    type: compose
    components:
      - name: hello-world
        properties: {{repository: "oci://{registry}/compose/hello", revision: {revision},
                     wait: {wait}, timeout: {timeout}}}
  parameters:
    greeting:
      value: {greeting}
      targets: [{{pointer: GREETING, components: [hello-world]}}]
"""

COMPOSE = """\
services:
  web:
    image: nginx:1.27
    labels: {{com.example.tier: front}}
    environment:
      GREETING: ${{GREETING}}
      LEVEL: ${{LEVEL:-unset}}
{extra}"""


def deployment(registry: str, *, revision: str = "1.0.0", greeting: str = "Hello",
               wait: bool = True, timeout: str = "0m30s") -> DesiredDeployment:
    return parse_deployment(DEPLOYMENT.format(
        id=DEPLOYMENT_ID, registry=registry, revision=revision, wait=str(wait).lower(),
        timeout=timeout, greeting=json.dumps(greeting)).encode())


def compose_archive(extra: str = "", *, env: bytes | None = b"LEVEL=info\n") -> bytes:
    files = {"hello/compose.yaml": COMPOSE.format(extra=extra).encode()}
    if env is not None:
        files["hello/.env"] = env
    return deterministic_targz(files)


# --------------------------------------------------------------------------- the fake engine


@dataclass
class FakeEngine:
    docker: str
    env: dict[str, str]
    state: Path
    log: Path

    def containers(self) -> list[dict]:
        return json.loads(self.state.read_text())["containers"] if self.state.exists() else []

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def compose_calls(self, command: str) -> list[list[str]]:
        return [c for c in self.calls() if c[:1] == ["compose"] and command in c]

    def seed(self, *containers: dict) -> None:
        self.state.write_text(json.dumps({"containers": list(containers)}))


@pytest.fixture
def engine(tmp_path: Path) -> FakeEngine:
    """The fake docker, installed with this interpreter (which has PyYAML) as its shebang."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    source = FAKE_DOCKER.read_text().split("\n", 1)[1]
    docker.write_text(f"#!{sys.executable}\n{source}")
    docker.chmod(0o755)
    env = {"FAKEDOCKER_STATE": str(tmp_path / "engine.json"),
           "FAKEDOCKER_LOG": str(tmp_path / "docker-calls.jsonl")}
    return FakeEngine(str(docker), env, tmp_path / "engine.json", tmp_path / "docker-calls.jsonl")


@pytest.fixture
def oci() -> Iterator[OciClient]:
    with OciClient(timeout=10.0) as client:
        yield client


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    return tmp_path / "work"


def make_driver(engine: FakeEngine, oci: OciClient, work_dir: Path, *,
                grace_seconds: float = 5.0, **env: str) -> ComposeDriver:
    return ComposeDriver(work_dir, oci, docker=engine.docker, env={**engine.env, **env},
                         grace_seconds=grace_seconds, command_timeout=20.0)


def converge(driver: ComposeDriver, *deployments: DesiredDeployment) -> Plan:
    """One reconcile pass: read the engine, plan, apply every change."""
    result = plan(deployments, driver.installed())
    for deployment_plan in result.deployments:
        for step in deployment_plan.changes:
            driver.apply(step, deployment_plan.deployment)
    return result


def actions(result: Plan) -> list[str]:
    return [step.action.value for d in result.deployments for step in d.steps]


def web(engine: FakeEngine) -> dict:
    return next(c for c in engine.containers() if c["service"] == "web")


# --------------------------------------------------------------------------- pure builders


def install_step(deployment: DesiredDeployment, action: Action = Action.INSTALL) -> Step:
    component = deployment.components[0]
    return Step(action, deployment.deployment_id, component.name, PROJECT, "hello", component,
                None, "test")


def test_up_command_line_for_a_waiting_component() -> None:
    desired = deployment("127.0.0.1:5000", timeout="2m30s")
    files = project_files(Path("/w"), PROJECT, "sha256:" + "a" * 64, package_env=True)
    assert compose_commands(install_step(desired), compose=["docker", "compose"],
                            files=files) == [[
        "docker", "compose", "-p", PROJECT,
        "-f", f"/w/{PROJECT}/{'a' * 64}/compose.yaml", "-f", f"/w/{PROJECT}/{OVERRIDE_FILE}",
        "--env-file", f"/w/{PROJECT}/{'a' * 64}/.env", "--env-file", f"/w/{PROJECT}/{ENV_FILE}",
        "up", "-d", "--remove-orphans", "--wait", "--wait-timeout", "150"]]


def test_up_command_line_without_wait_and_without_package_env() -> None:
    desired = deployment("127.0.0.1:5000", wait=False)
    files = project_files(Path("/w"), PROJECT, "sha256:" + "b" * 64)
    [argv] = compose_commands(install_step(desired, Action.RECONFIGURE),
                              compose=["docker-compose"], files=files)
    assert argv[:3] == ["docker-compose", "-p", PROJECT]
    assert argv.count("--env-file") == 1
    assert argv[-3:] == ["up", "-d", "--remove-orphans"]


def test_remove_and_unchanged_command_lines() -> None:
    desired = deployment("127.0.0.1:5000")
    remove = Step(Action.REMOVE, DEPLOYMENT_ID, "hello-world", PROJECT, "", None, None, "gone")
    assert compose_commands(remove, compose=["docker", "compose"]) == [
        ["docker", "compose", "-p", PROJECT, "down", "--remove-orphans"]]
    assert compose_commands(install_step(desired, Action.UNCHANGED), compose=["x"]) == []
    with pytest.raises(ValueError, match="needs the desired component"):
        compose_commands(install_step(desired), compose=["x"])


def test_env_file_quotes_values_so_compose_reads_them_literally() -> None:
    text = env_file_text({"PLAIN": "Hello world", "DOLLAR": "${HOME} $$", "QUOTE": "it's",
                          "BACKSLASH_END": "C:\\", "NEWLINE": "a\nb", "FLAG": True, "N": 4,
                          "EMPTY": ""})
    assert text.splitlines()[1:] == [
        "BACKSLASH_END=\"C:\\\\\"",
        "DOLLAR='${HOME} $$'",
        "EMPTY=''",
        "FLAG='true'",
        "N='4'",
        "NEWLINE='a",
        "b'",
        "PLAIN='Hello world'",
        "QUOTE=\"it's\""]


@pytest.mark.parametrize("values", [{"BAD-NAME": "x"}, {"1ST": "x"}, {"NUL": "a\x00b"},
                                    {"OBJ": object()}])
def test_env_file_refuses_what_no_environment_can_hold(values: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        env_file_text(values)


def test_override_labels_every_service() -> None:
    labels = {LABEL_MANAGED_BY: MANAGER, LABEL_COMPONENT: "c"}
    assert override_document(["web", "db"], labels) == {"services": {
        "web": {"labels": labels}, "db": {"labels": labels}}}


def test_the_ps_format_reads_each_label_exactly() -> None:
    assert '"margo-gitops.dev/deployment":{{json (.Label "margo-gitops.dev/deployment")}}' \
        in PS_FORMAT
    assert PS_FORMAT.startswith('{"id":{{json .ID}}') and PS_FORMAT.endswith("}}")


def ps_line(name: str, state: str, status: str, **labels: str) -> str:
    return json.dumps({"id": name, "names": name, "state": state, "status": status,
                       "labels": labels})


OURS = {"com.docker.compose.project": "p1", **ownership_labels(
    "d1", "c1", desired_digest="sha256:" + "1" * 64, spec_digest="sha256:" + "2" * 64,
    values_digest="sha256:" + "3" * 64)}


@pytest.mark.parametrize(("state", "status", "healthy"), [
    ("running", "Up 5 minutes", True),
    ("running", "Up 5 minutes (health: starting)", True),
    ("running", "Up 5 minutes (healthy)", True),
    ("running", "Up 5 minutes (unhealthy)", False),
    ("exited", "Exited (0) 3 minutes ago", True),
    ("exited", "Exited (137) 3 minutes ago", False),
    ("restarting", "Restarting (1) 2 seconds ago", False),
    ("created", "Created", False),
    ("paused", "Up 5 minutes (Paused)", False),
    ("dead", "Dead", False),
])
def test_container_health_rule(state: str, status: str, healthy: bool) -> None:
    [container] = parse_ps_output(ps_line("x", state, status, **OURS))
    assert container_healthy(container) is healthy


def test_projects_are_read_from_container_labels() -> None:
    text = "\n".join([
        ps_line("p1-web-1", "running", "Up", **OURS, **{"com.docker.compose.service": "web"}),
        ps_line("p1-job-1", "exited", "Exited (2) 1 second ago", **OURS),
        ps_line("mine-1", "running", "Up", **{"com.docker.compose.project": "by-hand"}),
        ps_line("half-1", "running", "Up", **{"com.docker.compose.project": "half",
                                              LABEL_MANAGED_BY: MANAGER}),
        ps_line("loose-1", "running", "Up", **{LABEL_MANAGED_BY: MANAGER}),
        ""])
    [release] = releases_from_ps(parse_ps_output(text))
    assert (release.release_name, release.deployment_id, release.component) == ("p1", "d1", "c1")
    assert (release.spec_digest, release.values_digest) == ("2" * 40, "3" * 40)
    assert release.healthy is False and release.detail == "p1-job-1 exited with code 2"


def test_containers_disagreeing_about_ownership_make_the_project_unhealthy() -> None:
    newer = {**OURS, "margo-gitops.dev/values-digest": "4" * 40}
    [release] = releases_from_ps(parse_ps_output("\n".join([
        ps_line("p1-a-1", "running", "Up", **OURS), ps_line("p1-b-1", "running", "Up", **newer)])))
    assert release.healthy is False and "different ownership labels" in release.detail


def test_unreadable_ps_output_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_ps_output('{"id": "x"}\n')
    with pytest.raises(ValueError):
        parse_ps_output("not json\n")


# --------------------------------------------------------------------------- full cycles


def test_install_reconfigure_upgrade_and_remove(registry: str, oci: OciClient,
                                                engine: FakeEngine, work_dir: Path) -> None:
    repository = f"oci://{registry}/compose/hello"
    oci.push_artifact(repository, "1.0.0", compose_archive())
    driver = make_driver(engine, oci, work_dir)

    # Install: the package's .env gives a default, our margo.env the parameter.
    assert actions(converge(driver, deployment(registry))) == ["install"]
    container = web(engine)
    assert container["project"] == PROJECT
    assert container["environment"] == {"GREETING": "Hello", "LEVEL": "info"}
    assert container["labels"]["com.example.tier"] == "front"  # the package's labels stay
    desired = deployment(registry)
    component = desired.components[0]
    [release] = driver.installed()
    assert (release.release_name, release.deployment_id, release.component, release.healthy) == (
        PROJECT, DEPLOYMENT_ID, "hello-world", True)
    assert (release.desired_digest, release.spec_digest, release.values_digest) == (
        short_digest(desired.digest), short_digest(component.spec_digest),
        short_digest(component.values_digest))
    files = project_files(work_dir, PROJECT, oci.pull(repository, "1.0.0").layer.digest,
                          package_env=True)
    [up] = engine.compose_calls("up")
    assert [engine.docker, *up] == compose_commands(
        install_step(desired), compose=[engine.docker, "compose"], files=files)[0]
    assert stat.S_IMODE(files.env_file.stat().st_mode) == 0o600

    # Nothing changed: nothing runs.
    assert actions(converge(driver, deployment(registry))) == ["unchanged"]
    assert len(engine.compose_calls("up")) == 1

    # Reconfigure: awkward text arrives intact through the env file and interpolation.
    awkward = "It's $HOME \"quoted\" \\ and ${NOT_EXPANDED}"
    assert actions(converge(driver, deployment(registry, greeting=awkward))) == ["reconfigure"]
    assert web(engine)["environment"]["GREETING"] == awkward

    # Upgrade to a revision with one more service; the old package directory goes.
    oci.push_artifact(repository, "1.1.0", compose_archive(
        "  worker:\n    image: busybox:1.36\n", env=None))
    upgraded = deployment(registry, revision="1.1.0", greeting=awkward)
    assert actions(converge(driver, upgraded)) == ["upgrade"]
    assert sorted(c["service"] for c in engine.containers()) == ["web", "worker"]
    assert web(engine)["environment"]["LEVEL"] == "unset"  # the new package has no .env
    new_digest = oci.pull(repository, "1.1.0").layer.digest
    assert sorted(p.name for p in (work_dir / PROJECT).iterdir()) == sorted(
        [new_digest.partition(":")[2], ENV_FILE, OVERRIDE_FILE])
    assert all(c["labels"][LABEL_DEPLOYMENT] == DEPLOYMENT_ID for c in engine.containers())

    # Remove: the deployment is no longer desired.
    assert actions(converge(driver)) == ["remove"]
    assert engine.containers() == []
    assert not (work_dir / PROJECT).exists()
    assert driver.installed() == []


def test_foreign_containers_are_never_reported_or_touched(registry: str, oci: OciClient,
                                                          engine: FakeEngine,
                                                          work_dir: Path) -> None:
    foreign = {"id": "f1", "name": "by-hand-web-1", "project": "by-hand", "service": "web",
               "image": "redis", "state": "running", "status": "Up 1 hour",
               "labels": {"com.docker.compose.project": "by-hand"}}
    half = {**foreign, "id": "f2", "name": "half-web-1", "project": "half",
            "labels": {"com.docker.compose.project": "half", LABEL_MANAGED_BY: MANAGER}}
    engine.seed(foreign, half)
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", compose_archive())
    driver = make_driver(engine, oci, work_dir)
    assert driver.installed() == []
    converge(driver, deployment(registry))
    assert [r.release_name for r in driver.installed()] == [PROJECT]
    converge(driver)
    assert [c["name"] for c in engine.containers()] == ["by-hand-web-1", "half-web-1"]


def test_removing_twice_is_harmless(oci: OciClient, engine: FakeEngine,
                                    work_dir: Path) -> None:
    driver = make_driver(engine, oci, work_dir)
    remove = Step(Action.REMOVE, DEPLOYMENT_ID, "hello-world", PROJECT, "", None, None, "gone")
    driver.apply(remove, None)
    driver.apply(remove, None)
    assert len(engine.compose_calls("down")) == 2


def test_a_failing_compose_up_reports_its_stderr(registry: str, oci: OciClient,
                                                 engine: FakeEngine, work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", compose_archive())
    driver = make_driver(engine, oci, work_dir, FAKEDOCKER_FAIL="up")
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(registry))
    assert (caught.value.code, caught.value.retryable) == ("INSTALL_FAILED", True)
    assert "simulated up failure" in caught.value.message


def test_a_crashing_container_fails_a_waiting_install(registry: str, oci: OciClient,
                                                      engine: FakeEngine,
                                                      work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0",
                      compose_archive("  job:\n    image: busybox\n    x-fake-exit: 3\n"))
    driver = make_driver(engine, oci, work_dir)
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(registry))
    assert caught.value.code == "INSTALL_FAILED"
    assert f"{PROJECT}-job-1 exited (3)" in caught.value.message
    # Read back from the engine: the project is there, and not healthy, so the next pass
    # upgrades it instead of believing it installed.
    [release] = driver.installed()
    assert release.healthy is False and release.detail == f"{PROJECT}-job-1 exited with code 3"
    assert actions(plan([deployment(registry)], driver.installed())) == ["upgrade"]


def test_without_wait_a_crashing_container_shows_up_as_unhealthy(
        registry: str, oci: OciClient, engine: FakeEngine, work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0",
                      compose_archive("  job:\n    image: busybox\n    x-fake-exit: 3\n"))
    driver = make_driver(engine, oci, work_dir)
    assert actions(converge(driver, deployment(registry, wait=False))) == ["install"]
    [release] = driver.installed()
    assert release.healthy is False


def test_a_hanging_compose_is_killed_at_the_timeout(registry: str, oci: OciClient,
                                                    engine: FakeEngine,
                                                    work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", compose_archive())
    driver = make_driver(engine, oci, work_dir, grace_seconds=0.0, FAKEDOCKER_HANG="up")
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(registry, timeout="0m1s"))
    assert caught.value.code == "TIMEOUT"


def test_an_unreachable_daemon_is_engine_unavailable(registry: str, oci: OciClient,
                                                     engine: FakeEngine,
                                                     work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", compose_archive())
    driver = make_driver(engine, oci, work_dir, FAKEDOCKER_DAEMON="down")
    with pytest.raises(ApplyError) as caught:
        driver.installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert "Cannot connect to the Docker daemon" in caught.value.message
    with pytest.raises(ApplyError) as caught:
        driver.apply(install_step(deployment(registry)), deployment(registry))
    assert caught.value.code == "ENGINE_UNAVAILABLE"


def test_a_missing_docker_or_compose_is_engine_unavailable(oci: OciClient, engine: FakeEngine,
                                                           tmp_path: Path) -> None:
    driver = ComposeDriver(tmp_path / "w", oci, docker=str(tmp_path / "no-such-docker"))
    with pytest.raises(ApplyError) as caught:
        driver.installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    env = {**os.environ, **engine.env, "FAKEDOCKER_NO_COMPOSE": "1"}
    with pytest.raises(ApplyError) as caught:
        detect_compose_command(engine.docker, env=env, standalone=None)
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert detect_compose_command(engine.docker, env={**os.environ, **engine.env}) == [
        engine.docker, "compose"]


def test_the_real_docker_cli_without_an_engine_is_engine_unavailable(
        oci: OciClient, tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on this machine")
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock",
           "DOCKER_CONFIG": str(tmp_path / "docker-config")}
    driver = ComposeDriver(tmp_path / "w", oci, docker=docker, env=env)
    with pytest.raises(ApplyError) as caught:
        driver.installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert "no-daemon.sock" in caught.value.message


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
        registry: str, oci: OciClient, engine: FakeEngine, work_dir: Path) -> None:
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", unsafe_archive())
    driver = make_driver(engine, oci, work_dir)
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(registry))
    assert (caught.value.code, caught.value.retryable) == ("UNSAFE_PACKAGE", False)
    assert "'hello/keys'" in caught.value.message
    assert engine.compose_calls("up") == [] and not work_dir.exists()


def test_a_missing_package_is_a_retryable_pull_failure(registry: str, oci: OciClient,
                                                       engine: FakeEngine,
                                                       work_dir: Path) -> None:
    driver = make_driver(engine, oci, work_dir)
    with pytest.raises(ApplyError) as caught:
        converge(driver, deployment(registry, revision="7.7.7"))
    assert (caught.value.code, caught.value.retryable) == ("PULL_FAILED", True)


def test_leftovers_of_interrupted_steps_are_cleaned_up(registry: str, oci: OciClient,
                                                       engine: FakeEngine,
                                                       work_dir: Path) -> None:
    archive = compose_archive()
    oci.push_artifact(f"oci://{registry}/compose/hello", "1.0.0", archive)
    digest_hex = oci.pull(f"oci://{registry}/compose/hello", "1.0.0").layer.digest[7:]
    project_dir = work_dir / PROJECT
    stale = [project_dir / ("c" * 64), project_dir / f".{digest_hex}.partial-0a1b2c"]
    for directory in stale:
        directory.mkdir(parents=True)
        (directory / "compose.yaml").write_text("old")
    (project_dir / digest_hex).mkdir()  # an incomplete package dir (no compose.yaml)
    (project_dir / "notes.txt").write_text("someone's notes stay")
    converge(make_driver(engine, oci, work_dir), deployment(registry))
    assert sorted(p.name for p in project_dir.iterdir()) == sorted(
        [digest_hex, ENV_FILE, OVERRIDE_FILE, "notes.txt"])
    assert (project_dir / digest_hex / "compose.yaml").is_file()


def test_project_files_layout() -> None:
    files = project_files(Path("/w"), "p", "sha256:" + "d" * 64)
    assert files == ProjectFiles(
        project_dir=Path("/w/p"), package_dir=Path("/w/p/" + "d" * 64),
        compose_file=Path("/w/p/" + "d" * 64 + "/compose.yaml"),
        override_file=Path("/w/p/margo-override.yaml"), env_file=Path("/w/p/margo.env"))
    assert Container("i", "n", "running", "Up", {}).exit_code is None
    assert Container("i", "n", "exited", "Exited (2) 1 second ago", {}).exit_code == 2
