"""The Compose driver: one Docker Compose project per deployment component.

Each step runs Docker Compose v2: the docker CLI's `compose` plugin, or a standalone
binary (`compose:` in the device configuration; `auto` tries the plugin, then a
`docker-compose` on PATH). `docker_host` is the engine it talks to (`DOCKER_HOST`). The
project name is `reconciler.releases.release_name(deployment id, component)`.

Install, upgrade and reconfigure:

1. pull the component's package with `reconciler.oci` (digests verified) and validate it
   with `reconciler.compose_package` (structure and safety), both before anything is
   written;
2. extract it, once, into `<work_dir>/<project>/<archive sha256 hex>/` (content-addressed,
   written atomically, reused by later steps with the same package);
3. write `<work_dir>/<project>/margo.env` (the component's environment, quoted so Compose
   reads it back literally) and `<work_dir>/<project>/margo-override.yaml` (our ownership
   labels and the list of services on every service, and the Margo telemetry variables
   each service does not set itself: `reconciler.telemetry.inject`);
4. `docker compose -p <project> -f compose.yaml -f margo-override.yaml [--env-file <package
   .env>] --env-file margo.env pull --policy missing --quiet`: images not yet on the engine
   are pulled first, so a registry that refuses us is `PULL_FAILED` naming the registry,
   and an offline device with its images still reconfigures;
5. stop the project's paused containers (`up` refuses to start a paused one, and an
   unpaused one keeps the failing health state it got while frozen), then the
   same `... up -d --remove-orphans [--wait --wait-timeout <s>]`; `repair` (drift under the
   `repair` policy) is exactly this too: `up` starts what was stopped, recreates what was
   removed or changed;
6. write what was applied (`compose_drift`: labels, config-hashes, which services keep
   running; deleted before `up`, so only a successful one leaves it), then delete package
   directories of earlier revisions;
7. read the result back (`confirm`, `reconciler.drivers.readback`): every service Compose
   starts from the files written (`config --hash`) has a container, running (healthy, with
   `wait`) or finished with code 0, with our labels and Compose's config-hash of those
   files; after a removal, no container is left. Anything else is `READBACK_MISMATCH`.

Drift (`drift`, the device's `driftDetection`, default `repair`): with `warn` or `repair`,
`installed()` judges each project against what was applied (`compose_drift`): containers
stopped, paused, removed or recreated from another configuration out of band are named in
`InstalledRelease.drift`. With `off`, every project is judged by its containers' health
alone, as it was before drift checks existed (an exited or missing container is a failure,
applied again).

Registry credentials (`reconciler.registry_credentials`) reach the engine through a
per-call `DOCKER_CONFIG`: a fresh 0700 folder with a 0600 `config.json`, removed as soon
as the call returns (the plugins folder of the usual config is linked into it, so the
`compose` plugin is still found). Credentials the fleet granted to the deployment
(`reconciler.registry_grants`) are opened at the start of its step, with its sealed values,
and used for that step's package pull (`OciClient.pull(granted=)`) and in the `config.json`
of its `pull` and `up` calls, next to the device's own, which win for a host they name.

Remove: `docker compose -p <project> down --remove-orphans` (idempotent: no containers, no
error; named volumes are kept), then the project's directory is deleted.

What is installed is read from the engine (`compose_engine`). Compose has no namespaces:
releases report namespace "".

Sealed values (`reconciler.sealed_values`): the component's envelopes are opened with the
device's key (`key`) before anything is pulled or written; a value that cannot be opened is
`SECRET_UNREADABLE` and the running project is left as it was. Opened values never reach a
file: they are left out of `margo.env` and given to the `pull`, `up` and `config --hash`
calls in the process environment instead, which Compose's interpolation reads first
(before any `--env-file`). Like any Compose value, the engine then holds them in the
containers' configuration. Compose's output, as it appears in messages, loses every
plaintext (`Opened.redacting`).

Errors: a failing `docker compose` is `INSTALL_FAILED` / `UPGRADE_FAILED` (reconfigure
too) / `UNINSTALL_FAILED` with the tail of its stderr and the last log lines of every
container that is not running (a crash during start-up shows its own words), unless
`docker version` then shows the daemon is unreachable (`ENGINE_UNAVAILABLE`). A failing
pull is `PULL_FAILED`. A command exceeding the component's timeout (plus a grace period) is
killed with its process group: `TIMEOUT`. No docker CLI or no Compose:
`ENGINE_UNAVAILABLE`. Package errors come from `reconciler.oci` and
`reconciler.compose_package` unchanged.

The command lines and files are built by pure functions (`compose_commands`,
`env_file_text`, `override_document`), testable without any engine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from margo.component_values import env_string
from margo.files import write_atomically
from reconciler.compose_package import COMPOSE_FILE, restore_extracted, validate_package
from reconciler.desired import DesiredComponent, DesiredDeployment
from reconciler.drivers.compose_drift import (
    APPLIED_FILE,
    Applied,
    applied_record,
    read_applied,
    releases_with_drift,
    write_applied,
)
from reconciler.drivers.compose_engine import (
    LABEL_PROJECT,
    LABEL_SERVICES,
    PS_FORMAT,
    Container,
    container_healthy,
    describe,
    detect_compose_command,
    parse_ps_output,
    plugin_path,
    read_back,
    releases_from_ps,
    run_cli,
    tail,
)
from reconciler.drivers.readback import NOTHING, require_match
from reconciler.errors import ApplyError, ErrorCode
from reconciler.oci import OciClient
from reconciler.planner import Action, Step
from reconciler.registry_credentials import RegistryCredential, private_docker_config
from reconciler.registry_grants import NO_GRANTS, Granted, open_grants
from reconciler.releases import (
    DEFAULT_DRIFT,
    DRIFT_POLICIES,
    LABEL_MANAGED_BY,
    MANAGER,
    InstalledRelease,
    ownership_labels,
)
from reconciler.sealed_values import Opened, Opener, open_values
from reconciler.telemetry import Injection
from reconciler.telemetry.inject import ServiceInjection, compose_injection

__all__ = ["ENV_FILE", "OVERRIDE_FILE", "PS_FORMAT", "ComposeDriver", "Container",
           "ProjectFiles", "compose_commands", "container_healthy", "detect_compose_command",
           "env_file_text", "override_document", "parse_ps_output", "project_arguments",
           "project_files", "releases_from_ps"]

log = logging.getLogger("margo.device")

ENV_FILE = "margo.env"
OVERRIDE_FILE = "margo-override.yaml"
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PACKAGE_DIR = re.compile(r"[0-9a-f]{64}")
_PARTIAL_DIR = re.compile(r"\.[0-9a-f]{64}\.partial-[0-9a-f]+")
_FAILURE_CODES = {Action.INSTALL: ErrorCode.INSTALL_FAILED,
                  Action.REINSTALL: ErrorCode.INSTALL_FAILED,
                  Action.UPGRADE: ErrorCode.UPGRADE_FAILED,
                  Action.RECONFIGURE: ErrorCode.UPGRADE_FAILED,
                  Action.RECOVER: ErrorCode.UPGRADE_FAILED,
                  Action.REPAIR: ErrorCode.UPGRADE_FAILED,
                  Action.REMOVE: ErrorCode.UNINSTALL_FAILED}
_LOG_LINES = 20


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class _Prepared:
    """A step's project, ready for `up`: its files, the images the package names (for
    messages), and what the record of a successful `up` needs."""

    files: ProjectFiles
    images: list[str]
    labels: dict[str, str]
    compose: Mapping[str, Any]
    #: The opened sealed variables, for the process environment of every Compose call on
    #: this project (never written to a file).
    sealed_env: Mapping[str, str] = field(default_factory=dict)


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


def _checked_variable(name: str, value: Any) -> str:
    """`value` as an environment variable's text; `ValueError` (never quoting the value)
    for a name that is not a variable name or text no environment can hold."""
    if not _VARIABLE.fullmatch(name):
        raise ValueError(f"{name!r} is not an environment variable name")
    text = value if isinstance(value, str) else env_string(value)
    if "\x00" in text:
        raise ValueError(f"{name}: environment values cannot contain NUL characters")
    return text


def env_file_text(values: Mapping[str, Any]) -> str:
    """The `--env-file` for a component's environment, sorted by name.

    Raises `ValueError` for a name that is not an environment variable name and for values
    `margo.component_values.env_string` cannot render."""
    lines = ["# Written by margo-gitops from the deployment's parameters. Do not edit."]
    for name in sorted(values):
        lines.append(f"{name}={_dotenv_value(_checked_variable(name, values[name]))}")
    return "\n".join(lines) + "\n"


def override_document(services: Iterable[str], labels: Mapping[str, str],
                      injected: Iterable[ServiceInjection] = ()) -> dict[str, Any]:
    """A Compose override adding `labels` and the list of the package's services to every
    service (Compose merges label maps), so a container removed out of band is noticed, and
    the telemetry variables each service gets (`reconciler.telemetry.inject`: only those it
    does not set itself, so its own values win over ours although the override comes last)."""
    names = sorted(services)
    marked = {**labels, LABEL_SERVICES: ",".join(names)}
    extra = {entry.service: entry.override() for entry in injected}
    return {"services": {service: {"labels": dict(marked), **extra.get(service, {})}
                         for service in names}}


# --------------------------------------------------------------------------- commands


def project_arguments(project: str, *, compose: Sequence[str],
                      files: ProjectFiles) -> list[str]:
    """The Compose command line naming one project and its files, before the subcommand."""
    base = [*compose, "-p", project, "-f", str(files.compose_file),
            "-f", str(files.override_file)]
    if files.package_env_file is not None:
        base += ["--env-file", str(files.package_env_file)]
    return [*base, "--env-file", str(files.env_file)]


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
    base = project_arguments(project, compose=compose, files=files)
    up = [*base, "up", "-d", "--remove-orphans"]
    if step.desired.wait:
        up += ["--wait", "--wait-timeout", str(max(1, math.ceil(step.desired.timeout_seconds)))]
    return [[*base, "pull", "--policy", "missing", "--quiet"], up]


def _scaled_to_zero(compose: Mapping[str, Any]) -> frozenset[str]:
    """Services a Compose document runs no container of (`scale: 0` or `deploy.replicas:
    0`): `up` leaves them without one."""
    services = compose.get("services") or {}
    return frozenset(str(name) for name, service in services.items()
                     if isinstance(service, Mapping) and (service.get("scale") == 0 or (
                         service.get("deploy") or {}).get("replicas") == 0))


def image_registry(image: str) -> str:
    """The registry host of an image reference, as the Docker CLI reads it (a first
    component with a dot, a colon or `localhost` is a host; else Docker Hub)."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


