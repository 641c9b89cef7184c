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

A staged rollout needs several devices: a mixed fleet (`Mix`, `MixedFleet`,
`mixed_fleets`) is one device of every row on one driver and store, each on an engine of
its own (control plane and Docker engine "slots" of `MatrixParts`), sharing one
`Application` and intent.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
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

__all__ = ["CELLS", "DEFAULT_CONSTRAINTS", "DRIVERS", "GPU_DEPLOYMENT", "GPU_NODE_CONSTRAINTS",
           "KNOWN_DEFECTS", "MIXES", "PARTS", "QUICK", "QUICK_MIXES", "ROWS", "STORES",
           "Application", "Cell", "Change", "FleetHost", "FreshnessNotReached",
           "MatrixDevice", "MatrixParts", "Mix", "MixedFleet", "Row", "Workload", "capacity",
           "cell_params", "devices", "mix_params", "mixed_fleets", "new_device",
           "selected_cells"]

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
#: Seconds a cell may take to settle after a change (installs wait for readiness).
SETTLE = 120.0

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


def _full() -> bool:
    mode = os.environ.get("MARGO_MATRIX", "quick")
    if mode not in ("quick", "full"):
        raise ValueError(f"MARGO_MATRIX must be quick or full, not {mode!r}")
    return mode == "full"


def selected_cells(quick: Collection[str] | None = None) -> tuple[Cell, ...]:
    """Every cell with MARGO_MATRIX=full (`make matrix`), else the `QUICK` ones (or those
    of `quick`: a feature module's own, smaller share of `make test`)."""
    chosen = QUICK if quick is None else quick
    return CELLS if _full() else tuple(c for c in CELLS if c.id in chosen)


def cell_params(feature: str, applies: Callable[[Cell], bool] | None = None,
                quick: Collection[str] | None = None) -> list[Any]:
    """The selected cells a feature runs in, as pytest params with their marks: the
    engine's worker group and the feature's known defects. `quick`: the cells the feature
    runs in `make test` (default `QUICK`)."""
    params = []
    for cell in selected_cells(quick):
        if applies is not None and not applies(cell):
            continue
        marks = [pytest.mark.xdist_group(_ENGINE_GROUPS[cell.driver])] \
            if cell.driver in _ENGINE_GROUPS else []
        if (feature, cell.row.name) in KNOWN_DEFECTS:
            marks.append(KNOWN_DEFECTS[(feature, cell.row.name)])
        params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


@dataclass(frozen=True)
class Mix:
    """A mixed fleet's column: one device of every row (`ROWS`) on one driver and store,
    sharing one application and intent (a staged rollout needs several devices)."""

    driver: str
    store: str

    @property
    def id(self) -> str:
        return f"{self.driver}-{self.store}"

    @property
    def cells(self) -> tuple[Cell, ...]:
        return tuple(Cell(row, self.driver, self.store) for row in ROWS)

    def __str__(self) -> str:
        return self.id


MIXES: tuple[Mix, ...] = tuple(Mix(driver, store) for driver in DRIVERS for store in STORES)
#: The mixed fleets `make test` runs (`make matrix`: all of MIXES).
QUICK_MIXES: frozenset[str] = frozenset({"render-sqlite"})


