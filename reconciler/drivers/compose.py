"""The Compose driver: one Docker Compose project per deployment component.

Each step runs the Docker Compose CLI (the `docker compose` v2 plugin, or a standalone
`docker-compose` when that is what the device has; detected once). The project name is
`reconciler.releases.release_name(deployment id, component)`.

Install, upgrade and reconfigure:

1. pull the component's package with `reconciler.oci` (digests verified) and validate it
   with `reconciler.compose_package` (structure and safety), both before anything is
   written;
2. extract it, once, into `<work_dir>/<project>/<archive sha256 hex>/` (content-addressed,
   written atomically, reused by later steps with the same package);
3. write `<work_dir>/<project>/margo.env` (the component's environment, quoted so Compose
   reads it back literally) and `<work_dir>/<project>/margo-override.yaml` (our ownership
   labels on every service);
4. `docker compose -p <project> -f compose.yaml -f margo-override.yaml [--env-file <package
   .env>] --env-file margo.env up -d --remove-orphans [--wait --wait-timeout <s>]`, then
   delete package directories of earlier revisions.

Remove: `docker compose -p <project> down --remove-orphans` (idempotent: no containers, no
error), then the project's directory is deleted.

What is installed is read from the ENGINE, never from a private list: `docker ps -a` filtered
on our managed-by label, each container's labels read one by one with the template's
`.Label` (exact values, no comma-joined label string to split). Containers are grouped by
their Compose project. A project is healthy when every container is either running (a
health check may be starting, but not `unhealthy`) or exited with code 0 (a one-shot job
that finished); any other state (exited non-zero, dead, restarting, paused, created) or
containers that disagree about the ownership labels (an interrupted upgrade) makes it
unhealthy, and the planner upgrades it again. Compose has no namespaces: releases report
namespace "".

Errors: a failing `docker compose` is `INSTALL_FAILED` / `UPGRADE_FAILED` (reconfigure
too) / `UNINSTALL_FAILED` with the tail of its stderr, unless `docker version` then shows
the daemon is unreachable (`ENGINE_UNAVAILABLE`); a command exceeding the component's
timeout (plus a grace period) is killed with its process group: `TIMEOUT`; no docker CLI or
no Compose: `ENGINE_UNAVAILABLE`. Pull and package errors come from `reconciler.oci` and
`reconciler.compose_package` unchanged.

The command lines and files are built by pure functions (`compose_commands`,
`env_file_text`, `override_document`, `releases_from_ps`), testable without any engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from margo.component_values import env_string
from reconciler.compose_package import COMPOSE_FILE, extract_package, validate_package
from reconciler.desired import DesiredComponent, DesiredDeployment
from reconciler.drivers.base import ApplyError
from reconciler.oci import OciClient
from reconciler.planner import Action, Step
from reconciler.releases import (
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_DESIRED,
    LABEL_MANAGED_BY,
    LABEL_SPEC,
    LABEL_VALUES,
    MANAGER,
    InstalledRelease,
    ownership_labels,
    release_from_labels,
)

__all__ = ["ENV_FILE", "OVERRIDE_FILE", "PS_FORMAT", "ComposeDriver", "Container",
           "ProjectFiles", "compose_commands", "container_healthy", "detect_compose_command",
           "env_file_text", "override_document", "parse_ps_output", "project_files",
           "releases_from_ps"]

ENV_FILE = "margo.env"
OVERRIDE_FILE = "margo-override.yaml"
LABEL_PROJECT = "com.docker.compose.project"
LABEL_SERVICE = "com.docker.compose.service"
_READ_LABELS = (LABEL_MANAGED_BY, LABEL_DEPLOYMENT, LABEL_COMPONENT, LABEL_DESIRED, LABEL_SPEC,
                LABEL_VALUES, LABEL_PROJECT, LABEL_SERVICE)
#: `docker ps --format`: one JSON object per container, labels read one by one.
PS_FORMAT = ('{"id":{{json .ID}},"names":{{json .Names}},"state":{{json .State}},'
             '"status":{{json .Status}},"labels":{'
             + ",".join(f'"{label}":{{{{json (.Label "{label}")}}}}' for label in _READ_LABELS)
             + "}}")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXIT_CODE = re.compile(r"Exited \((-?\d+)\)")
_PACKAGE_DIR = re.compile(r"[0-9a-f]{64}")
_PARTIAL_DIR = re.compile(r"\.[0-9a-f]{64}\.partial-[0-9a-f]+")
_FAILURE_CODES = {Action.INSTALL: "INSTALL_FAILED", Action.UPGRADE: "UPGRADE_FAILED",
                  Action.RECONFIGURE: "UPGRADE_FAILED", Action.REMOVE: "UNINSTALL_FAILED"}
_STDERR_TAIL = 2000


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class ProjectFiles:
    """Where one project's files live on the device."""

    project_dir: Path
    package_dir: Path  # the extracted package, named by the archive's sha256
    compose_file: Path
    override_file: Path
    env_file: Path
    package_env_file: Path | None = None  # the package's own `.env` (defaults), if it has one