# --------------------------------------------------------------------------- driver


class ComposeDriver:
    """Runs `compose` deployments with the Docker Compose CLI (see the module docstring).

    `compose`: `auto`, `plugin` or the path of a standalone Compose v2 binary.
    `docker_host` sets `DOCKER_HOST`; `env` is added to the CLI's environment.
    `credentials` are given to the engine for image pulls. `injection`: the telemetry
    variables every service gets in the override file (`reconciler.telemetry`).
    `grace_seconds` is added to a component's timeout before its `up` is killed
    (Compose's own `--wait-timeout` comes first); `command_timeout` bounds `pull`, `down`,
    `ps` and the probes. The caller owns `oci`."""

    name = "compose"
    profile_types: tuple[str, ...] = ("compose",)

    def __init__(self, work_dir: Path, oci: OciClient, *, docker: str = "docker",
                 compose: str = "auto", docker_host: str | None = None,
                 credentials: Sequence[RegistryCredential] = (),
                 env: Mapping[str, str] | None = None, grace_seconds: float = 30.0,
                 command_timeout: float = 120.0, drift: str = DEFAULT_DRIFT["compose"],
                 injection: Injection | None = None, key: Opener | None = None) -> None:
        if drift not in DRIFT_POLICIES:
            raise ValueError(f"drift must be one of {', '.join(DRIFT_POLICIES)}, not {drift!r}")
        self.work_dir = Path(work_dir)
        self.drift = drift
        self.injection = injection
        self.key = key  # opens sealed values (reconciler.encryption_key.DeviceKey)
        self._unreadable: set[Path] = set()  # records already warned about
        self._oci = oci
        self._docker = docker
        self._choice = compose
        self._compose: list[str] | None = None
        extra = dict(env or {})
        if docker_host:
            extra["DOCKER_HOST"] = docker_host
        self._env = {**os.environ, **extra}
        self._credentials = tuple(credentials)
        self._grace = grace_seconds
        self._command_timeout = command_timeout
        #: Per project, what its last `up` was given (for `confirm`).
        self._applied: dict[str, tuple[_Prepared, Opened]] = {}

    def close(self) -> None:
        """Nothing to release: every engine call is a short-lived process."""

    # ------------------------------------------------------------------ reading

    def installed(self) -> list[InstalledRelease]:
        """Every Compose project on the engine: ours, classified, and the others as
        `UNMANAGED` (so none of our components is ever brought up in their name)."""
        result = self._docker_run(["ps", "-a", "--no-trunc", "--filter", f"label={LABEL_PROJECT}",
                                   "--format", PS_FORMAT], unavailable="docker ps failed")
        try:
            containers = parse_ps_output(result.stdout)
        except ValueError as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE,
                             f"cannot read docker ps output: {exc}") from exc
        if self.drift == "off":
            return releases_from_ps(containers)
        return releases_with_drift(containers, self._records(), self.drift)

    def _records(self) -> dict[str, Applied]:
        """What was applied to each project (`compose_drift`). An unreadable record is said
        once in the log and left out: that project is judged by its containers' health
        until its next successful `up` writes the record again."""
        records: dict[str, Applied] = {}
        for path in sorted(self.work_dir.glob(f"*/{APPLIED_FILE}")):
            try:
                record = read_applied(path)
            except (OSError, ValueError) as exc:
                if path not in self._unreadable:
                    self._unreadable.add(path)
                    log.warning("ignoring %s: %s; the project's drift is not checked until "
                                "its next successful apply", path, exc)
                continue
            self._unreadable.discard(path)
            if record is not None:
                records[path.parent.name] = record
        return records

    def containers(self, project: str) -> list[Container]:
        """Every container of one of our projects, as the engine lists it."""
        result = self._docker_run(["ps", "-a", "--no-trunc", "--filter",
                                   f"label={LABEL_PROJECT}={project}", "--format", PS_FORMAT],
                                  unavailable="docker ps failed")
        return [c for c in parse_ps_output(result.stdout)
                if c.labels.get(LABEL_MANAGED_BY) == MANAGER]

    # ------------------------------------------------------------------ steps

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Carry out one planned step: `remove` is `down`; every other change (install,
        upgrade, reconfigure, `repair` of drift, and `reinstall`/`recover`, which Compose
        needs no special handling for: `up` converges whatever is there) is pull, then
        `up`."""
        if step.action is Action.UNCHANGED:
            return
        if step.action is Action.REMOVE:
            self._remove(step)
            return
        if step.action is Action.SKIP:
            raise ApplyError(ErrorCode.INSTALL_FAILED, step.reason, retryable=False)
        if deployment is None or step.desired is None:
            raise ValueError(f"{step.action} of {step.release_name} needs its deployment")
        opened = open_values(step.desired.values, self.key, component=step.desired.name)
        granted = open_grants(deployment.registry_grants, self.key, deployment=deployment.name)
        with opened.redacting(), granted.redacting():
            prepared = self._prepare(step, deployment, step.desired, opened, granted)
            files = prepared.files
            pull, up = compose_commands(step, compose=self._compose_command(), files=files)
            self._pull(pull, step, prepared, granted)
            (files.project_dir / APPLIED_FILE).unlink(missing_ok=True)  # only a good `up`
            self._stop_paused(step)
            self._compose_run(up, step, timeout=step.desired.timeout_seconds + self._grace,
                              extra=prepared.sealed_env, granted=granted)
        self._record(step, prepared)
        self._prune(files)
        self._applied[step.release_name] = (prepared, opened)

    def confirm(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Read the project back from the engine (`reconciler.drivers.readback`): after a
        removal, no container; after any other step, what `compose_engine.read_back`
        requires of the containers, against Compose's own config-hash of the files written
        (`config --hash`), so a container `up` did not create from them is noticed too."""
        what = f"Compose project {step.release_name} on the engine"
        containers = self.containers(step.release_name)
        if step.action is Action.REMOVE:
            require_match(what, {"containers": NOTHING},
                          {"containers": ", ".join(c.name for c in containers) or NOTHING})
            return
        applied = self._applied.pop(step.release_name, None)
        if applied is None or step.desired is None:
            raise ApplyError(ErrorCode.INVALID_STEP, f"{step.action} of {step.release_name}: "
                             "nothing was applied to confirm", retryable=False)
        prepared, opened = applied
        with opened.redacting():
            hashes = self._config_hashes(step, prepared.files, prepared.sealed_env)
        expected, found = read_back(containers, prepared.labels, hashes,
                                    wait=step.desired.wait, idle=_scaled_to_zero(
                                        prepared.compose))
        require_match(what, expected, found)

    def _config_hashes(self, step: Step, files: ProjectFiles,
                       extra: Mapping[str, str]) -> dict[str, str]:
        """Compose's config-hash of every service it starts from the project's files (and
        the sealed variables `extra`, as `up` had them)."""
        argv = [*project_arguments(step.release_name, compose=self._compose_command(),
                                   files=files), "config", "--hash", "*"]
        result = run_cli(argv, timeout=self._command_timeout, env={**self._env, **extra})
        if result.returncode != 0:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"{step.release_name}: docker "
                             f"compose config --hash failed: {tail(result.stderr)}")
        pairs = (line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
        return {service: digest.strip() for service, digest in pairs}

    def _stop_paused(self, step: Step) -> None:
        """Stop the project's paused containers, so that `up` starts them afresh: it refuses
        to start a paused container, and one merely unpaused keeps the health state it got
        while frozen (unhealthy), which `up --wait` takes for a failure."""
        paused = [c.id for c in self.containers(step.release_name) if c.state == "paused"]
        if paused:
            self._docker_run(["stop", *paused], unavailable=f"{step.action} of "
                             f"{step.release_name}: stopping its paused containers failed")

    def _record(self, step: Step, prepared: _Prepared) -> None:
        """Write what this successful `up` left (`compose_drift`). If the engine cannot be
        read just now, the step still succeeded: the project's drift is then not checked
        until its next apply."""
        try:
            containers = self.containers(step.release_name)
        except ApplyError as exc:
            log.warning("%s: cannot record what was applied (%s); its drift is not checked "
                        "until its next apply", step.release_name, exc.message)
            return
        write_applied(prepared.files.project_dir / APPLIED_FILE,
                      applied_record(containers, prepared.labels, prepared.compose))

    def _prepare(self, step: Step, deployment: DesiredDeployment, component: DesiredComponent,
                 opened: Opened, granted: Granted) -> _Prepared:
        """Pull (with the deployment's grants), verify, validate, extract (once per archive)
        and write our two files: the opened sealed variables (`opened.paths`) are left out
        of `margo.env`, for the process environment."""
        artifact = self._oci.pull(component.repository, component.revision,
                                  granted=granted.credentials)
        package = validate_package(artifact.data)
        files = project_files(self.work_dir, step.release_name, package.digest,
                              package_env=".env" in package.files)
        existed = files.package_dir.exists()
        restored = restore_extracted(package, files.package_dir)
        if existed and restored:
            log.warning("%s: the extracted package %s no longer matched the verified archive; "
                        "restored %s", step.release_name, files.package_dir, ", ".join(restored))
        labels = ownership_labels(deployment.deployment_id, component.name,
                                  desired_digest=deployment.digest,
                                  spec_digest=component.spec_digest,
                                  values_digest=component.values_digest)
        try:
            env_text = env_file_text({name: value for name, value in opened.values.items()
                                      if name not in opened.paths})
            sealed_env = {name: _checked_variable(name, opened.values[name])
                          for name in sorted(opened.paths)}
        except (TypeError, ValueError) as exc:
            raise ApplyError(ErrorCode.RENDER_FAILED, f"component {component.name!r}: {exc}",
                             retryable=False) from exc
        injected = compose_injection(package.compose, package.files, self.injection)
        override = yaml.safe_dump(override_document(package.services, labels, injected),
                                  sort_keys=True)
        write_atomically(files.env_file, env_text, mode=0o600)
        write_atomically(files.override_file, "# Written by margo-gitops. Do not edit.\n"
                         + override)
        images = sorted({str(service.get("image")) for service in
                         package.compose["services"].values()
                         if isinstance(service, dict) and service.get("image")})
        return _Prepared(files, images, labels, package.compose, sealed_env)

    def _remove(self, step: Step) -> None:
        for argv in compose_commands(step, compose=self._compose_command()):
            self._compose_run(argv, step, timeout=self._command_timeout)
        project_dir = self.work_dir / step.release_name
        if project_dir.is_dir():
            shutil.rmtree(project_dir)

    def _compose_command(self) -> list[str]:
        if self._compose is None:
            self._compose = detect_compose_command(
                self._docker, self._choice, env=self._env,
                standalone=shutil.which("docker-compose"), timeout=self._command_timeout)
        return self._compose

    @contextlib.contextmanager
    def _engine_env(self, extra: Mapping[str, str] | None = None,
                    granted: Granted = NO_GRANTS) -> Iterator[dict[str, str]]:
        """The CLI's environment for a call that may pull (with `extra`, the opened sealed
        variables, added): with credentials (the device's own, and those `granted` to the
        deployment), a private DOCKER_CONFIG that exists only for the call."""
        env = {**self._env, **(extra or {})}
        if not self._credentials and not granted.credentials:
            yield env
            return
        plugin = plugin_path(self._env)
        links = {"cli-plugins": plugin.parent} if plugin is not None else {}
        with private_docker_config(self._credentials, granted=granted.credentials,
                                   extra=links) as folder:
            yield {**env, "DOCKER_CONFIG": str(folder)}

    def _pull(self, argv: list[str], step: Step, prepared: _Prepared, granted: Granted) -> None:
        with self._engine_env(prepared.sealed_env, granted) as env:
            result = run_cli(argv, timeout=self._command_timeout, env=env)
        if result.returncode == 0:
            return
        if not self._daemon_reachable():
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"{step.action} of {step.release_name}: "
                             f"the engine is unreachable: {tail(result.stderr)}")
        hosts = sorted({image_registry(image) for image in prepared.images})
        configured = {c.registry for c in self._credentials}
        known = [f"{h} (credentials configured)" if h in configured else
                 f"{h} (credentials granted)" if h in granted.hosts else h for h in hosts]
        raise ApplyError(ErrorCode.PULL_FAILED, f"{step.action} of {step.release_name}: pulling "
                         f"{', '.join(prepared.images)} from {', '.join(known)} failed: "
                         f"{tail(result.stderr)}")

    def _compose_run(self, argv: list[str], step: Step, *, timeout: float,
                     extra: Mapping[str, str] | None = None,
                     granted: Granted = NO_GRANTS) -> None:
        with self._engine_env(extra, granted) as env:
            result = run_cli(argv, timeout=timeout, env=env)
        if result.returncode == 0:
            return
        message = f"{step.action} of {step.release_name}: docker compose exited with " \
                  f"{result.returncode}: {tail(result.stderr)}"
        if not self._daemon_reachable():
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, message)
        if step.action is not Action.REMOVE:
            message += self._failing_logs(step.release_name)
        raise ApplyError(_FAILURE_CODES[step.action], message)

    def _failing_logs(self, project: str) -> str:
        """The last log lines of each container of `project` that is not healthy."""
        try:
            failing = [c for c in self.containers(project) if not container_healthy(c)]
        except ApplyError:
            return ""
        parts = []
        for container in failing:
            logs = run_cli([self._docker, "logs", "--tail", str(_LOG_LINES), container.id],
                           timeout=self._command_timeout, env=self._env)
            text = (logs.stdout + logs.stderr).strip() if logs.returncode == 0 else ""
            parts.append(f"\n{describe(container)}; its last log lines:\n{tail(text, 1500)}"
                         if text else f"\n{describe(container)} (no log output)")
        return "".join(parts)

    def _docker_run(self, args: list[str], *, unavailable: str) -> Any:
        try:
            result = run_cli([self._docker, *args], timeout=self._command_timeout,
                             env=self._env)
        except ApplyError as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, exc.message) from exc
        if result.returncode != 0:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"{unavailable}: {tail(result.stderr)}")
        return result

    def _daemon_reachable(self) -> bool:
        """Whether `docker version` reaches the daemon: tells an engine outage from a
        failing project without matching error text."""
        argv = [self._docker, "version", "--format", "{{json .Server.Version}}"]
        try:
            return run_cli(argv, timeout=self._command_timeout, env=self._env).returncode == 0
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
