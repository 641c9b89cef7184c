"""The Compose driver's pure parts: command lines, the env file, the override, and reading
projects back from `docker ps` output (the real engine's cycles: test_compose_driver.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kits.composekit import DEPLOYMENT_ID, PROJECT, compose_deployment

from reconciler.desired import DesiredDeployment
from reconciler.drivers.compose import (
    ENV_FILE,
    OVERRIDE_FILE,
    PS_FORMAT,
    Container,
    ProjectFiles,
    compose_commands,
    container_healthy,
    env_file_text,
    override_document,
    parse_ps_output,
    project_files,
    releases_from_ps,
)
from reconciler.drivers.compose_drift import (
    applied_record,
    one_shot_services,
    project_drift,
    read_applied,
    releases_with_drift,
    write_applied,
)
from reconciler.drivers.compose_engine import LABEL_CONFIG_HASH, LABEL_SERVICES, read_back
from reconciler.planner import Action, Step
from reconciler.releases import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    MANAGER,
    ReleaseState,
    ownership_labels,
)


def deployment(registry: str, **options: Any) -> DesiredDeployment:
    return compose_deployment(f"oci://{registry}/compose/hello", **options)


def install_step(deployment: DesiredDeployment, action: Action = Action.INSTALL) -> Step:
    component = deployment.components[0]
    return Step(action, deployment.deployment_id, component.name, PROJECT, "hello", component,
                None, "test")


def test_up_command_line_for_a_waiting_component() -> None:
    desired = deployment("127.0.0.1:5000", timeout="2m30s")
    files = project_files(Path("/w"), PROJECT, "sha256:" + "a" * 64, package_env=True)
    base = ["docker", "compose", "-p", PROJECT,
            "-f", f"/w/{PROJECT}/{'a' * 64}/compose.yaml", "-f", f"/w/{PROJECT}/{OVERRIDE_FILE}",
            "--env-file", f"/w/{PROJECT}/{'a' * 64}/.env",
            "--env-file", f"/w/{PROJECT}/{ENV_FILE}"]
    assert compose_commands(install_step(desired), compose=["docker", "compose"],
                            files=files) == [
        [*base, "pull", "--policy", "missing", "--quiet"],
        [*base, "up", "-d", "--remove-orphans", "--wait", "--wait-timeout", "150"]]


def test_up_command_line_without_wait_and_without_package_env() -> None:
    desired = deployment("127.0.0.1:5000", wait=False)
    files = project_files(Path("/w"), PROJECT, "sha256:" + "b" * 64)
    pull, argv = compose_commands(install_step(desired, Action.RECONFIGURE),
                                  compose=["docker-compose"], files=files)
    assert pull[-4:] == ["pull", "--policy", "missing", "--quiet"]
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


def test_override_labels_every_service_and_lists_them() -> None:
    labels = {LABEL_MANAGED_BY: MANAGER, LABEL_COMPONENT: "c"}
    marked = {**labels, LABEL_SERVICES: "db,web"}
    assert override_document(["web", "db"], labels) == {"services": {
        "web": {"labels": marked}, "db": {"labels": marked}}}


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
    ("running", "Up 5 minutes (health: starting)", False),
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
    found = {r.release_name: r for r in releases_from_ps(parse_ps_output(text))}
    assert {name: r.state for name, r in found.items() if name != "p1"} == {
        "by-hand": ReleaseState.UNMANAGED, "half": ReleaseState.UNMANAGED}
    release = found["p1"]
    assert (release.release_name, release.deployment_id, release.component) == ("p1", "d1", "c1")
    assert (release.spec_digest, release.values_digest) == ("2" * 40, "3" * 40)
    assert release.healthy is False and release.detail == "p1-job-1 exited with code 2"


def test_containers_disagreeing_about_ownership_make_the_project_unhealthy() -> None:
    newer = {**OURS, "margo-gitops.dev/values-digest": "4" * 40}
    [release] = releases_from_ps(parse_ps_output("\n".join([
        ps_line("p1-a-1", "running", "Up", **OURS), ps_line("p1-b-1", "running", "Up", **newer)])))
    assert release.healthy is False and "different ownership labels" in release.detail


def test_a_declared_service_without_a_container_makes_the_project_unhealthy() -> None:
    listed = {**OURS, LABEL_SERVICES: "db,web"}
    [release] = releases_from_ps(parse_ps_output(ps_line(
        "p1-web-1", "running", "Up", **listed, **{"com.docker.compose.service": "web"})))
    assert release.healthy is False and release.detail == "service db has no container"


def test_unreadable_ps_output_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_ps_output('{"id": "x"}\n')
    with pytest.raises(ValueError):
        parse_ps_output("not json\n")



def test_project_files_layout() -> None:
    files = project_files(Path("/w"), "p", "sha256:" + "d" * 64)
    assert files == ProjectFiles(
        project_dir=Path("/w/p"), package_dir=Path("/w/p/" + "d" * 64),
        compose_file=Path("/w/p/" + "d" * 64 + "/compose.yaml"),
        override_file=Path("/w/p/margo-override.yaml"), env_file=Path("/w/p/margo.env"))
    assert Container("i", "n", "running", "Up", {}).exit_code is None
    assert Container("i", "n", "exited", "Exited (2) 1 second ago", {}).exit_code == 2


def container(service: str, state: str = "running", status: str = "Up (healthy)", *,
              digest: str = "h1") -> Container:
    return Container(f"id-{service}", f"p1-{service}-1", state, status, {
        **OURS, "com.docker.compose.service": service, LABEL_CONFIG_HASH: digest})


COMPOSE = {"services": {
    "web": {"image": "w"}, "worker": {"image": "w", "restart": "unless-stopped"},
    "plain": {"image": "w"}, "job": {"image": "w"},
    "app": {"image": "w", "depends_on": {"job": {"condition": "service_completed_successfully"},
                                         "web": {"condition": "service_started"}}}}}


def test_the_record_of_an_up_says_which_services_keep_running(tmp_path: Path) -> None:
    assert one_shot_services(COMPOSE) == {"job"}
    up = [container("web"), container("worker", status="Up 2 seconds"),
          container("plain", status="Up 2 seconds"), container("app", status="Up (healthy)"),
          container("job", "exited", "Exited (0) 1 second ago", digest="h2")]
    applied = applied_record(up, OURS, COMPOSE)
    assert applied.keeps_running == {"web", "worker", "app"}  # health-checked or restarted
    assert applied.hashes == {"app": "h1", "job": "h2", "plain": "h1", "web": "h1",
                              "worker": "h1"}
    write_applied(tmp_path / "r.json", applied)
    assert read_applied(tmp_path / "r.json") == applied
    assert read_applied(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text('{"format": 1, "labels": {}, "services": {"x": 1}}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        read_applied(tmp_path / "bad.json")


#: A project as its `up` left it: web health-checked, plain without a health check, a job.
AFTER_UP = {"web": container("web"), "plain": container("plain", status="Up 2 seconds"),
            "job": container("job", "exited", "Exited (0) 1 second ago", digest="h2")}


@pytest.mark.parametrize(("found", "drift"), [
    (container("web", "exited", "Exited (0) 1 second ago"),
     "p1-web-1 was stopped (exited with code 0)"),
    (container("plain", "exited", "Exited (143) 1 second ago"),
     "p1-plain-1 was stopped (exited with code 143)"),
    (container("web", "paused", "Up (Paused)"), "p1-web-1 was paused"),
    (container("web", digest="other"), "p1-web-1 was recreated from another configuration"),
    (container("plain", "exited", "Exited (0) 1 second ago"), ""),  # its work is done
    (container("plain", "exited", "Exited (3) 1 second ago"), ""),  # crashed: a failure
])
def test_what_counts_as_drift(found: Container, drift: str) -> None:
    applied = applied_record(AFTER_UP.values(), OURS, COMPOSE)
    now = [*(c for c in AFTER_UP.values() if c.name != found.name), found]
    sentence, drifted = project_drift(now, applied)
    assert (sentence, drifted) == (drift, {found.id} if drift else set())
    [release] = releases_with_drift(now, {"p1": applied}, "repair")
    assert (release.drift, release.repair) == (drift, bool(drift))
    assert release.healthy is (found.exit_code != 3)


def test_a_recorded_project_without_containers_is_listed_as_drifted() -> None:
    applied = applied_record([container("web")], OURS, COMPOSE)
    [release] = releases_with_drift([], {"p1": applied}, "warn")
    assert (release.release_name, release.component, release.healthy) == ("p1", "c1", True)
    assert (release.drift, release.repair) == ("every container of the project is gone", False)
    assert releases_with_drift([], {"p1": applied.__class__({}, {}, frozenset())}, "warn") == []


LABELS = ownership_labels("d1", "c1", desired_digest="sha256:" + "1" * 64,
                          spec_digest="sha256:" + "2" * 64, values_digest="sha256:" + "3" * 64)


def service(name: str, state: str, status: str, config_hash: str = "h1",
            **labels: str) -> str:
    return ps_line(f"p1-{name}-1", state, status, **{
        **OURS, "com.docker.compose.service": name, LABEL_CONFIG_HASH: config_hash, **labels})


@pytest.mark.parametrize(("lines", "wait", "idle", "differences"), [
    ([service("web", "running", "Up 1 second (healthy)")], True, (), {}),
    ([service("web", "running", "Up 1 second (health: starting)")], False, (), {}),
    ([service("web", "running", "Up 1 second (health: starting)")], True, (), {
        "p1-web-1": "is starting (its health check has not passed yet)"}),
    ([service("web", "exited", "Exited (0) 1 second ago")], True, (), {}),
    ([service("web", "exited", "Exited (3) 1 second ago")], False, (), {
        "p1-web-1": "exited with code 3"}),
    ([], True, (), {"service web": "nothing"}),
    ([], True, ("web",), {}),  # scaled to 0: no container is what `up` leaves
    ([service("web", "running", "Up", config_hash="h0")], True, (), {
        "p1-web-1 config-hash": "h0"}),
    ([service("web", "running", "Up", **{LABEL_COMPONENT: "other"})], True, (), {
        f"p1-web-1 label {LABEL_COMPONENT}": "other"}),
    ([service("web", "running", "Up"), service("old", "running", "Up")], True, (), {
        "p1-old-1": "a container of service old"}),
])
def test_what_a_read_back_after_up_requires(lines: list[str], wait: bool, idle: tuple[str, ...],
                                            differences: dict[str, str]) -> None:
    expected, found = read_back(parse_ps_output("\n".join(lines)), LABELS, {"web": "h1"},
                                wait=wait, idle=idle)
    assert {key: found[key] for key in expected if found[key] != expected[key]} == differences