def project_files(work_dir: Path, project: str, archive_digest: str, *,
                  package_env: bool = False) -> ProjectFiles:
    """The layout for `project` running the archive with digest `archive_digest`."""
    project_dir = Path(work_dir) / project
    package_dir = project_dir / archive_digest.partition(":")[2]
    return ProjectFiles(project_dir=project_dir, package_dir=package_dir,
                        compose_file=package_dir / COMPOSE_FILE,
                        override_file=project_dir / OVERRIDE_FILE,
                        env_file=project_dir / ENV_FILE,
                        package_env_file=package_dir / ".env" if package_env else None)


def _dotenv_value(text: str) -> str:
    """Quote a value so Compose's dotenv reader gives back exactly `text`.

    Single quotes are literal (no escapes, no `${}` interpolation) and are used whenever
    they can be: when the text has no `'` and does not end with a backslash (which would
    escape the closing quote). Otherwise double quotes, escaping backslash, double quote,
    newline and carriage return, and doubling `$` (Compose's literal dollar)."""
    if "'" not in text and not text.endswith("\\"):
        return f"'{text}'"
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$")
               .replace("\n", "\\n").replace("\r", "\\r"))
    return f'"{escaped}"'


def env_file_text(values: Mapping[str, Any]) -> str:
    """The `--env-file` for a component's environment, sorted by name.

    Raises `ValueError` for a name that is not an environment variable name and for values
    `margo.component_values.env_string` cannot render."""
    lines = ["# Written by margo-gitops from the deployment's parameters. Do not edit."]
    for name in sorted(values):
        if not _VARIABLE.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        value = values[name]
        text = value if isinstance(value, str) else env_string(value)
        if "\x00" in text:
            raise ValueError(f"{name}: environment values cannot contain NUL characters")
        lines.append(f"{name}={_dotenv_value(text)}")
    return "\n".join(lines) + "\n"


def override_document(services: Iterable[str], labels: Mapping[str, str]) -> dict[str, Any]:
    """A Compose override adding `labels` to every service (Compose merges label maps)."""
    return {"services": {service: {"labels": dict(labels)} for service in services}}


def _write_atomically(path: Path, text: str, mode: int) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), mode)
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


# --------------------------------------------------------------------------- commands


def compose_commands(step: Step, *, compose: Sequence[str],
                     files: ProjectFiles | None = None) -> list[list[str]]:
    """The exact Compose CLI calls for one step (none for an unchanged component).

    `files` is required for install, upgrade and reconfigure."""
    project = step.release_name
    if step.action is Action.UNCHANGED:
        return []
    if step.action is Action.REMOVE:
        return [[*compose, "-p", project, "down", "--remove-orphans"]]
    if files is None or step.desired is None:
        raise ValueError(f"{step.action} of {project} needs the desired component and its files")
    argv = [*compose, "-p", project, "-f", str(files.compose_file),
            "-f", str(files.override_file)]
    if files.package_env_file is not None:
        argv += ["--env-file", str(files.package_env_file)]
    argv += ["--env-file", str(files.env_file), "up", "-d", "--remove-orphans"]
    if step.desired.wait:
        argv += ["--wait", "--wait-timeout", str(max(1, math.ceil(step.desired.timeout_seconds)))]
    return [argv]


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Container:
    """One container as `docker ps` (with `PS_FORMAT`) describes it."""

    id: str
    name: str
    state: str  # created, running, paused, restarting, removing, exited, dead
    status: str  # "Up 3 minutes (healthy)", "Exited (1) 2 seconds ago", ...
    labels: Mapping[str, str]  # only labels with a value

    @property
    def exit_code(self) -> int | None:
        match = _EXIT_CODE.search(self.status)
        return int(match.group(1)) if match else None


def parse_ps_output(text: str) -> list[Container]:
    """Containers from `docker ps --format PS_FORMAT` output; `ValueError` when a line is
    not what that format produces."""
    containers = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("labels"), dict):
            raise ValueError(f"unexpected docker ps line: {line[:200]!r}")
        labels = {str(k): str(v) for k, v in record["labels"].items() if v}
        containers.append(Container(id=str(record.get("id", "")),
                                    name=str(record.get("names", "")),
                                    state=str(record.get("state", "")),
                                    status=str(record.get("status", "")), labels=labels))
    return containers


