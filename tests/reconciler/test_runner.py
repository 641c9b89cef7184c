"""The runner's decisions, without any engine: a fake driver (an in-memory engine that
fails on cue) and a fake source (a desired state of the test's choosing), with the real
planner, the real durable state and a clock the test moves.

These are test doubles on purpose: what is asserted is the runner's own logic (listed
order, stop after a failure, retry back-off and its reset, moves, drift and skips), and
faults on cue on every step, which a real engine cannot give on demand. The same paths
run end to end on real engines in test_device_e2e, test_cluster_real_e2e and
test_compose_e2e.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from reconciler.desired import DesiredDeployment, DesiredState, parse_deployment
from reconciler.errors import ApplyError, ErrorCode
from reconciler.planner import Action, Step
from reconciler.releases import (
    InstalledRelease,
    ReleaseState,
    ownership_labels,
    release_from_labels,
    release_name,
    unmanaged_release,
    with_drift,
)
from reconciler.runner import RETRY_FIRST_SECONDS, Reconciler, StatusTarget
from reconciler.sources import Adopted
from reconciler.state import DeviceState

DEPLOYMENT_ID = "3c1f0e2a-9a5b-5c7d-8e9f-0a1b2c3d4e5f"


def deployment(*components: str, namespace: str = "edge", revision: str = "1.0.0",
               profile: str = "helm") -> DesiredDeployment:
    document = {
        "id": DEPLOYMENT_ID,
        "metadata": {"name": "shop", "namespace": namespace, "deviceId": "device-1"},
        "spec": {"applicationId": "com-example-shop", "deploymentProfile": {
            "type": profile, "components": [
                {"name": name, "properties": {"repository": f"oci://r.example/{name}",
                                              "revision": revision}}
                for name in components]}}}
    return parse_deployment(yaml.safe_dump(document, sort_keys=False).encode())


@dataclass
class FakeDriver:
    """An engine in memory: `releases` by component; `fail` maps a component to the
    error its next applies raise (popped when `once`); `misread` to the error reading it
    back (`confirm`) raises after each apply: the engine then holds it `failed`."""

    profile_types: tuple[str, ...] = ("helm",)
    name: str = "fake"
    releases: dict[str, InstalledRelease] = field(default_factory=dict)
    fail: dict[str, ApplyError] = field(default_factory=dict)
    once: bool = True
    applied: list[tuple[str, str]] = field(default_factory=list)
    extra: list[InstalledRelease] = field(default_factory=list)
    misread: dict[str, ApplyError] = field(default_factory=dict)
    confirmed: list[tuple[str, str]] = field(default_factory=list)

    def installed(self) -> list[InstalledRelease]:
        return [*self.releases.values(), *self.extra]

    def apply(self, step: Step, desired: DesiredDeployment | None) -> None:
        self.applied.append((str(step.action), step.component))
        error = self.fail.get(step.component)
        if error is not None:
            if self.once:
                del self.fail[step.component]
            raise error
        if step.action is Action.REMOVE:
            self.releases.pop(step.component, None)
            return
        assert desired is not None and step.desired is not None
        labels = ownership_labels(desired.deployment_id, step.component,
                                  desired_digest=desired.digest,
                                  spec_digest=step.desired.spec_digest,
                                  values_digest=step.desired.values_digest)
        self.releases[step.component] = release_from_labels(
            labels, release_name=step.release_name, namespace=step.namespace,
            state=ReleaseState.DEPLOYED)

    def confirm(self, step: Step, desired: DesiredDeployment | None) -> None:
        self.confirmed.append((str(step.action), step.component))
        error = self.misread.get(step.component)
        if error is not None:
            found = self.releases[step.component]
            self.releases[step.component] = replace(found, state=ReleaseState.FAILED)
            raise error

    def close(self) -> None:
        pass


@dataclass
class FakeSource:
    """Hands out `state` once per `publish`."""

    name: str = "margo-rest"
    state: DesiredState | None = None
    version: int = 0

    def publish(self, *deployments: DesiredDeployment) -> None:
        self.version += 1
        self.state = DesiredState("margo-rest", str(self.version), self.version,
                                  f'"{self.version}"', tuple(deployments))

    def fetch(self, adopted: Adopted) -> DesiredState | None:
        found, self.state = self.state, None
        return found

    def close(self) -> None:
        pass


@dataclass
class World:
    runner: Reconciler
    driver: FakeDriver
    source: FakeSource
    state: DeviceState
    now: list[float]

    def states(self, component: str) -> list[str]:
        """The component's states as the journaled statuses show them over time (each
        entry is the whole deployment's status; repeats are its other components' news)."""
        out: list[str] = []
        for entry in self.state.pending(1000):
            body = json.loads(entry.body)
            for found in body["components"]:
                if found["name"] == component and (not out or out[-1] != found["state"]):
                    out.append(found["state"])
        return out

    def last(self, component: str) -> dict[str, Any]:
        for entry in reversed(self.state.pending(1000)):
            for found in json.loads(entry.body)["components"]:
                if found["name"] == component:
                    return dict(found)
        raise AssertionError(f"no report for {component}")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    now = [1000.0]
    with DeviceState(tmp_path / "state.sqlite") as state:
        driver, source = FakeDriver(), FakeSource()
        runner = Reconciler(state=state, source=source, driver=driver,  # type: ignore[arg-type]
                            target=StatusTarget("rc.3", "device-1", ""),
                            deliver=lambda: (0, state.journal_size()), clock=lambda: now[0])
        yield World(runner, driver, source, state, now)


def test_components_go_in_listed_order_and_each_transition_is_reported(world: World) -> None:
    world.source.publish(deployment("db", "web", "worker"))
    result = world.runner.cycle()
    assert result.converged
    assert world.driver.applied == [("install", "db"), ("install", "web"), ("install", "worker")]
    assert world.driver.confirmed == world.driver.applied  # each read back before reported
    assert world.states("web") == ["pending", "installing", "installed"]
    assert world.runner.cycle().steps == []  # nothing changed: nothing applied or reported
    assert world.states("web") == ["pending", "installing", "installed"]


def test_a_stop_during_a_cycle_is_converged_unless_it_left_changes_undone(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.source.publish(deployment("web"))
    assert world.runner.cycle().converged
    installed = world.driver.installed

    def stopped_meanwhile() -> list[InstalledRelease]:  # SIGTERM while the engine is asked
        world.runner.stopping.set()
        return installed()

    monkeypatch.setattr(world.driver, "installed", stopped_meanwhile)
    assert world.runner.cycle().converged  # nothing was left to do: a clean stop
    world.source.publish(deployment("web", revision="2.0.0"))
    stopped = world.runner.cycle()
    assert not stopped.converged  # the upgrade waits for the next start
    assert world.driver.applied == [("install", "web")]


@pytest.mark.parametrize(("retryable", "tries_after"), [
    (True, [RETRY_FIRST_SECONDS - 1, RETRY_FIRST_SECONDS + 1]),  # waits out the back-off
    (False, [RETRY_FIRST_SECONDS * 100]),  # never again, until the desired state changes
])
def test_a_failure_stops_the_deployment_and_is_retried_after_a_back_off(
        world: World, retryable: bool, tries_after: list[float]) -> None:
    world.driver.fail["web"] = ApplyError(ErrorCode.PULL_FAILED, "registry down",
                                          retryable=retryable)
    world.source.publish(deployment("db", "web", "worker"))
    first = world.runner.cycle()
    assert not first.converged
    assert world.driver.applied == [("install", "db"), ("install", "web")]  # worker waits
    assert world.last("web") == {"name": "web", "state": "failed", "error": {
        "code": "PULL_FAILED", "source": "web", "message": "registry down"}}
    assert world.states("worker") == ["pending"]
    world.runner.cycle()  # at once: no new attempt
    assert len(world.driver.applied) == 2
    start = world.now[0]
    for offset in tries_after:
        world.now[0] = start + offset
        world.runner.cycle()
    retried = world.driver.applied[2:]
    assert retried == ([("install", "web"), ("install", "worker")] if retryable else [])


def test_the_back_off_doubles_and_a_new_desired_state_resets_it(world: World) -> None:
    world.driver.once = False
    world.driver.fail["web"] = ApplyError(ErrorCode.PULL_FAILED, "registry down")
    world.source.publish(deployment("web"))
    attempts = []
    for second in range(0, 80, 1):
        world.now[0] = 1000.0 + second
        before = len(world.driver.applied)
        world.runner.cycle()
        if len(world.driver.applied) > before:
            attempts.append(second)
    assert attempts == [0, 10, 30, 70]  # 10, 20, 40 seconds apart
    world.source.publish(deployment("web", revision="2.0.0"))  # a fix is published
    world.runner.cycle()  # one second after the last attempt, yet tried at once
    assert len(world.driver.applied) == len(attempts) + 1


def test_a_namespace_move_removes_then_installs_and_never_reports_removed(world: World) -> None:
    world.source.publish(deployment("web"))
    world.runner.cycle()
    world.source.publish(deployment("web", namespace="shop"))
    assert world.runner.cycle().converged
    assert world.driver.applied[1:] == [("remove", "web"), ("install", "web")]
    # Removed from the old namespace only to be installed in the new one: never `removed`.
    assert world.states("web") == ["pending", "installing", "installed", "removing",
                                   "installing", "installed"]
    assert world.driver.releases["web"].namespace == "shop"


def test_drift_is_reported_once_and_cleared_when_it_goes(world: World) -> None:
    world.source.publish(deployment("web"))
    world.runner.cycle()
    release = world.driver.releases["web"]
    world.driver.releases["web"] = replace(release, drift="missing: Deployment edge/web")
    for _ in range(2):
        assert not world.runner.cycle().converged
    assert world.states("web")[-1] == "failed"
    assert world.states("web").count("failed") == 1
    assert world.last("web")["error"]["code"] == "DRIFTED"
    world.driver.releases["web"] = release
    assert world.runner.cycle().converged
    assert world.states("web")[-1] == "installed"


def test_drift_to_repair_is_applied_again_and_the_report_says_what_was_repaired(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.source.publish(deployment("db", "web"))
    world.runner.cycle()
    found = "edited: web/templates/configmap.yaml"
    world.driver.releases["web"] = with_drift(world.driver.releases["web"], found, "repair")
    with caplog.at_level("WARNING", logger="margo.device"):
        result = world.runner.cycle()
    assert result.converged
    assert result.steps == [("repair", DEPLOYMENT_ID, "web", "ok")]
    assert world.driver.applied[-1] == ("repair", "web")
    assert world.states("web") == ["pending", "installing", "installed", "installing",
                                   "installed"]
    reports = [json.loads(e.body) for e in world.state.pending(1000)]
    assert reports[-1]["x-margo-gitops-extensions"]["repaired"] == {"web": found}
    assert [r["x-margo-gitops-extensions"].get("repaired") for r in reports[:-1]] == \
        [None] * (len(reports) - 1)  # only the report that says it is installed again
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("web" in m and found in m and "repaired" in m for m in logged), logged
    assert world.runner.cycle().steps == []  # repaired: nothing more to do


@pytest.mark.parametrize(("state", "action"), [
    (ReleaseState.PENDING_INSTALL, "reinstall"), (ReleaseState.PENDING_UPGRADE, "recover"),
    (ReleaseState.FAILED, "upgrade")])
def test_what_the_driver_found_is_what_it_is_asked_to_do(world: World, state: ReleaseState,
                                                         action: str) -> None:
    world.source.publish(deployment("web"))
    world.runner.cycle()
    world.driver.releases["web"] = replace(world.driver.releases["web"], state=state)
    world.runner.cycle()
    assert world.driver.applied[-1] == (action, "web")


def test_a_name_taken_by_a_foreign_release_is_skipped_without_asking_the_driver(
        world: World) -> None:
    desired = deployment("db", "web")
    world.driver.extra = [unmanaged_release(release_name(DEPLOYMENT_ID, "db"), "edge")]
    world.source.publish(desired)
    result = world.runner.cycle()
    assert world.driver.applied == []
    assert world.last("db")["state"] == "failed"
    assert "is not managed by margo-gitops" in world.last("db")["error"]["message"]
    assert world.states("db") == ["pending", "failed"]  # never "installing"
    assert world.states("web") == ["pending"]
    assert any("INSTALL_FAILED" in f for f in result.failures)


def test_a_profile_the_driver_does_not_run_fails_every_component(world: World) -> None:
    world.source.publish(deployment("web", "db", profile="compose"))
    result = world.runner.cycle()
    assert world.driver.applied == []
    assert world.last("web")["error"]["code"] == "UNSUPPORTED_TYPE"
    assert any("does not run compose" in f for f in result.failures)


def test_what_the_engine_is_read_to_hold_decides_installed(world: World) -> None:
    """A step the driver applied but whose result reads back otherwise (the engine's record
    left `failed`, a container gone, a file changed) is reported `failed` with the
    read-back's error, never `installed`; later components wait, and the next cycle plans
    against what the engine holds (here `failed`: upgraded)."""
    world.driver.misread["web"] = ApplyError(
        ErrorCode.READBACK_MISMATCH, "release edge/web is not what was applied: status: "
        "expected deployed, found failed")
    world.source.publish(deployment("db", "web", "worker"))
    assert not world.runner.cycle().converged
    assert world.driver.applied == [("install", "db"), ("install", "web")]
    assert world.states("web") == ["pending", "installing", "failed"]
    assert world.last("web")["error"] == {
        "code": "READBACK_MISMATCH", "source": "web", "message": "release edge/web is not "
        "what was applied: status: expected deployed, found failed"}
    del world.driver.misread["web"]
    assert world.runner.cycle().converged
    assert world.driver.applied[2:] == [("upgrade", "web"), ("install", "worker")]
    assert world.states("web") == ["pending", "installing", "failed", "installing",
                                   "installed"]
