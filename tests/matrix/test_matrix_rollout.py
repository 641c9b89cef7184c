"""Staged rollouts over a mixed fleet (issue 28's acceptance): one device of each generation
and source (rc.3 REST, rc.2 REST signed, Oct-2024 Git) on one driver and store, every one
running the real `margo device run` against its own engine, and one application and intent
over the three with `spec.rollout` (docs/intents.md, "Staged rollouts"): a canary wave
holding the rc.3 device, then the rest.

- A good revision (a new application version) completes: the canary moves first and the
  rest only once its wave has opened, every device runs the new version on its engine, the
  rollout is `complete` in the read API and in `margo rollout status`.
- A bad revision rolls back: on render a chart whose template does not render, on Helm a
  chart with an object the API server refuses (the upgrade fails half applied), on Compose
  a package whose second service exits during start-up. The canary reports the failure;
  with `maxFailed: 0` the rollout is `rolled back` with its reason, the canary gets its
  previous file back and returns to the previous version on its engine, and the devices of
  the wave that never opened never see the bad revision: not on their branch, not on their
  engine, sampled throughout and for two more cycles of theirs after the rollback.

Each device's engine is its own (a control plane or Docker engine per device: two devices
on one cluster or engine would each remove the other's releases). The soak is short; the
wave deadline long enough for the slowest cell, so nothing goes stale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kits.matrixkit import Change, MatrixDevice, Mix, MixedFleet, Workload

FEATURE = "rollout"  # runs in `make test` on QUICK_MIXES (render, SQLite)


#: What the canary's cycles say failed, by driver: the bad revision's own failure, not some
#: other one.
FAILURE = {"render": "config.token must be set",           # the template's `required`
           "helm": "Refused",                               # the object the server refused
           "compose": "exited with code 3"}                 # the crashing service


def rollout_spec(canary: str) -> dict[str, Any]:
    """The canary wave holds exactly the rc.3 device (a selector on its id)."""
    wave = {"name": "canary", "selectors": [{"propertySelector": {"matchExpressions": [
        {"key": "/id", "operator": "In", "values": [canary]}]}}]}
    return {"waves": [wave, {"name": "rest"}], "soak": "1s", "waveDeadline": "10m",
            "maxFailed": 0}


@dataclass
class Watch:
    """What each device's branch and engine were seen holding while a rollout moved,
    sampled on every poll: the digests the read API listed and the versions the engine
    ran. `early` collects a device of the rest seen on new bytes while the canary wave was
    the only one open (the rollout's view is read after the device's, so it cannot be
    older)."""

    fleet: MixedFleet
    first: dict[str, str]  # row -> the deployment's digest before the revision
    digests: dict[str, set[str]] = field(default_factory=dict)
    versions: dict[str, set[str]] = field(default_factory=dict)
    early: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def sample(self) -> dict[str, Any] | None:
        """One sample; the rollout's view (None before the server has one)."""
        moved = []
        for row, device in self.fleet.devices.items():
            deployments = device.deployments()
            digests = {d["digest"] for d in deployments}
            self.digests.setdefault(row, set()).update(digests)
            self.versions.setdefault(row, set()).update(w.version for w in device.workloads())
            if row != "rc3" and digests - {self.first[row]}:
                moved.append(row)
        view = self.fleet.app.host.rollout(self.fleet.app.intent)
        if view is not None and moved and view["openWave"] < 1 and \
                view["status"] != "complete":
            self.early += [(row, view) for row in moved]
        return view

    def until(self, what: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Sample until the rollout's view says `done`; that view."""
        app = self.fleet.app
        return self.fleet.devices["rc3"].wait_until(
            what, lambda: (view := self.sample()) is not None and done(view) and view,
            lambda: f"rollout {app.host.rollout(app.intent)}")


def deployed(mixed_fleet: Callable[..., MixedFleet], name: str) -> tuple[MixedFleet, Watch]:
    """A mixed fleet running version 1.0.0 everywhere, its first revision's rollout
    complete (the first revision the server sees is deployed at once); a watch for the
    next one."""
    fleet = mixed_fleet(name)
    fleet.start(cycles=True)
    changes = fleet.changes()
    fleet.app.deploy(rollout=rollout_spec(fleet.devices["rc3"].device_id))
    settled = fleet.wait_settled(changes)
    fleet.wait_workloads([Workload("1.0.0", "Hello")])
    watch = Watch(fleet, {row: d["digest"] for row, d in settled.items()})
    watch.until("the first revision's rollout complete", lambda v: v["status"] == "complete")
    return fleet, watch


def test_a_good_revision_completes_on_every_device(
        mix: Mix, mixed_fleet: Callable[..., MixedFleet]) -> None:
    fleet, watch = deployed(mixed_fleet, "good")
    first = watch.sample()
    assert first is not None
    changes = fleet.changes()
    fleet.app.publish("1.1.0")

    done = watch.until("the new revision's rollout complete", lambda v: (
        v["revision"] != first["revision"] and v["status"] == "complete"))
    fleet.wait_settled(changes)
    fleet.wait_workloads([Workload("1.1.0", "Hello")])
    assert watch.early == [], watch.early  # the rest moved only once its wave opened
    assert [(w["name"], w["devices"], w["installed"]) for w in done["waves"]] == [
        ("canary", 1, 1), ("rest", 2, 2)]
    for device in fleet.devices.values():
        device.wait_freshness("current")
    status = fleet.app.host.cli("rollout", "status", fleet.app.intent).stdout
    assert status.startswith(f"{fleet.app.intent}: complete"), status


def test_a_bad_revision_rolls_back_and_every_moved_device_returns(
        mix: Mix, mixed_fleet: Callable[..., MixedFleet]) -> None:
    fleet, watch = deployed(mixed_fleet, "bad")
    canary = fleet.devices["rc3"]
    rest = {row: d for row, d in fleet.devices.items() if row != "rc3"}
    heads = {row: _view(d)["history"][0]["commit"] for row, d in rest.items()}
    published = canary.change()
    fleet.app.publish("2.0.0", failing=True)

    rolled = watch.until("the rollout rolled back", lambda v: v["status"] == "rolled back")
    assert "1 failed and 0 stale device(s) exceed the failure budget of 0" in rolled["reason"]
    assert [(w["name"], w["moved"]) for w in rolled["waves"]] == [("canary", 1), ("rest", 0)]
    status = fleet.app.host.cli("rollout", "status", fleet.app.intent).stdout
    assert status.startswith(f"{fleet.app.intent}: rolled back"), status

    # The canary failed on the bad bytes, got its previous file back and runs the previous
    # version on its engine again, reported on after the change.
    returned = canary.wait_until("the canary back on its previous bytes, installed",
                                 lambda: _back(canary.deployments(), watch.first["rc3"],
                                               published))
    assert any(h["state"] == "failed" for h in returned["statusHistory"]), returned
    failures = [f for cycle in canary.cycles() for f in cycle["failures"]]
    assert any(FAILURE[mix.driver] in failure for failure in failures), failures
    canary.wait_workloads([Workload("1.0.0", "Hello")])
    assert f"rollback {fleet.app.intent}" in _view(canary)["history"][0]["message"]

    # The rest: sampled for two more cycles of each of them; the bad revision never
    # reached their branch or their engine.
    since = {row: len(d.cycles()) for row, d in rest.items()}
    for row, device in rest.items():
        device.wait_until("two more cycles", lambda d=device, n=since[row]: (
            watch.sample() is not None and len(d.cycles()) >= n + 2))
    for row, device in rest.items():
        assert watch.digests[row] == {watch.first[row]}, (row, watch.digests[row])
        assert watch.versions[row] == {"1.0.0"}, (row, watch.versions[row])
        assert _view(device)["history"][0]["commit"] == heads[row]
        device.wait_workloads([Workload("1.0.0", "Hello")])
    for device in fleet.devices.values():
        device.wait_freshness("current")
    assert fleet.app.host.rollout(fleet.app.intent)["status"] == "rolled back"


def _back(deployments: list[dict[str, Any]], digest: str,
          change: Change) -> dict[str, Any] | None:
    """The deployment, once it holds `digest` again, installed by a report about those
    bytes received after `change`."""
    if len(deployments) != 1:
        return None
    [found] = deployments
    history = found["statusHistory"]
    return found if (found["digest"] == digest and found["state"] == "installed"
                     and found["applied"]["current"] and history
                     and history[0]["reportedAt"] >= change.at) else None


def _view(device: MatrixDevice) -> dict[str, Any]:
    view = device.view()
    assert view is not None
    return view