def container_healthy(container: Container) -> bool:
    """Running (and not reported unhealthy), or a one-shot container that exited 0."""
    if container.state == "running":
        return "(unhealthy)" not in container.status
    return container.state == "exited" and container.exit_code == 0


def _describe(container: Container) -> str:
    if container.state == "exited":
        return f"{container.name} exited with code {container.exit_code}"
    if container.state == "running":
        return f"{container.name} is unhealthy"
    return f"{container.name} is {container.state}"


def _project_release(project: str, containers: list[Container]) -> InstalledRelease | None:
    ordered = sorted(containers, key=lambda c: c.name)
    ownership = {tuple(c.labels.get(label, "") for label in _READ_LABELS[:6]) for c in ordered}
    failing = [c for c in ordered if not container_healthy(c)]
    if len(ownership) > 1:
        healthy, detail = False, "containers carry different ownership labels"
    elif failing:
        healthy = False
        detail = "; ".join(_describe(c) for c in failing)
    else:
        healthy = True
        detail = f"running ({len(ordered)} container{'s' if len(ordered) != 1 else ''})"
    for container in ordered:
        release = release_from_labels(container.labels, release_name=project, namespace="",
                                      healthy=healthy, detail=detail)
        if release is not None:
            return release
    return None


def releases_from_ps(containers: Iterable[Container]) -> list[InstalledRelease]:
    """Our releases, one per Compose project whose containers carry our labels."""
    by_project: dict[str, list[Container]] = defaultdict(list)
    for container in containers:
        if container.labels.get(LABEL_MANAGED_BY) == MANAGER and LABEL_PROJECT in container.labels:
            by_project[container.labels[LABEL_PROJECT]].append(container)
    releases = (_project_release(p, cs) for p, cs in sorted(by_project.items()))
    return [release for release in releases if release is not None]


# --------------------------------------------------------------------------- processes


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL else "..." + text[-_STDERR_TAIL:]


