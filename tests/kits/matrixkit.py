"""Test kit: the device matrix of issue 28. The fleet's features run in every cell of
{device generation x source} x {driver} x {store}, with the real `margo device run` in its
own process, a real `margo serve` and real engines.

    device = new_device(PARTS.use(tmp_path_factory), cell, "lifecycle", tmp_path)
    device.start()                                  # margo device run, every second
    device.wait_settled(device.deploy())            # the read API: installed, reported since
    device.wait_workloads([Workload("1.0.0", "Hello")])   # what the engine really runs

The cells are data (`ROWS`, `DRIVERS`, `STORES`): a row is one line. `tests/matrix/`
parametrizes each feature module over `selected_cells()`; `KNOWN_DEFECTS` is the one place
where a (feature, row) pair is expected to fail.

The parts (registry, control plane, Docker engine, one server per store) are started on
first use in each test process and shared by its cells (`MatrixParts`); every device gets
its own client, application, chart or package repository, intent and namespace, so cells
sharing a server stay independent.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from kits.chartkit import publish_chart, write_chart
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    build_test_images,
    compose_package,
    running_engine,
    web_service,
)
from kits.fleetserver import FleetServer, capabilities
from kits.kubekit import DEVICE_RBAC, ControlPlane
from kits.matrixengines import ComposeView, EngineView, HelmView, RenderView, Workload
from kits.pkikit import make_self_signed, write_pem
from kits.registrykit import running_registry
from kits.serverkit import add_client, running_replicas, running_server, use_store
from reconciler.oci import OciClient
from tools.polling import poll_until

__all__ = ["CELLS", "DRIVERS", "KNOWN_DEFECTS", "PARTS", "QUICK", "ROWS",
           "STORES", "Cell", "Change", "FleetHost", "FreshnessNotReached", "MatrixDevice",
           "MatrixParts", "Row", "Workload", "cell_params", "devices", "new_device",
           "selected_cells"]

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# --- the cells ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """A kind of device: the API generation it speaks, where it reads its desired state
    and how it proves who it is (the `server:`, `source:` and `identity:` sections)."""

    name: str      # in test ids and device ids
    api: str       # server.api: rc.3 | rc.2 | oct-2024
    source: str    # source.type: margo-rest | git
    identity: str  # "token": a per-device client's bearer token (REST) or Git token; "rc2"
    title: str


ROWS: tuple[Row, ...] = (
    Row("rc3", "rc.3", "margo-rest", "token", "rc.3 API, margo-rest source, bearer token"),
    Row("rc2", "rc.2", "margo-rest", "rc2", "rc.2 API, margo-rest source, signed requests"),
    Row("oct2024", "oct-2024", "git", "token",
        "Oct-2024 API (Preview Release 1), git source, per-device token"),
)
DRIVERS: tuple[str, ...] = ("render", "helm", "compose")
#: sqlite: one `margo serve`; replicas: two on one PostgreSQL database behind the
#: round-robin test balancer (kits.serverkit, kits.balancer).
STORES: tuple[str, ...] = ("sqlite", "replicas")


@dataclass(frozen=True)
class Cell:
    row: Row
    driver: str
    store: str

    @property
    def id(self) -> str:
        return f"{self.row.name}-{self.driver}-{self.store}"

    def __str__(self) -> str:
        return self.id


CELLS: tuple[Cell, ...] = tuple(Cell(row, driver, store)
                                for row in ROWS for driver in DRIVERS for store in STORES)
#: The cells `make test` runs: every row on render, another row on each engine, and the
#: replica cell no other suite covers (rc.2 signatures through a per-request balancer);
#: `make matrix` (MARGO_MATRIX=full) runs all of CELLS. docs/matrix.md has the table.
QUICK: frozenset[str] = frozenset({
    "rc3-render-sqlite", "rc2-render-sqlite", "oct2024-render-sqlite",
    "rc3-helm-sqlite", "oct2024-compose-sqlite", "rc2-render-replicas"})

class FreshnessNotReached(AssertionError):
    """`MatrixDevice.wait_freshness` timed out: the one failure the freshness marks below
    expect (a device that never installed fails its test as usual)."""


#: Checks known to fail in some rows today, as (feature module, row name) -> a strict
#: xfail mark (raising `FreshnessNotReached` or another specific error), in this one place.
#: Delete a line when its fix lands: a fixed defect fails the run until its line goes.
#: (The freshness of rc.2 and Oct-2024 devices, issue 28's first defect, was the first.)
KNOWN_DEFECTS: dict[tuple[str, str], pytest.MarkDecorator] = {}

#: Cells on a machine-wide part run on one pytest-xdist worker, in the groups
#: tests/conftest.py (`_ONE_WORKER`) gives the tests of that part.
_ENGINE_GROUPS = {"helm": "kubernetes", "compose": "docker"}


def selected_cells() -> tuple[Cell, ...]:
    """Every cell with MARGO_MATRIX=full (`make matrix`), else the `QUICK` ones."""
    mode = os.environ.get("MARGO_MATRIX", "quick")
    if mode not in ("quick", "full"):
        raise ValueError(f"MARGO_MATRIX must be quick or full, not {mode!r}")
    return CELLS if mode == "full" else tuple(c for c in CELLS if c.id in QUICK)


def cell_params(feature: str,
                applies: Callable[[Cell], bool] | None = None) -> list[Any]:
    """The selected cells a feature runs in, as pytest params with their marks: the
    engine's worker group and the feature's known defects."""
    params = []
    for cell in selected_cells():
        if applies is not None and not applies(cell):
            continue
        marks = [pytest.mark.xdist_group(_ENGINE_GROUPS[cell.driver])] \
            if cell.driver in _ENGINE_GROUPS else []
        if (feature, cell.row.name) in KNOWN_DEFECTS:
            marks.append(KNOWN_DEFECTS[(feature, cell.row.name)])
        params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


# --- the shared parts -----------------------------------------------------------------------


@dataclass
class FleetHost:
    """One store's `margo serve` (one process, or two replicas behind the balancer) on a
    watched fleet source that starts empty; the devices add their own applications and
    intents."""

    store: str
    server: FleetServer
    http: httpx.Client

    @property
    def source(self) -> Path:
        assert self.server.source_dir is not None
        return self.server.source_dir

    def add_client(self, client_id: str) -> str:
        """Register a client (on this store's database) while the server runs; its token."""
        with use_store(self.store):
            return add_client(self.server.data_dir, client_id)

    def write_application(self, app_id: str, version: str, doc: dict[str, Any]) -> None:
        """`apps/<app>/<version>/margo.yaml`, written atomically: a new application version
        as a vendor publishes it (an intent without a version takes the newest)."""
        _write_atomically(self.source / "apps" / app_id / version / "margo.yaml",
                          yaml.safe_dump(doc, sort_keys=False))

    def remove_application(self, app_id: str) -> None:
        shutil.rmtree(self.source / "apps" / app_id, ignore_errors=True)

    def device_view(self, device_id: str) -> dict[str, Any] | None:
        """`GET /api/fleet/devices/{id}`; None while the server has not heard of it."""
        response = self.http.get(f"/api/fleet/devices/{device_id}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view


class MatrixParts:
    """The real parts cells share in one test process, each started on first use and all
    stopped by `close` (tests/matrix/conftest.py calls it after the last cell, so they
    never run beside the other suites' own registry, control plane or Docker engine)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._factory: pytest.TempPathFactory | None = None
        self._registry: str | None = None
        self._plane: ControlPlane | None = None
        self._docker: tuple[DockerEngine, ImageSet] | None = None
        self._hosts: dict[str, FleetHost] = {}

    def use(self, factory: pytest.TempPathFactory) -> MatrixParts:
        """Put what is started from now on under `factory`'s temporary directories."""
        self._factory = factory
        return self

    def _folder(self, name: str) -> Path:
        assert self._factory is not None, "MatrixParts.use(tmp_path_factory) first"
        return self._factory.mktemp(name)

    def registry(self) -> str:
        """`127.0.0.1:<port>` of a real OCI registry (Debian's docker-registry)."""
        if self._registry is None:
            self._registry = self._stack.enter_context(
                running_registry(self._folder("matrix-registry")))
        return self._registry

    def control_plane(self) -> ControlPlane:
        """The real control plane with the device's ServiceAccount and roles."""
        if self._plane is None:
            plane = self._stack.enter_context(ControlPlane(self._folder("matrix-kube")))
            with plane.admin() as admin:
                admin.apply_file(DEVICE_RBAC)
            self._plane = plane
        return self._plane

    def docker(self) -> tuple[DockerEngine, ImageSet]:
        """The private Docker engine, with the busybox test images in the registry."""
        if self._docker is None:
            engine = self._stack.enter_context(running_engine(self._folder("matrix-docker")))
            self._docker = engine, build_test_images(engine, self.registry())
        return self._docker

    def host(self, store: str) -> FleetHost:
        """The store's server on an empty, watched fleet source."""
        if store not in self._hosts:
            workdir = self._folder(f"matrix-{store}")
            fleet = workdir / "fleet"
            for folder in ("apps", "deployments"):
                (fleet / folder).mkdir(parents=True)
            self._hosts[store] = self._stack.enter_context(_fleet_host(store, workdir, fleet))
        return self._hosts[store]

    def start_for(self, cell: Cell) -> None:
        """Start what a device of `cell` needs, if it is not running yet."""
        self.host(cell.store)
        self.registry()
        if cell.driver == "helm":
            self.control_plane()
        elif cell.driver == "compose":
            self.docker()

    def close(self) -> None:
        """Stop everything started (servers first, the registry last)."""
        try:
            self._stack.close()
        finally:
            self._stack = contextlib.ExitStack()
            self._registry, self._plane, self._docker, self._hosts = None, None, None, {}


@contextlib.contextmanager
def _fleet_host(store: str, workdir: Path, fleet: Path) -> Iterator[FleetHost]:
    """`kits.fleetserver.fleet_server` on `store`, except that the replicas' balancer
    passes the devices' `Host` through: rc.2 signatures cover `@authority`, which a replica
    rebuilds from `Host` (kits.balancer), so a balancer that rewrites it (nginx's default)
    refuses every signed request with 401."""
    data = workdir / "data"
    args = ("--source", str(fleet), "--watch-source")
    with contextlib.ExitStack() as stack:
        with use_store(store):  # read by add_client and running_server as they start
            token = add_client(data, "operator")
            base = stack.enter_context(
                running_replicas(data, *args, preserve_host=True) if store == "replicas"
                else running_server(data, *args))
        http = stack.enter_context(httpx.Client(base_url=base, timeout=10))
        yield FleetHost(store, FleetServer(base=base, client_id="operator", token=token,
                                           source_dir=fleet, data_dir=data, _http=http), http)


#: The test process's parts (atexit: a run interrupted before conftest's hook still stops them).
PARTS = MatrixParts()
atexit.register(PARTS.close)


# --- a device of one cell ---------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """An operator's change: when it was made, and the digests of the device's deployments
    just before (a settled deployment must have moved on from them)."""

    at: float
    before: dict[str, str] = field(default_factory=dict)


#: Seconds a cell may take to settle after a change (installs wait for readiness).
SETTLE = 120.0


@dataclass
class MatrixDevice:
    """A device of one cell: its home (configuration, credentials, data, log), the real
    `margo device run` process, the operator's view of its application and intent, the
    server's read API about it and what its engine runs."""

    cell: Cell
    device_id: str
    home: Path
    host: FleetHost
    engine: EngineView
    parts: MatrixParts
    process: subprocess.Popen[bytes] | None = None
    versions: list[str] = field(default_factory=list)

    @property
    def app_id(self) -> str:
        return f"com-example-{self.device_id}"

    @property
    def intent(self) -> str:
        """The intent's name; also the namespace (Helm) the application runs in."""
        return self.device_id

    @property
    def config(self) -> Path:
        return self.home / "device.yaml"

    @property
    def log(self) -> Path:
        return self.home / "device.log"

    # --- the device client ------------------------------------------------------------------

    def start(self) -> None:
        """`margo device run` in its own process, its output in `device.log`."""
        assert self.process is None, "already running"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
                 str(self.config), "--log-level", "warning"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the client (SIGTERM: it finishes its step; SIGKILL: `kill`)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(sig)
                try:
                    self.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, size: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-size:] if self.log.exists() else ""

    # --- the operator -----------------------------------------------------------------------

    def deploy(self, greeting: str = "Hello", **spec: Any) -> Change:
        """Write the device's intent: its application, on the driver's profile type, with
        further `spec` keys when given (`gracePeriod`, `rollout`, `priority`, ...)."""
        change = self._change()
        self.host.server.edit_intent(self.intent, yaml.safe_dump({
            "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": self.intent},
            "spec": {"application": {"id": self.app_id},
                     "profile": {"type": "compose" if self.cell.driver == "compose"
                                 else "helm"},
                     "namespace": self.intent,
                     "parameters": {"greeting": greeting},
                     "targets": {"devices": [self.device_id]}, **spec}}, sort_keys=False))
        return change

    def reconfigure(self, greeting: str) -> Change:
        """Change the intent's greeting parameter (one line of the intent file)."""
        change = self._change()
        self.host.server.set_parameter(self.intent, "greeting", greeting)
        return change

    def publish(self, version: str) -> Change:
        """Push the application's package at `version` (a chart, or a Compose package whose
        image is another one) and add that application version to the fleet source."""
        change = self._change()
        repository = self._publish_package(version)
        self.host.write_application(self.app_id, version, self._description(version,
                                                                           repository))
        self.versions.append(version)
        return change

    def delete(self) -> Change:
        """Remove the device's intent from the fleet source."""
        change = self._change()
        self.host.server.remove_intent(self.intent)
        return change

    def _change(self) -> Change:
        return Change(time.time(), {d["deploymentId"]: d["digest"]
                                    for d in self.deployments()})

    def _publish_package(self, version: str) -> str:
        registry = self.parts.registry()
        if self.cell.driver == "compose":
            _, images = self.parts.docker()
            image = images.web_1 if len(self.versions) % 2 == 0 else images.web_2
            repository = f"oci://{registry}/matrix/{self.device_id}/web"
            service = web_service(image, environment={"GREETING": "${GREETING:-unset}",
                                                      "APP_VERSION": version})
            with OciClient() as oci:
                return compose_package(oci, repository, version, {"web": service})
        chart = write_chart(self.home / "charts", "greeter", version, deployment=True)
        return publish_chart(registry, chart, repo_path=f"matrix/{self.device_id}")

    def _description(self, version: str, repository: str) -> dict[str, Any]:
        """The application at `version`: one profile for the cell's driver (render and
        helm install a chart, compose a Compose package), a greeting parameter."""
        compose = self.cell.driver == "compose"
        component = "web" if compose else "greeter"
        return {
            "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription",
            "id": self.app_id,
            "metadata": {"name": f"Matrix {self.device_id}", "version": version,
                         "catalog": {"organization": [{"name": "Example Industries"}]}},
            "deploymentProfiles": [{
                "type": "compose" if compose else "helm", "id": f"{component}-profile",
                "components": [{"name": component, "properties": {
                    "repository": repository, "revision": version, "wait": True,
                    "timeout": "1m0s"}}],
                "deviceConstraints": {"capacityRequirements": {
                    "cpu": {"cores": 0.5}, "memory": "256Mi"}}}],
            "parameters": {"greeting": {"value": "Hello", "targets": [{
                "pointer": "GREETING" if compose else "config.greeting",
                "components": [component]}]}},
        }

    # --- the server's read API --------------------------------------------------------------

    def view(self) -> dict[str, Any] | None:
        return self.host.device_view(self.device_id)

    def deployments(self) -> list[dict[str, Any]]:
        """The device's deployments in the read API (its branch, each with its status)."""
        view = self.view()
        return list(view["deployments"]) if view else []

    def freshness(self) -> dict[str, Any] | None:
        view = self.view()
        return dict(view["freshness"]) if view else None

    def wait_settled(self, change: Change, count: int = 1,
                     state: str = "installed") -> list[dict[str, Any]]:
        """Until the read API lists `count` deployments of the device, each compiled anew
        since `change` (another digest), in `state`, by a report received after it."""
        def settled() -> list[dict[str, Any]] | None:
            deployments = self.deployments()
            ok = len(deployments) == count and all(
                d["state"] == state and change.before.get(d["deploymentId"]) != d["digest"]
                and d["statusHistory"] and d["statusHistory"][0]["state"] == state
                and d["statusHistory"][0]["reportedAt"] >= change.at for d in deployments)
            return deployments if ok else None

        return self._wait(f"{count} deployment(s) {state} since the change", settled,
                          lambda: _summary(self.deployments()))

    def wait_removed(self) -> None:
        """Until the read API lists no deployment of the device (the compile took it off
        the device's branch)."""
        self._wait("no deployment left", lambda: self.view() is not None
                   and not self.deployments(), lambda: _summary(self.deployments()))

    def wait_freshness(self, state: str, timeout: float = 5.0) -> dict[str, Any]:
        """Until the read API's `freshness.state` is `state` (callers wait for the reports
        first: the freshness follows from what is stored, so `timeout` is short)."""
        return self._wait(f"freshness {state}", lambda: (
            (found := self.freshness()) is not None and found["state"] == state and found),
            lambda: f"freshness {self.freshness()}; {_summary(self.deployments())}",
            timeout=timeout, error=FreshnessNotReached)

    # --- the engine -------------------------------------------------------------------------

    def workloads(self) -> list[Workload]:
        return self.engine.workloads()

    def wait_workloads(self, expected: list[Workload]) -> list[Workload]:
        """Until the engine runs exactly `expected` (sorted); what it runs then."""
        want = sorted(expected)
        found = self._wait(f"the engine running {want}",
                           lambda: (runs := self.workloads()) == want and (runs,),
                           lambda: f"the engine runs {self.workloads()!r}")
        return found[0]

    # --- helpers ----------------------------------------------------------------------------

    def _wait(self, what: str, predicate: Callable[[], T], describe: Callable[[], str],
              timeout: float = SETTLE, error: type[AssertionError] = AssertionError) -> T:
        """Poll with a deadline; fail (`error`) naming what was last seen and the client's
        log, or at once if the client exited."""
        def check() -> T:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.device_id}: the device client exited "
                                     f"({self.process.returncode}) while waiting for {what}:\n"
                                     f"{self.log_tail()}")
            return predicate()

        try:
            return poll_until(f"{self.device_id}: {what}", check, timeout=timeout,
                              interval=0.2, describe=describe)
        except TimeoutError as exc:
            raise error(f"{exc}\ndevice log:\n{self.log_tail()}") from None

    def close(self) -> None:
        """Stop the client, take the device's intent and application out of the fleet
        source and its workloads out of the engine."""
        try:
            self.stop()
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.host.server.remove_intent(self.intent)
            self.host.remove_application(self.app_id)
            self.engine.close()