def mix_params(feature: str, quick: Collection[str] | None = None) -> list[Any]:
    """The selected mixed fleets a feature runs on, as pytest params with the engine's
    worker group and the feature's known defects (keyed by (feature, "mixed"))."""
    chosen = QUICK_MIXES if quick is None else quick
    params = []
    for mix in MIXES:
        if not _full() and mix.id not in chosen:
            continue
        marks = [pytest.mark.xdist_group(_ENGINE_GROUPS[mix.driver])] \
            if mix.driver in _ENGINE_GROUPS else []
        if (feature, "mixed") in KNOWN_DEFECTS:
            marks.append(KNOWN_DEFECTS[(feature, "mixed")])
        params.append(pytest.param(mix, id=mix.id, marks=marks))
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

    def compiled_at(self) -> float:
        """When the server's last compile finished (`GET /api/fleet/source`, `checkedAt`;
        stored with the fleet state, so every replica answers the same); 0 before any."""
        response = self.http.get("/api/fleet/source")
        assert response.status_code == 200, response.text
        return float(response.json().get("checkedAt") or 0.0)

    def wait_compiled(self, since: float, timeout: float = SETTLE) -> float:
        """Until a compile has finished after `since` (a server time, e.g. a report's
        `reportedAt`); when it did."""
        return poll_until(f"a compile after {since:.2f}",
                          lambda: (at := self.compiled_at()) > since and at,
                          timeout=timeout, interval=0.2,
                          describe=lambda: f"the last compile finished at {self.compiled_at()}")

    def rollout(self, intent: str) -> dict[str, Any] | None:
        """`GET /api/fleet/rollouts/{intent}`; None while the intent has none."""
        response = self.http.get(f"/api/fleet/rollouts/{intent}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        found: dict[str, Any] = response.json()
        return found

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`margo <args> --url <this server>` (explain, rollout, status ...), as an operator
        runs it; fails the test unless it exits 0."""
        done = subprocess.run([sys.executable, "-m", "margo_cli.main", *args,
                               "--url", self.server.base], capture_output=True, text=True,
                              cwd=ROOT, timeout=120, check=False)
        assert done.returncode == 0, f"margo {' '.join(args)}: {done.stderr}"
        return done

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
        self._directory: Path | None = None
        self._registry: str | None = None
        self._planes: dict[int, ControlPlane] = {}
        self._engines: dict[int, DockerEngine] = {}
        self._images: ImageSet | None = None
        self._hosts: dict[str, FleetHost] = {}

    def use(self, factory: pytest.TempPathFactory) -> MatrixParts:
        """Put what is started from now on under `factory`'s temporary directories."""
        self._factory = factory
        return self

    def use_directory(self, directory: Path) -> MatrixParts:
        """Put what is started from now on under `directory` (outside pytest: bench/)."""
        self._factory, self._directory = None, directory
        return self

    def _folder(self, name: str) -> Path:
        if self._factory is None and self._directory is not None:
            return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._directory))
        assert self._factory is not None, "MatrixParts.use(tmp_path_factory) first"
        return self._factory.mktemp(name)

    def registry(self) -> str:
        """`127.0.0.1:<port>` of a real OCI registry (Debian's docker-registry)."""
        if self._registry is None:
            self._registry = self._stack.enter_context(
                running_registry(self._folder("matrix-registry")))
        return self._registry

    def control_plane(self, slot: int = 0) -> ControlPlane:
        """A real control plane with the device's ServiceAccount and roles. Slot 0 is the
        one every cell uses; a mixed fleet gives each of its devices a cluster of its own
        (slots 1, 2): two devices on one cluster would each remove the other's releases,
        as a cluster is one device."""
        if slot not in self._planes:
            plane = self._stack.enter_context(ControlPlane(self._folder(f"matrix-kube{slot}")))
            with plane.admin() as admin:
                admin.apply_file(DEVICE_RBAC)
            self._planes[slot] = plane
        return self._planes[slot]

    def docker(self, slot: int = 0) -> tuple[DockerEngine, ImageSet]:
        """A private Docker engine (slot 0: every cell's; a mixed fleet's other devices get
        their own, for the reason `control_plane` gives), with the busybox test images in
        the registry (built once, on slot 0's engine; the others pull them)."""
        if 0 not in self._engines:
            engine = self._stack.enter_context(running_engine(self._folder("matrix-docker")))
            self._images = build_test_images(engine, self.registry())
            self._engines[0] = engine
        if slot not in self._engines:
            self._engines[slot] = self._stack.enter_context(
                running_engine(self._folder(f"matrix-docker{slot}")))
        assert self._images is not None
        return self._engines[slot], self._images

    def host(self, store: str) -> FleetHost:
        """The store's server on an empty, watched fleet source."""
        if store not in self._hosts:
            workdir = self._folder(f"matrix-{store}")
            fleet = workdir / "fleet"
            for folder in ("apps", "deployments"):
                (fleet / folder).mkdir(parents=True)
            self._hosts[store] = self._stack.enter_context(_fleet_host(store, workdir, fleet))
        return self._hosts[store]

    def start_for(self, cell: Cell, slot: int = 0) -> None:
        """Start what a device of `cell` needs (on engine `slot`), if it is not running."""
        self.host(cell.store)
        self.registry()
        if cell.driver == "helm":
            self.control_plane(slot)
        elif cell.driver == "compose":
            self.docker(slot)

    def start_for_mix(self, mix: Mix) -> None:
        """Start what a mixed fleet needs: one engine (or cluster) per row."""
        for slot, cell in enumerate(mix.cells):
            self.start_for(cell, slot)

    def close(self) -> None:
        """Stop everything started (servers first, the registry last)."""
        try:
            self._stack.close()
        finally:
            self._stack = contextlib.ExitStack()
            self._registry, self._images, self._hosts = None, None, {}
            self._planes, self._engines = {}, {}


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


