"""The Compose driver's side of the Docker engine: running the CLI, finding Compose, and
reading back what the engine runs.

Every CLI call runs in its own process group (a timeout kills the docker CLI and the
Compose plugin it started) and with a parent-death signal: when the device client dies,
even by SIGKILL, the Compose call it was waiting for is stopped too, instead of racing the
restarted client on the same project.

What is installed is read from the engine: `docker ps -a` filtered on our managed-by
label, each container's labels read one by one with the template's `.Label` (exact
values, no comma-joined label string to split). Containers are grouped by their Compose
project. A project is healthy when every container is running (healthy, or without a
health check) or has exited with code 0 (a one-shot job that finished),
and every service the package declares has a container (our services label lists them,
so a container removed out of band is noticed). Anything else (exited non-zero, dead,
restarting, paused, created, a missing service, containers that disagree about the
ownership labels after an interrupted upgrade) makes it unhealthy, and the planner
applies it again. With a record of what the driver applied (`compose_drift`), containers
stopped, paused, removed or recreated out of band are drift instead (`project_release`'s
`judged`), and only the rest is judged by health.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.readback import NOTHING
from reconciler.errors import ApplyError, ErrorCode
from reconciler.releases import (
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_DESIRED,
    LABEL_MANAGED_BY,
    LABEL_SPEC,
    LABEL_VALUES,
    InstalledRelease,
    ReleaseState,
    release_from_labels,
)

__all__ = ["LABEL_CONFIG_HASH", "LABEL_PROJECT", "LABEL_SERVICE", "LABEL_SERVICES",
           "PLUGIN_DIRS", "PS_FORMAT", "Container", "by_project", "container_healthy",
           "describe", "detect_compose_command", "ownership_of", "parse_ps_output",
           "plugin_path", "project_release", "read_back", "releases_from_ps", "run_cli",
           "tail"]

LABEL_PROJECT = "com.docker.compose.project"
LABEL_SERVICE = "com.docker.compose.service"
#: Compose's digest of the service configuration a container was created from.
LABEL_CONFIG_HASH = "com.docker.compose.config-hash"
#: Ours, on every container of a project: the package's services, sorted, comma-joined.
LABEL_SERVICES = "margo-gitops.dev/services"
_OWNERSHIP = (LABEL_MANAGED_BY, LABEL_DEPLOYMENT, LABEL_COMPONENT, LABEL_DESIRED, LABEL_SPEC,
              LABEL_VALUES)
_READ_LABELS = (*_OWNERSHIP, LABEL_PROJECT, LABEL_SERVICE, LABEL_SERVICES, LABEL_CONFIG_HASH)
#: `docker ps --format`: one JSON object per container, labels read one by one.
PS_FORMAT = ('{"id":{{json .ID}},"names":{{json .Names}},"state":{{json .State}},'
             '"status":{{json .Status}},"labels":{'
             + ",".join(f'"{label}":{{{{json (.Label "{label}")}}}}' for label in _READ_LABELS)
             + "}}")
#: How a read-back describes a container that is as `up` should leave it.
_AS_APPLIED = "running, or finished with code 0"
#: Where the docker CLI looks for plugins after its own config folder ($DOCKER_CONFIG or
#: ~/.docker, then `cli-plugins`), in its order.
PLUGIN_DIRS = ("/usr/local/lib/docker/cli-plugins", "/usr/local/libexec/docker/cli-plugins",
               "/usr/lib/docker/cli-plugins", "/usr/libexec/docker/cli-plugins")
_EXIT_CODE = re.compile(r"Exited \((-?\d+)\)")
_VERSION = re.compile(r"version v?(\d+)\.", re.IGNORECASE)
_TAIL = 2000
_PR_SET_PDEATHSIG = 1


def tail(text: str, limit: int = _TAIL) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _stop_with_parent() -> None:
    """In the child, before exec: its own session, and SIGTERM when the client dies."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run_cli(argv: Sequence[str], *, timeout: float,
            env: Mapping[str, str] | None) -> subprocess.CompletedProcess[str]:
    """Run a CLI; on timeout kill its whole process group and raise `TIMEOUT`. A missing
    executable is `ENGINE_UNAVAILABLE`."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=dict(env) if env else None,
                                   text=True, errors="replace", preexec_fn=_stop_with_parent)
    except OSError as exc:
        raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"cannot run {argv[0]}: {exc}") from exc
    with process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise ApplyError(ErrorCode.TIMEOUT, f"{' '.join(argv[:4])} ... did not finish within "
                             f"{timeout:g} s and was stopped") from None
    return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)


def plugin_path(env: Mapping[str, str] | None = None) -> Path | None:
    """The Compose plugin the docker CLI would run, or None."""
    environ = os.environ if env is None else env
    config = Path(environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    for folder in (config / "cli-plugins", *map(Path, PLUGIN_DIRS)):
        candidate = folder / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def detect_compose_command(docker: str, choice: str = "auto", *,
                           env: Mapping[str, str] | None = None,
                           standalone: str | None = None,
                           timeout: float = 30.0) -> list[str]:
    """The Compose command line to use, checked with `version`.

    `choice`: `plugin` (`docker compose`), a path (that standalone binary), or `auto` (the
    plugin, else `standalone`, a docker-compose found on PATH). `ENGINE_UNAVAILABLE` when
    the chosen one does not answer."""
    if choice == "plugin":
        candidates = [[docker, "compose"]]
    elif choice == "auto":
        candidates = [[docker, "compose"]] + ([[standalone]] if standalone else [])
    else:
        candidates = [[choice]]
    for command in candidates:
        try:
            answer = run_cli([*command, "version"], timeout=timeout, env=env)
        except ApplyError:
            continue
        version = _VERSION.search(answer.stdout)
        if answer.returncode == 0 and version is not None and int(version.group(1)) >= 2:
            return command
    tried = " or ".join(f"`{' '.join(c)}`" for c in candidates) or "nothing"
    raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"Docker Compose v2 is not available: {tried} "
                     "does not answer `version`")


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
    """Running (healthy, or without a health check), or a one-shot container that exited
    0. A health check still starting is not healthy yet: after a crash in the middle of
    `up --wait`, the next cycle waits for it again instead of reporting it installed."""
    if container.state == "running":
        return "(unhealthy)" not in container.status and \
            "(health: starting)" not in container.status
    return container.state == "exited" and container.exit_code == 0


def describe(container: Container) -> str:
    if container.state == "exited":
        return f"{container.name} exited with code {container.exit_code}"
    if container.state == "running" and "(health: starting)" in container.status:
        return f"{container.name} is starting (its health check has not passed yet)"
    if container.state == "running":
        return f"{container.name} is unhealthy"
    return f"{container.name} is {container.state}"


def _missing_services(containers: list[Container]) -> list[str]:
    declared = {s for c in containers for s in c.labels.get(LABEL_SERVICES, "").split(",") if s}
    present = {c.labels.get(LABEL_SERVICE, "") for c in containers}
    return sorted(declared - present)


def ownership_of(container: Container) -> dict[str, str]:
    """The ownership labels a container carries ("" for a missing one)."""
    return {label: container.labels.get(label, "") for label in _OWNERSHIP}


def project_release(project: str, containers: list[Container], *,
                    judged: tuple[str, set[str]] | None = None) -> InstalledRelease:
    """One project's release from its containers. `judged` is the drift already found
    against the driver's record (a sentence, and the ids of the containers it names): those
    containers and missing services are drift, not failures. A project with failures is
    `failed` whatever drifted (applying it again repairs both)."""
    ordered = sorted(containers, key=lambda c: c.name)
    drift, drifted = judged if judged is not None else ("", set())
    ownership = {tuple(ownership_of(c).values()) for c in ordered}
    failing = [c for c in ordered if c.id not in drifted and not container_healthy(c)]
    missing = _missing_services(ordered) if judged is None else []
    if len(ownership) > 1:
        state, detail = ReleaseState.FAILED, "containers carry different ownership labels"
    elif failing or missing:
        state = ReleaseState.FAILED
        detail = "; ".join([describe(c) for c in failing]
                           + [f"service {s} has no container" for s in missing])
    else:
        state = ReleaseState.DEPLOYED
        detail = drift or f"running ({len(ordered)} container{'s' if len(ordered) != 1 else ''})"
    found = [release_from_labels(c.labels, release_name=project, namespace="", state=state,
                                 detail=detail) for c in ordered]
    return next((r for r in found if r.managed), found[0])


def by_project(containers: Iterable[Container]) -> dict[str, list[Container]]:
    """Containers grouped by their Compose project, projects sorted by name."""
    grouped: dict[str, list[Container]] = defaultdict(list)
    for container in containers:
        if LABEL_PROJECT in container.labels:
            grouped[container.labels[LABEL_PROJECT]].append(container)
    return dict(sorted(grouped.items()))


def releases_from_ps(containers: Iterable[Container]) -> list[InstalledRelease]:
    """One release per Compose project: ours (its containers carry our labels) or
    `UNMANAGED` (a project someone else started, which is never touched)."""
    return [project_release(p, cs) for p, cs in by_project(containers).items()]


def _state_after_up(container: Container, *, wait: bool) -> str:
    """`_AS_APPLIED` for a container as a successful `up` leaves it (with `wait`, its health
    check passed), else what it is instead."""
    starting = "(health: starting)" in container.status
    if container_healthy(container) or (starting and not wait):
        return _AS_APPLIED
    return describe(container).removeprefix(f"{container.name} ")


def read_back(containers: Iterable[Container], labels: Mapping[str, str],
              hashes: Mapping[str, str], *, wait: bool,
              idle: Iterable[str] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """What a project's containers must show right after a successful `up`, and what they
    show, in `reconciler.drivers.readback.require_match`'s terms: a container for every
    service in `hashes` (Compose's own `config --hash` of the files the driver wrote;
    `idle` services are scaled to zero), each one running (healthy, with `wait`) or
    finished with code 0, carrying our ownership `labels` and its service's config-hash;
    no container of any other service."""
    expected: dict[str, str] = {}
    found: dict[str, str] = {}
    ordered = sorted(containers, key=lambda c: c.name)
    present = {c.labels.get(LABEL_SERVICE, "") for c in ordered}
    for service in sorted(set(hashes) - set(idle)):
        expected[f"service {service}"] = "a container"
        found[f"service {service}"] = "a container" if service in present else NOTHING
    for container in ordered:
        name, service = container.name, container.labels.get(LABEL_SERVICE, "")
        if service not in hashes:
            expected[name] = NOTHING
            found[name] = f"a container of service {service or '(none)'}"
            continue
        expected[name] = _AS_APPLIED
        found[name] = _state_after_up(container, wait=wait)
        expected[f"{name} config-hash"] = hashes[service]
        found[f"{name} config-hash"] = container.labels.get(LABEL_CONFIG_HASH, NOTHING)
        for label, value in sorted(labels.items()):
            expected[f"{name} label {label}"] = value
            found[f"{name} label {label}"] = container.labels.get(label, NOTHING)
    return expected, found