def _summary(deployments: list[dict[str, Any]]) -> str:
    """The read API's deployments in one line each, for failure messages."""
    return "deployments: " + (", ".join(
        f"{d['deploymentId'][:8]} {d['state']} digest {d['digest'][:19]} "
        f"history {[(h['state'], round(h['reportedAt'], 2)) for h in d['statusHistory'][:3]]}"
        for d in deployments) or "none")


def _write_atomically(path: Path, text: str) -> None:
    """Write aside, then rename: the server's source watcher never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def new_device(parts: MatrixParts, cell: Cell, feature: str, workdir: Path,
               name: str = "") -> MatrixDevice:
    """A device of `cell` for one test of `feature` (id `<feature>[-<name>]-<cell>`): its
    credentials, engine, configuration and application version 1.0.0, published but not
    yet deployed (`deploy`); the client is not started yet (`start`)."""
    device_id = "-".join(part for part in (feature, name, cell.id) if part)
    home = workdir / device_id
    home.mkdir(parents=True)
    host = parts.host(cell.store)
    device = MatrixDevice(cell, device_id, home, host, _engine(parts, cell, home, device_id),
                          parts)
    try:
        config = {
            "device": {"id": device_id},
            "server": {"url": host.server.base, "api": cell.row.api, "timeout": "5s",
                       **_credentials(host, cell.row, home, device_id)},
            "source": {"type": cell.row.source},
            "driver": device.engine.driver(),
            "dataDir": "data",
            "capabilities": device.engine.capabilities(),
            "schedule": {"interval": "1s"}}
        if cell.row.identity == "rc2":
            config["identity"] = {"rc2": {"key": "device.key",
                                          "certificate": "device-cert.pem"}}
        device.config.write_text(yaml.safe_dump(config, sort_keys=False))
        device.publish("1.0.0")
    except BaseException:
        device.close()
        raise
    return device


def _engine(parts: MatrixParts, cell: Cell, home: Path, device_id: str) -> EngineView:
    if cell.driver == "helm":
        return HelmView(parts.control_plane(), home, namespace=device_id)
    if cell.driver == "compose":
        engine, _ = parts.docker()
        return ComposeView(engine, home, capabilities("compose-box-amd64", device_id))
    return RenderView(home, device_id, capabilities("k8s-single-amd64", device_id))


def _credentials(host: FleetHost, row: Row, home: Path, device_id: str) -> dict[str, str]:
    """The `server:` credentials of a row: a client of its own with a token file (bearer
    token, or the Git source's basic auth), or none for rc.2, whose key and self-signed
    certificate (written here) onboard it on the first start."""
    if row.identity == "rc2":
        key, cert = make_self_signed("ec-p256", common_name=device_id)
        write_pem(home / "device.key", key)
        write_pem(home / "device-cert.pem", cert)
        return {}
    (home / "token").write_text(host.add_client(device_id))
    return {"clientId": device_id, "tokenFile": "token"}


@contextlib.contextmanager
def devices(parts: MatrixParts, cell: Cell, feature: str,
            workdir: Path) -> Iterator[Callable[..., MatrixDevice]]:
    """A factory of devices of `cell` (`make(name="")`), each closed when the block ends."""
    made: list[MatrixDevice] = []

    def make(name: str = "") -> MatrixDevice:
        device = new_device(parts, cell, feature, workdir, name)
        made.append(device)
        return device

    try:
        yield make
    finally:
        with contextlib.ExitStack() as stack:
            for device in made:
                stack.callback(device.close)