def capacity(cores: float, memory: str = "256Mi", **clauses: Any) -> dict[str, Any]:
    """A profile's `deviceConstraints`: `cores` and `memory`, plus further clauses
    (`eligibilityRules`, `x-margo-gitops-extensions`, ...)."""
    return {"capacityRequirements": {"cpu": {"cores": cores}, "memory": memory}, **clauses}


#: What every matrix application's profile requires unless a test says otherwise.
DEFAULT_CONSTRAINTS = capacity(0.5)

#: A chart Deployment whose pod requests a GPU (extended resources go in limits), for
#: the Helm cells' GPU application (`templates={"deployment.yaml": GPU_DEPLOYMENT}`).
GPU_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: 1
  selector:
    matchLabels: {app.kubernetes.io/instance: {{ .Release.Name }}}
  template:
    metadata:
      labels: {app.kubernetes.io/instance: {{ .Release.Name }}}
    spec:
      containers:
        - name: app
          image: registry.example.com/greeter:{{ .Chart.Version }}
          resources:
            requests: {cpu: 50m}
            limits: {nvidia.com/gpu: 1}
"""
#: Its profile: half a core, and a node with a GPU available: the documented cluster clause
#: (docs/kubernetes.md, docs/intents.md "Requirements on Kubernetes clusters").
GPU_NODE_CONSTRAINTS = capacity(0.5, **{"x-margo-gitops-extensions": {"cluster": {"nodes": [
    {"capacity": {"resources": {"nvidia.com/gpu": 1}}}]}}})

#: A ConfigMap the API server refuses (its name is not a lowercase DNS subdomain): a Helm
#: upgrade to a chart holding it renders, starts applying and fails, and the release's
#: newest revision is `failed`.
REFUSED_OBJECT = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-Refused
data: {}
"""


