"""Test kit: the real parts the device matrix's cells share in one test process (registry,
control planes and Docker engines by slot, test images, one fleet server per store), each
started on first use (`MatrixParts`, `PARTS`), and `FleetHost`, one store's server."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from compiler.secrets import FleetKey, new_identity_text, write_identity_file
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    build_test_images,
    running_engine,
)
from kits.fleetserver import FleetServer
from kits.kubekit import DEVICE_RBAC, ControlPlane
from kits.matrixcells import ROOT, SETTLE, Cell, Mix
from kits.metricskit import held_polls
from kits.registrykit import running_registry
from kits.serverkit import add_client, running_replicas, running_server, use_store
from tools.polling import poll_until

# --- the shared parts -----------------------------------------------------------------------


#: The private registry's one user (`MatrixParts.private_registry`).
PRIVATE_USER, PRIVATE_PASSWORD = "robot", "Reg-9d2c71f0-private"


@dataclass
class FleetHost:
    """One store's `margo serve` (one process, or two replicas behind the balancer) on a
    watched fleet source that starts empty; the devices add their own applications and
    intents."""

    store: str
    server: FleetServer
    http: httpx.Client
    #: The fleet key the server opens the intents' secrets with (`--fleet-key`).
    fleet_key: FleetKey

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
        write_atomically(self.source / "apps" / app_id / version / "margo.yaml",
                          yaml.safe_dump(doc, sort_keys=False))

    def remove_application(self, app_id: str) -> None:
        shutil.rmtree(self.source / "apps" / app_id, ignore_errors=True)

    def held_polls(self) -> int:
        """How many waiting polls the server answering this request holds now
        (`margo_waiting_polls_held`); behind the replicas' balancer each call reads the
        next replica."""
        return held_polls(self.http)

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
        return self._found(f"/api/fleet/rollouts/{intent}")

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
        return self._found(f"/api/fleet/devices/{device_id}")

    def _found(self, path: str) -> dict[str, Any] | None:
        """The read API's answer at `path`: None on 404, else it must be 200."""
        response = self.http.get(path)
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        found: dict[str, Any] = response.json()
        return found


class MatrixParts:
    """The real parts cells share in one test process, each started on first use and all
    stopped by `close` (tests/matrix/conftest.py calls it after the last cell, so they
    never run beside the other suites' own registry, control plane or Docker engine)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._factory: pytest.TempPathFactory | None = None
        self._registry: str | None = None
        self._private: str | None = None
        self._planes: dict[int, ControlPlane] = {}
        self._engines: dict[int, DockerEngine] = {}
        self._images: ImageSet | None = None
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

    def private_registry(self) -> str:
        """`127.0.0.1:<port>` of a second registry, which refuses anonymous requests (basic
        authentication as `PRIVATE_USER` / `PRIVATE_PASSWORD`)."""
        if self._private is None:
            self._private = self._stack.enter_context(running_registry(
                self._folder("matrix-private"), users={PRIVATE_USER: PRIVATE_PASSWORD}))
        return self._private

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
            self._registry, self._private, self._images, self._hosts = None, None, None, {}
            self._planes, self._engines = {}, {}


@contextlib.contextmanager
def _fleet_host(store: str, workdir: Path, fleet: Path) -> Iterator[FleetHost]:
    """`kits.fleetserver.fleet_server` on `store`, except that the replicas' balancer
    passes the devices' `Host` through: rc.2 signatures cover `@authority`, which a replica
    rebuilds from `Host` (kits.balancer), so a balancer that rewrites it (nginx's default)
    refuses every signed request with 401."""
    data = workdir / "data"
    key = workdir / "fleet.key"
    write_identity_file(key, new_identity_text())
    args = ("--source", str(fleet), "--watch-source", "--fleet-key", str(key))
    with contextlib.ExitStack() as stack:
        with use_store(store):  # read by add_client and running_server as they start
            token = add_client(data, "operator")
            base = stack.enter_context(
                running_replicas(data, *args, preserve_host=True) if store == "replicas"
                else running_server(data, *args))
        http = stack.enter_context(httpx.Client(base_url=base, timeout=10))
        yield FleetHost(store, FleetServer(base=base, client_id="operator", token=token,
                                           source_dir=fleet, data_dir=data, _http=http), http,
                        FleetKey.load(key))


#: The test process's parts (atexit: a run interrupted before conftest's hook still stops them).
PARTS = MatrixParts()
atexit.register(PARTS.close)




def write_atomically(path: Path, text: str) -> None:
    """Write aside, then rename: the server's source watcher never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
