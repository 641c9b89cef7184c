"""Test kit: a device of one matrix cell (`MatrixDevice`, `new_device`, `devices`) and the
mixed fleets staged rollouts need (`MixedFleet`, `mixed_fleets`): the real `margo device run`,
the read API about it and what its engine runs."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kits.devicekit import engine_environment
from kits.fleetserver import capabilities
from kits.matrixapp import Application, Change
from kits.matrixcells import ROOT, SETTLE, Cell, FreshnessNotReached, Mix, Row, T
from kits.matrixengines import ComposeView, EngineView, HelmView, RenderView, Workload
from kits.matrixparts import FleetHost, MatrixParts
from kits.pkikit import make_self_signed, write_pem
from kits.serverkit import assert_deployment_in_generation
from margo.digests import digest_of
from margo_cli.go_runtime import ENGINE_DRIVERS
from tools.polling import poll_until


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
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=engine_environment() if self.cell.driver in ENGINE_DRIVERS else None)

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
        """Until the client's latest cycle took no step and converged, and came after a
        cycle that took steps (what came before it is over); how many cycles it has
        finished then. The cycle that applied a change is printed when it ends, after its
        reports: the read API can say `installed` while that cycle still runs, and the
        quiet cycle before it must not count."""
        def quiet() -> int | None:
            found = self.cycles()
            stepped = any(cycle["steps"] for cycle in found)
            return len(found) if stepped and not found[-1]["steps"] and \
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

    def wait_settled(self, change: Change, count: int = 1, state: str = "installed",
                     timeout: float = SETTLE) -> list[dict[str, Any]]:
        """Until the read API lists `count` deployments of the device, each compiled anew
        since `change` (another digest), in `state`, by a report received after it (at
        most `timeout` seconds)."""
        def settled() -> list[dict[str, Any]] | None:
            deployments = self.deployments()
            ok = len(deployments) == count and all(
                d["state"] == state and change.before.get(d["deploymentId"]) != d["digest"]
                and d["statusHistory"] and d["statusHistory"][0]["state"] == state
                and d["statusHistory"][0]["reportedAt"] >= change.at for d in deployments)
            return deployments if ok else None

        return self._wait(f"{count} deployment(s) {state} since the change", settled,
                          lambda: _summary(self.deployments()), timeout=timeout)

    def adopted_documents(self) -> dict[str, bytes]:
        """The ApplicationDeployments the device adopted, by deployment id: its state's
        copies of the exact bytes it was served (REST manifest and bundle, or its branch)."""
        path = self.home / "data" / "device-state.sqlite"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            return {row[0]: bytes(row[1]) for row in
                    conn.execute("SELECT deployment_id, data FROM documents")}

    def assert_served_in_its_generation(self) -> None:
        """What the device adopted is what the read API names (one set of bytes per device,
        whichever way it travelled), each document in the shape of the generation the
        device speaks, valid against that generation's schemas (issue 33)."""
        adopted = self.adopted_documents()
        assert {i: digest_of(data) for i, data in adopted.items()} == {
            d["deploymentId"]: d["digest"] for d in self.deployments()}
        for data in adopted.values():
            assert_deployment_in_generation(self.cell.row.api, data)

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


def new_device(parts: MatrixParts, cell: Cell, feature: str, workdir: Path,
               name: str = "", *, slot: int = 0, namespace: str | None = None,
               first_version: str | None = "1.0.0", sensitive: bool = False,
               private: bool = False, schedule: dict[str, str] | None = None,
               **first: Any) -> MatrixDevice:
    """A device of `cell` for one test of `feature` (id `<feature>[-<name>]-<cell>`): its
    credentials, engine, configuration and application version 1.0.0, published but not
    yet deployed (`deploy`); the client is not started yet (`start`).

    `first`: options of that first version (`Application.publish`: constraints,
    templates); `first_version=None` publishes none (a mixed fleet's devices share an
    application). `slot`: which control plane or Docker engine (`MatrixParts`);
    `namespace`: the one its engine view reads (default the device's own intent's).
    `sensitive`: its application's greeting is a sensitive parameter (a secret);
    `private`: its packages are in the registry that requires credentials. `schedule`: the
    client's `schedule:` section (default: a one-second interval, so every change is
    picked up by the next poll whether or not the server holds it)."""
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
            "schedule": schedule or {"interval": "1s"}}
        if cell.row.identity == "rc2":
            config["identity"] = {"rc2": {"key": "device.key",
                                          "certificate": "device-cert.pem"}}
        device.config.write_text(yaml.safe_dump(config, sort_keys=False))
        device.application().sensitive = sensitive
        device.application().private = private
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