@dataclass
class Application:
    """One application and its intent in a store's fleet source, as the operator and the
    vendor handle them: versions published to the registry (a chart, or a Compose package)
    and added to the source, the intent written, edited and removed. A cell's device has
    one of its own (`MatrixDevice.deploy`, ...); `MatrixDevice.application(name)` gives it
    another, and a mixed fleet's devices share one (`targets` lists them)."""

    host: FleetHost
    parts: MatrixParts
    driver: str
    app_id: str
    intent: str
    namespace: str
    targets: list[str]
    charts: Path                 # where its charts are written
    repo_path: str               # its packages' path in the registry
    versions: list[str] = field(default_factory=list)
    #: version -> (package repository, the profile's deviceConstraints)
    published: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    constraints: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONSTRAINTS))

    @property
    def compose(self) -> bool:
        return self.driver == "compose"

    def deploy(self, greeting: str = "Hello", **spec: Any) -> None:
        """Write the intent: the application, on the driver's profile type, in its
        namespace, for its targets, with further `spec` keys (`gracePeriod`, `rollout`,
        `priority`, ...)."""
        self.host.server.edit_intent(self.intent, yaml.safe_dump({
            "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": self.intent},
            "spec": {"application": {"id": self.app_id},
                     "profile": {"type": "compose" if self.compose else "helm"},
                     "namespace": self.namespace,
                     "parameters": {"greeting": greeting},
                     "targets": {"devices": list(self.targets)}, **spec}}, sort_keys=False))

    def reconfigure(self, greeting: str) -> None:
        self.host.server.set_parameter(self.intent, "greeting", greeting)

    def publish(self, version: str, *, constraints: dict[str, Any] | None = None,
                failing: bool = False, templates: dict[str, str] | None = None) -> None:
        """Push the package at `version` and add that application version to the source.
        `constraints`: its profile's deviceConstraints (default: those of the last one
        published). `failing`: a revision that fails on the engine: on render a template
        that does not render, on Helm an object the API server refuses, on Compose a
        service that exits during start-up. `templates`: chart templates to add or
        replace (name -> text)."""
        if constraints is not None:
            self.constraints = constraints
        repository = self._publish_package(version, failing, templates or {})
        self.published[version] = (repository, self.constraints)
        self.host.write_application(self.app_id, version,
                                    self.description(version, repository, self.constraints))
        self.versions.append(version)

    def set_constraints(self, constraints: dict[str, Any], version: str | None = None) -> None:
        """Rewrite the description of `version` (default the newest) with other
        deviceConstraints: the same package, only the profile's requirements differ."""
        version = version or self.versions[-1]
        repository, _ = self.published[version]
        self.constraints = constraints
        self.published[version] = (repository, constraints)
        self.host.write_application(self.app_id, version,
                                    self.description(version, repository, constraints))

    def delete(self) -> None:
        """Remove the intent from the fleet source."""
        self.host.server.remove_intent(self.intent)

    def remove(self) -> None:
        """Take the intent (if still there) and the application out of the fleet source."""
        with contextlib.suppress(FileNotFoundError):
            self.host.server.remove_intent(self.intent)
        self.host.remove_application(self.app_id)

    def _publish_package(self, version: str, failing: bool,
                         templates: dict[str, str]) -> str:
        registry = self.parts.registry()
        if self.compose:
            _, images = self.parts.docker()
            image = images.web_1 if len(self.versions) % 2 == 0 else images.web_2
            repository = f"oci://{registry}/{self.repo_path}/web"
            services: dict[str, Any] = {"web": web_service(
                image, environment={"GREETING": "${GREETING:-unset}", "APP_VERSION": version})}
            if failing:  # exits 3 during start-up: `up --wait` fails
                services["migrate"] = {"image": images.crash, "depends_on": []}
            with OciClient() as oci:
                return compose_package(oci, repository, version, services)
        chart = write_chart(self.charts, "greeter", version, deployment=True,
                            broken=failing and self.driver == "render")
        if failing and self.driver == "helm":
            (chart / "templates" / "refused.yaml").write_text(REFUSED_OBJECT)
        for name, text in templates.items():
            (chart / "templates" / name).write_text(text)
        return publish_chart(registry, chart, repo_path=self.repo_path)

    def description(self, version: str, repository: str,
                    constraints: dict[str, Any]) -> dict[str, Any]:
        """The application at `version`: one profile for the driver (render and helm
        install a chart, compose a Compose package), a greeting parameter."""
        component = "web" if self.compose else "greeter"
        return {
            "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription",
            "id": self.app_id,
            "metadata": {"name": f"Matrix {self.app_id.removeprefix('com-example-')}",
                         "version": version,
                         "catalog": {"organization": [{"name": "Example Industries"}]}},
            "deploymentProfiles": [{
                "type": "compose" if self.compose else "helm", "id": f"{component}-profile",
                "components": [{"name": component, "properties": {
                    "repository": repository, "revision": version, "wait": True,
                    "timeout": "1m0s"}}],
                "deviceConstraints": constraints}],
            "parameters": {"greeting": {"value": "Hello", "targets": [{
                "pointer": "GREETING" if self.compose else "config.greeting",
                "components": [component]}]}},
        }


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
    #: The device's applications: "" its own (`deploy`, `publish`, ...), others by name.
    apps: dict[str, Application] = field(default_factory=dict)

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

    def start(self, *, cycles: bool = False) -> None:
        """`margo device run` in its own process, its output in `device.log`; with `cycles`,
        also one JSON line per cycle (`--json`), which `cycles()` reads back."""
        assert self.process is None, "already running"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
                 str(self.config), "--log-level", "warning", *(("--json",) if cycles else ())],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def cycles(self) -> list[dict[str, Any]]:
        """The cycles the client has finished (started with `cycles=True`), in order."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(json.loads(line))
        return found

    def wait_cycles(self, count: int, since: int = 0) -> list[dict[str, Any]]:
        """Until the client has finished `count` cycles after the first `since`; all of
        its cycles then."""
        def enough() -> list[dict[str, Any]] | None:
            found = self.cycles()
            return found if len(found) >= since + count else None

        return self._wait(f"{count} more cycle(s) of the client after {since}", enough,
                          lambda: f"{len(self.cycles())} cycle(s) so far")

    def wait_quiet_cycle(self) -> int:
        """Until the client's latest cycle took no step and converged (what came before it
        is over); how many cycles it has finished then."""
        def quiet() -> int | None:
            found = self.cycles()
            return len(found) if found and not found[-1]["steps"] and \
                found[-1]["converged"] else None

        return self._wait("a cycle with no step", quiet,
                          lambda: f"the last cycles: {self.cycles()[-3:]}")

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

    def application(self, name: str = "") -> Application:
        """The device's own application ("") or another one of the device (`name`: its id
        and intent get `-<name>`); all of a device's applications run in the namespace of
        its own intent, so that its engine view sees them."""
        if name not in self.apps:
            suffix = f"-{name}" if name else ""
            self.apps[name] = Application(
                self.host, self.parts, self.cell.driver, self.app_id + suffix,
                self.intent + suffix, self.intent, [self.device_id],
                self.home / "charts" / name if name else self.home / "charts",
                f"matrix/{self.device_id}{suffix}",
                versions=self.versions if not name else [])
        return self.apps[name]

    def deploy(self, greeting: str = "Hello", **spec: Any) -> Change:
        """Write the device's intent: its application, on the driver's profile type, with
        further `spec` keys when given (`gracePeriod`, `rollout`, `priority`, ...)."""
        change = self._change()
        self.application().deploy(greeting, **spec)
        return change

    def reconfigure(self, greeting: str) -> Change:
        """Change the intent's greeting parameter (one line of the intent file)."""
        change = self._change()
        self.application().reconfigure(greeting)
        return change

    def publish(self, version: str, **options: Any) -> Change:
        """Push the application's package at `version` (a chart, or a Compose package whose
        image is another one) and add that application version to the fleet source;
        `options` as `Application.publish` takes them (constraints, failing, templates)."""
        change = self._change()
        self.application().publish(version, **options)
        return change

    def set_constraints(self, constraints: dict[str, Any]) -> Change:
        """Rewrite the newest version's profile with other deviceConstraints only."""
        change = self._change()
        self.application().set_constraints(constraints)
        return change

    def delete(self) -> Change:
        """Remove the device's intent from the fleet source."""
        change = self._change()
        self.application().delete()
        return change

    def change(self) -> Change:
        """A `Change` as of now, for a change made otherwise (capabilities, a second
        application): take it before acting."""
        return self._change()

    def _change(self) -> Change:
        return Change(time.time(), {d["deploymentId"]: d["digest"]
                                    for d in self.deployments()})

    # --- the server's read API --------------------------------------------------------------

    def view(self) -> dict[str, Any] | None:
        return self.host.device_view(self.device_id)

    def deployments(self) -> list[dict[str, Any]]:
        """The device's deployments in the read API (its branch, each with its status)."""
        view = self.view()
        return list(view["deployments"]) if view else []

    def deployment(self, intent: str) -> dict[str, Any] | None:
        """The read API's deployment of `intent` on this device, if its branch holds one."""
        return next((d for d in self.deployments() if d["intent"] == intent), None)

    def eligibility(self, intent: str) -> dict[str, Any] | None:
        """The read API's explanation of `intent` on this device (`eligibility`)."""
        view = self.view()
        return next((e for e in view["eligibility"] if e["intent"] == intent), None) \
            if view else None

    def wait_deployment(self, intent: str, change: Change,
                        state: str = "installed") -> dict[str, Any]:
        """Until the deployment of `intent` (one of several on the device) is compiled anew
        since `change`, in `state`, by a report received after it about its current
        bytes."""
        def settled() -> dict[str, Any] | None:
            found = self.deployment(intent)
            ok = (found is not None and found["state"] == state
                  and change.before.get(found["deploymentId"]) != found["digest"]
                  and found["applied"]["current"] and found["statusHistory"]
                  and found["statusHistory"][0]["state"] == state
                  and found["statusHistory"][0]["reportedAt"] >= change.at)
            return found if ok else None

        return self._wait(f"{intent} {state} since the change", settled,
                          lambda: _summary(self.deployments()))

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

    def wait_until(self, what: str, predicate: Callable[[], T],
                   describe: Callable[[], str] | None = None, timeout: float = SETTLE) -> T:
        """Poll `predicate` until truthy (its value) with the cell's deadline; fail naming
        `what`, what `describe` says was last seen, and the client's log."""
        return self._wait(what, predicate, describe or (lambda: _summary(self.deployments())),
                          timeout=timeout)

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
            with contextlib.ExitStack() as stack:
                stack.callback(self.engine.close)
                self.application()  # its files may exist even if it was never deployed
                for app in self.apps.values():
                    stack.callback(app.remove)


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
               name: str = "", *, slot: int = 0, namespace: str | None = None,
               first_version: str | None = "1.0.0", **first: Any) -> MatrixDevice:
    """A device of `cell` for one test of `feature` (id `<feature>[-<name>]-<cell>`): its
    credentials, engine, configuration and application version 1.0.0, published but not
    yet deployed (`deploy`); the client is not started yet (`start`).

    `first`: options of that first version (`Application.publish`: constraints,
    templates); `first_version=None` publishes none (a mixed fleet's devices share an
    application). `slot`: which control plane or Docker engine (`MatrixParts`);
    `namespace`: the one its engine view reads (default the device's own intent's)."""
    device_id = "-".join(part for part in (feature, name, cell.id) if part)
    home = workdir / device_id
    home.mkdir(parents=True)
    host = parts.host(cell.store)
    device = MatrixDevice(cell, device_id, home, host,
                          _engine(parts, cell, home, device_id, slot, namespace or device_id),
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
        if first_version is not None:
            device.publish(first_version, **first)
    except BaseException:
        device.close()
        raise
    return device


def _engine(parts: MatrixParts, cell: Cell, home: Path, device_id: str, slot: int = 0,
            namespace: str | None = None) -> EngineView:
    if cell.driver == "helm":
        return HelmView(parts.control_plane(slot), home, namespace=namespace or device_id)
    if cell.driver == "compose":
        engine, _ = parts.docker(slot)
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
    """A factory of devices of `cell` (`make(name="", **new_device options)`), each closed
    when the block ends."""
    made: list[MatrixDevice] = []

    def make(name: str = "", **options: Any) -> MatrixDevice:
        device = new_device(parts, cell, feature, workdir, name, **options)
        made.append(device)
        return device

    try:
        yield make
    finally:
        with contextlib.ExitStack() as stack:
            for device in made:
                stack.callback(device.close)


# --- a mixed fleet -----------------------------------------------------------------------------


@dataclass
class MixedFleet:
    """One device of every row on one driver and store, sharing one application and intent
    (`app`): what a staged rollout needs. Each device has an engine of its own (render: its
    own directory; Helm: a control plane each; Compose: a Docker engine each), since two
    devices on one cluster or engine would each remove the other's releases."""

    mix: Mix
    app: Application
    devices: dict[str, MatrixDevice]  # row name -> device

    def changes(self) -> dict[str, Change]:
        """Each device's `Change` as of now (take it before acting)."""
        return {row: device.change() for row, device in self.devices.items()}

    def start(self, *, cycles: bool = False) -> None:
        """Start every device's client (`MatrixDevice.start`)."""
        for device in self.devices.values():
            device.start(cycles=cycles)

    def wait_settled(self, changes: dict[str, Change]) -> dict[str, dict[str, Any]]:
        """Every device's one deployment settled since its change (`wait_settled`)."""
        return {row: device.wait_settled(changes[row])[0]
                for row, device in self.devices.items()}

    def wait_workloads(self, expected: list[Workload]) -> None:
        for device in self.devices.values():
            device.wait_workloads(expected)


@contextlib.contextmanager
def mixed_fleets(parts: MatrixParts, mix: Mix, feature: str,
                 workdir: Path) -> Iterator[Callable[..., MixedFleet]]:
    """A factory of mixed fleets of `mix` (`make(name="")`): the devices (clients not
    started) and the shared application at version 1.0.0, not deployed yet; each fleet's
    devices are closed and its application removed when the block ends."""
    made: list[MixedFleet] = []

    def make(name: str = "") -> MixedFleet:
        label = "-".join(part for part in (feature, name, mix.id) if part)
        host = parts.host(mix.store)
        app = Application(host, parts, mix.driver, f"com-example-{label}", label, label, [],
                          workdir / label / "charts", f"matrix/{label}")
        fleet = MixedFleet(mix, app, {})
        made.append(fleet)
        for slot, cell in enumerate(mix.cells):
            device = new_device(parts, cell, feature, workdir / label, name, slot=slot,
                                namespace=label, first_version=None)
            fleet.devices[cell.row.name] = device
            app.targets.append(device.device_id)
        app.publish("1.0.0")
        return fleet

    try:
        yield make
    finally:
        with contextlib.ExitStack() as stack:
            for fleet in made:
                stack.callback(fleet.app.remove)
                for device in fleet.devices.values():
                    stack.callback(device.close)