def _run(argv: Sequence[str], *, timeout: float,
         env: Mapping[str, str] | None) -> subprocess.CompletedProcess[str]:
    """Run a CLI in its own process group; on timeout kill the whole group (the docker CLI
    runs Compose as a child plugin process) and raise `TIMEOUT`. A missing executable is
    `ENGINE_UNAVAILABLE`."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=dict(env) if env else None,
                                   text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        raise ApplyError("ENGINE_UNAVAILABLE", f"cannot run {argv[0]}: {exc}") from exc
    with process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise ApplyError("TIMEOUT", f"{' '.join(argv[:4])} ... did not finish within "
                             f"{timeout:g} s and was stopped") from None
    return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)


def detect_compose_command(docker: str, *, env: Mapping[str, str] | None = None,
                           standalone: str | None = None,
                           timeout: float = 30.0) -> list[str]:
    """`[docker, "compose"]` when the v2 plugin answers `version`, else `[standalone]` when
    a standalone `docker-compose` is given and answers; else `ENGINE_UNAVAILABLE`."""
    candidates = [[docker, "compose"]] + ([[standalone]] if standalone else [])
    for command in candidates:
        try:
            if _run([*command, "version"], timeout=timeout, env=env).returncode == 0:
                return command
        except ApplyError:
            continue
    raise ApplyError("ENGINE_UNAVAILABLE", f"Docker Compose is not available: neither "
                     f"`{docker} compose` nor a standalone docker-compose answers `version`")


# --------------------------------------------------------------------------- driver


class ComposeDriver:
    """Runs `compose` deployments with the Docker Compose CLI (see the module docstring).

    `env` is added to the CLI's environment (e.g. `DOCKER_HOST`). `grace_seconds` is added
    to a component's timeout before its `up` is killed (Compose's own `--wait-timeout` comes
    first); `command_timeout` bounds `down`, `ps` and the probes. The caller owns `oci`."""

    name = "compose"
    profile_types = ("compose",)

    def __init__(self, work_dir: Path, oci: OciClient, *, docker: str = "docker",
                 compose_command: list[str] | None = None,
                 env: Mapping[str, str] | None = None, grace_seconds: float = 30.0,
                 command_timeout: float = 120.0) -> None:
        self.work_dir = Path(work_dir)
        self._oci = oci
        self._docker = docker
        self._compose = list(compose_command) if compose_command else None
        self._env = {**os.environ, **env} if env else None
        self._grace = grace_seconds
        self._command_timeout = command_timeout

    def close(self) -> None:
        """Nothing to release: every engine call is a short-lived process."""

    # ------------------------------------------------------------------ reading

    def installed(self) -> list[InstalledRelease]:
        argv = [self._docker, "ps", "-a", "--no-trunc", "--filter",
                f"label={LABEL_MANAGED_BY}={MANAGER}", "--format", PS_FORMAT]
        try:
            result = _run(argv, timeout=self._command_timeout, env=self._env)
        except ApplyError as exc:
            raise ApplyError("ENGINE_UNAVAILABLE", exc.message) from exc
        if result.returncode != 0:
            raise ApplyError("ENGINE_UNAVAILABLE", f"docker ps failed: {_tail(result.stderr)}")
        try:
            return releases_from_ps(parse_ps_output(result.stdout))
        except ValueError as exc:
            raise ApplyError("ENGINE_UNAVAILABLE", f"cannot read docker ps output: {exc}") from exc

    # ------------------------------------------------------------------ steps

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        if step.action is Action.UNCHANGED:
            return
        if step.action is Action.REMOVE:
            self._remove(step)
            return
        if deployment is None or step.desired is None:
            raise ValueError(f"{step.action} of {step.release_name} needs its deployment")
        files = self._prepare(step, deployment, step.desired)
        for argv in compose_commands(step, compose=self._compose_command(), files=files):
            self._compose_run(argv, step, timeout=step.desired.timeout_seconds + self._grace)
        self._prune(files)

    def _prepare(self, step: Step, deployment: DesiredDeployment,
                 component: DesiredComponent) -> ProjectFiles:
        """Pull, verify, validate, extract (once per archive) and write our two files."""
        artifact = self._oci.pull(component.repository, component.revision)
        package = validate_package(artifact.data)
        files = project_files(self.work_dir, step.release_name, package.digest,
                              package_env=".env" in package.files)
        if not files.compose_file.is_file():
            if files.package_dir.exists():  # not made by us (we rename complete dirs only)
                shutil.rmtree(files.package_dir)
            extract_package(package, files.package_dir)
        labels = ownership_labels(deployment.deployment_id, component.name,
                                  desired_digest=deployment.digest,
                                  spec_digest=component.spec_digest,
                                  values_digest=component.values_digest)
        try:
            env_text = env_file_text(component.values)
        except (TypeError, ValueError) as exc:
            raise ApplyError("RENDER_FAILED", f"component {component.name!r}: {exc}",
                             retryable=False) from exc
        override = yaml.safe_dump(override_document(package.services, labels), sort_keys=True)
        _write_atomically(files.env_file, env_text, 0o600)
        _write_atomically(files.override_file, "# Written by margo-gitops. Do not edit.\n"
                          + override, 0o644)
        return files

    def _remove(self, step: Step) -> None:
        for argv in compose_commands(step, compose=self._compose_command()):
            self._compose_run(argv, step, timeout=self._command_timeout)
        project_dir = self.work_dir / step.release_name
        if project_dir.is_dir():
            shutil.rmtree(project_dir)

    def _compose_command(self) -> list[str]:
        if self._compose is None:
            self._compose = detect_compose_command(
                self._docker, env=self._env, standalone=shutil.which("docker-compose"),
                timeout=self._command_timeout)
        return self._compose

    def _compose_run(self, argv: list[str], step: Step, *, timeout: float) -> None:
        result = _run(argv, timeout=timeout, env=self._env)
        if result.returncode == 0:
            return
        message = f"{step.action} of {step.release_name}: docker compose exited with " \
                  f"{result.returncode}: {_tail(result.stderr)}"
        if not self._daemon_reachable():
            raise ApplyError("ENGINE_UNAVAILABLE", message)
        raise ApplyError(_FAILURE_CODES[step.action], message)

    def _daemon_reachable(self) -> bool:
        """Whether `docker version` reaches the daemon: tells an engine outage from a
        failing project without matching error text."""
        argv = [self._docker, "version", "--format", "{{json .Server.Version}}"]
        try:
            return _run(argv, timeout=self._command_timeout, env=self._env).returncode == 0
        except ApplyError:
            return False

    @staticmethod
    def _prune(files: ProjectFiles) -> None:
        """Delete package directories of earlier revisions and interrupted extractions."""
        for entry in files.project_dir.iterdir():
            if entry == files.package_dir or not entry.is_dir() or entry.is_symlink():
                continue
            if _PACKAGE_DIR.fullmatch(entry.name) or _PARTIAL_DIR.fullmatch(entry.name):
                shutil.rmtree(entry)
