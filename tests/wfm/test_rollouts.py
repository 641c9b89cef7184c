"""Staged rollouts end to end (docs/intents.md, "Staged rollouts"): a real `margo serve`
watching its fleet source, and six simulated devices speaking the rc.3 REST protocol (they
poll, fetch their YAMLs and report `installed`, or `failed` when told to, or `installing`
first when slow). Each test edits
the intent and follows the rollout through the read API and `margo rollout`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.fleetkit import Fleet, app, device, intent
from kits.serverkit import ROOT, add_client, running_server

from compiler.rollout import RolloutSpec, Wave, assign_waves, move_order
from tools.polling import poll_until

DEVICES = [f"d{i}" for i in range(6)]


class Devices:
    """The fleet's devices, as one client: each poll fetches every deployment whose digest
    moved and reports on it; `fails(device, greeting)` says which installs fail, and
    devices in `offline` never report. With `installing_first`, a device reports
    `installing` on the poll it first sees new bytes and `installed` only on the next;
    `most_unavailable` is, per greeting, the most devices one poll found served it without
    having reported on it yet, or only `installing` (what `maxUnavailable` caps)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.fails: Callable[[str, str], bool] = lambda device_id, greeting: False
        self.offline: set[str] = set()
        self.reported: dict[str, str] = {}  # deployment id -> digest reported on
        self.greetings: dict[str, str] = {}  # device -> the greeting it runs now
        self.seen: dict[str, set[str]] = defaultdict(set)  # device -> every greeting served
        self.first_seen: dict[str, list[str]] = defaultdict(list)  # greeting -> devices
        #: (greeting, device) -> the devices that had installed it when this one first got it
        self.installed_before: dict[tuple[str, str], set[str]] = {}
        self.installing_first = False
        self.installing: dict[str, str] = {}  # deployment id -> digest reported installing
        self.most_unavailable: dict[str, int] = defaultdict(int)  # greeting -> most at once

    def step(self) -> None:
        manifest = self.http.get("/api/v1/deployments").json()
        unavailable: dict[str, int] = defaultdict(int)
        runs = dict(self.greetings)  # as the server knew it when it served this manifest
        for ref in manifest["deployments"]:
            doc = yaml.safe_load(self.http.get(ref["url"]).content)
            device_id = doc["metadata"]["deviceId"]
            greeting = _greeting(doc)
            if greeting not in self.seen[device_id]:
                self.first_seen[greeting].append(device_id)
                self.installed_before[greeting, device_id] = {
                    d for d, g in runs.items() if g == greeting}
            self.seen[device_id].add(greeting)
            if self.reported.get(ref["deploymentId"]) == ref["digest"]:
                continue
            unavailable[greeting] += 1
            if device_id in self.offline:
                continue
            state = "failed" if self.fails(device_id, greeting) else "installed"
            if self.installing_first and state == "installed" and \
                    self.installing.get(ref["deploymentId"]) != ref["digest"]:
                state = "installing"
                self.installing[ref["deploymentId"]] = ref["digest"]
            report = {"deploymentId": ref["deploymentId"],
                      "adoptedManifestVersion": manifest["manifestVersion"],
                      "status": {"state": state, **({"error": {"code": "E1", "message":
                                                                "crash loop"}}
                                                     if state == "failed" else {})},
                      "components": [{"name": "web-compose", "state": state}]}
            response = self.http.post(f"/api/v1/deployments/{ref['deploymentId']}/status",
                                      json=report)
            assert response.status_code == 200, response.text
            if state != "installing":
                self.reported[ref["deploymentId"]] = ref["digest"]
                self.greetings[device_id] = greeting
        for greeting, count in unavailable.items():
            self.most_unavailable[greeting] = max(self.most_unavailable[greeting], count)

    def on(self, greeting: str) -> set[str]:
        return {d for d, g in self.greetings.items() if g == greeting}


def _greeting(doc: dict[str, Any]) -> str:
    text = yaml.safe_dump(doc)
    return next((g for g in ("v3", "v2", "v1") if f"greeting-{g}" in text), "?")


def write_fleet(root: Path, rollout: dict[str, Any], greeting: str = "greeting-v1") -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", parameters={"greeting": greeting},
                                  profile={"type": "compose"}, rollout=rollout)
    fleet.devices.update({d: device(d, types=("compose",)) for d in DEVICES})
    fleet.write()
    return fleet


def set_greeting(fleet: Fleet, greeting: str, base: str) -> None:
    """Edit the intent (the server watches the source) and wait for its new rollout."""
    before = rollout_view(base)["revision"]
    fleet.intents["web"]["spec"]["parameters"]["greeting"] = greeting
    fleet.write()
    poll_until("the new revision's rollout", lambda: rollout_view(base)["revision"] != before,
               timeout=30, interval=0.1)


@pytest.fixture
def fleet_server(tmp_path: Path, request: pytest.FixtureRequest
                 ) -> Iterator[tuple[Fleet, str, Devices]]:
    rollout = request.param
    fleet = write_fleet(tmp_path / "fleet", rollout)
    data = tmp_path / "data"
    token = add_client(data, "plant")
    with running_server(data, "--source", str(fleet.source), "--watch-source") as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        for device_id in DEVICES:
            response = http.put(f"/api/v1/capabilities/{device_id}",
                                json=fleet.devices[device_id])
            assert response.status_code == 201, response.text
        devices = Devices(http)
        poll_until("every device on v1", lambda: devices.step() or
                   devices.on("v1") == set(DEVICES), timeout=30, interval=0.2)
        poll_until("the first revision complete", lambda: rollout_view(base)["status"]
                   == "complete", timeout=30, interval=0.2)
        yield fleet, base, devices


def rollout_view(base: str) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(f"{base}/api/fleet/rollouts/web", timeout=10).json()
    return view


def until(what: str, devices: Devices, base: str,
          done: Callable[[dict[str, Any]], bool], *, timeout: float = 60) -> dict[str, Any]:
    """Let the devices poll and report until the rollout's view says `done`."""
    def check() -> dict[str, Any] | None:
        devices.step()
        view = rollout_view(base)
        return view if done(view) else None

    found: dict[str, Any] = poll_until(what, check, timeout=timeout, interval=0.2)
    return found


def rollout_cli(base: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", "rollout", *args,
                           "--url", base], capture_output=True, text=True, check=False,
                          cwd=ROOT, timeout=60)


THREE_WAVES = {"waves": [{"name": "canary", "devices": 1}, {"name": "half", "devices": "50%"},
                         {"name": "rest"}], "soak": "1s", "waveDeadline": "5m",
               "maxFailed": 0}


@pytest.mark.parametrize("fleet_server", [THREE_WAVES], indirect=True)
def test_a_three_wave_rollout_converges_wave_by_wave(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    set_greeting(fleet, "greeting-v2", base)
    widths: list[int] = []

    def record(view: dict[str, Any]) -> bool:
        open_size = sum(w["devices"] for w in view["waves"] if w["openedAt"] is not None)
        on_new = {d for d, seen in devices.seen.items() if "v2" in seen}
        assert len(on_new) <= open_size or view["status"] == "complete", (view, on_new)
        widths.append(len(on_new))
        return view["status"] == "complete"

    done = until("the rollout to complete", devices, base, record)
    assert devices.on("v2") == set(DEVICES)
    assert [w["devices"] for w in done["waves"]] == [1, 3, 2]
    assert {1, 4, 6} <= set(widths)  # it stopped at each wave's edge on the way
    shown = rollout_cli(base, "status", "web")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("web: complete")
    assert "installed over time:" in shown.stdout
    page = httpx.get(f"{base}/").text
    assert 'data-rollout="web"' in page and 'data-testid="rollout-status">complete<' in page
    assert "<polyline points=" in page


CANARY_FAILS = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
                "soak": "1s", "maxFailed": 0}


@pytest.mark.parametrize("fleet_server", [CANARY_FAILS], indirect=True)
def test_a_failing_canary_rolls_back_and_the_rest_never_sees_the_bad_version(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    devices.fails = lambda device_id, greeting: greeting == "v2"
    set_greeting(fleet, "greeting-v2", base)
    view = until("the rollout to roll back", devices, base,
                 lambda v: v["status"] == "rolled back")
    assert "failure budget of 0" in view["reason"]
    [canary] = [d for d, seen in devices.seen.items() if "v2" in seen]
    poll_until("the canary back on v1", lambda: devices.step() or
               devices.greetings.get(canary) == "v1", timeout=30, interval=0.2)
    assert all(seen == {"v1"} for d, seen in devices.seen.items() if d != canary)
    history = httpx.get(f"{base}/api/fleet/devices/{canary}").json()["history"]
    assert "rollback web" in history[0]["message"]
    time.sleep(1.5)  # nothing else moves while rolled back
    devices.step()
    assert all(seen == {"v1"} for d, seen in devices.seen.items() if d != canary)
    assert rollout_view(base)["status"] == "rolled back"
    # The canary is back on v1 (and says installed), but the reason, the read API's
    # columns and the dashboard's all show where the devices stood when it rolled back.
    after = rollout_view(base)
    assert after["reason"].startswith("1 failed and 0 stale"), after
    assert [(w["failed"], w["installed"], w["held"]) for w in after["waves"]] == [
        (1, 0, 0), (0, 0, 5)], after
    page = httpx.get(f"{base}/").text
    canary_row = re.search(r'<th scope="row">canary</th>(.*?)</tr>', page, re.S)
    assert canary_row is not None, page
    # Devices, Moved, Installed, Failed, Stale, Pending, Held
    assert re.findall(r'<td class="num">(\d+)</td>', canary_row.group(1)) == [
        "1", "1", "0", "1", "0", "0", "0"]
    assert "1 failed and 0 stale device(s) exceed the failure budget of 0" in page


# The soak must outlast starting the CLI for `pause` on a busy machine (it once took over
# 2 s under the full suite, and the next wave had opened before the pause arrived).
PAUSABLE_SOAK = 4
PAUSABLE = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
            "soak": f"{PAUSABLE_SOAK}s"}


@pytest.mark.parametrize("fleet_server", [PAUSABLE], indirect=True)
def test_pause_holds_the_next_wave_and_resume_lets_it_open(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    set_greeting(fleet, "greeting-v2", base)
    until("the canary to move", devices, base, lambda v: v["waves"][0]["moved"] == 1)
    moved = time.monotonic()
    paused = rollout_cli(base, "pause", "web")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.startswith("web: paused")
    deadline = moved + PAUSABLE_SOAK + 3  # past the soak: only the pause holds the next wave now
    while time.monotonic() < deadline:
        devices.step()
        time.sleep(0.2)
    assert len(devices.on("v2")) == 1 and rollout_view(base)["openWave"] == 0
    again = rollout_cli(base, "pause", "web")
    assert again.returncode != 0 and "is paused" in again.stderr
    assert rollout_cli(base, "resume", "web").returncode == 0
    # The next wave opens at once (its soak passed long ago); completing would only add
    # the last wave's soak, which the three-wave test covers.
    until("the next wave to open", devices, base, lambda v: v["openWave"] == 1
          and len(devices.on("v2")) == len(DEVICES))
    assert devices.on("v2") == set(DEVICES)


SLOW = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}], "soak": "30m"}


@pytest.mark.parametrize("fleet_server", [SLOW], indirect=True)
def test_a_new_revision_supersedes_the_rollout_and_held_devices_skip_the_old_one(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    set_greeting(fleet, "greeting-v2", base)
    until("the canary on v2", devices, base, lambda v: v["waves"][0]["installed"] == 1
          and len(devices.on("v2")) == 1)
    first = rollout_view(base)["revision"]
    fleet.intents["web"]["spec"]["rollout"]["soak"] = "1s"
    set_greeting(fleet, "greeting-v3", base)
    view = until("the newest revision to complete", devices, base,
                 lambda v: v["status"] == "complete" and v["revision"] != first)
    assert view["superseded"] == first
    assert devices.on("v3") == set(DEVICES)
    [canary] = [d for d, seen in devices.seen.items() if "v2" in seen]
    assert all("v2" not in seen for d, seen in devices.seen.items() if d != canary)


OFFLINE = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}], "soak": "1s",
           "waveDeadline": "2s", "maxFailed": 1}


@pytest.mark.parametrize("fleet_server", [OFFLINE], indirect=True)
def test_an_offline_device_goes_stale_at_the_wave_deadline_and_counts_against_the_budget(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    devices.offline = set(DEVICES)  # nobody reports until the canary is known
    set_greeting(fleet, "greeting-v2", base)
    until("the canary to move", devices, base, lambda v: v["waves"][0]["moved"] == 1)
    [canary] = poll_until("the canary served v2", lambda: devices.step() or [
        d for d, seen in devices.seen.items() if "v2" in seen], timeout=30, interval=0.2)
    devices.offline = {canary}
    view = until("the canary to go stale and the rest to move", devices, base,
                 lambda v: v["status"] == "complete", timeout=60)
    assert view["waves"][0]["stale"] == 1
    assert devices.on("v2") == set(DEVICES) - {canary}


ONE_AT_A_TIME = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
                 "soak": "1s", "waveDeadline": "5m", "maxUnavailable": 1}


@pytest.mark.parametrize("fleet_server", [ONE_AT_A_TIME], indirect=True)
def test_max_unavailable_moves_the_devices_of_a_wave_one_at_a_time(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    devices.installing_first = True  # each device stays unavailable for a poll or more
    set_greeting(fleet, "greeting-v2", base)
    waiting: list[int] = []

    def record(view: dict[str, Any]) -> bool:
        assert view["unavailable"] <= 1, view
        assert view["maxUnavailable"] == 1
        if view["openWave"] == 1 and view["status"] == "progressing":
            waiting.append(view["waves"][1]["waiting"])
        return view["status"] == "complete"

    done = until("the rollout to complete", devices, base, record, timeout=120)
    assert devices.on("v2") == set(DEVICES)
    # No poll ever found two devices on v2 that had not installed it.
    assert devices.most_unavailable["v2"] == 1
    assert [w["devices"] for w in done["waves"]] == [1, 5]
    assert max(waiting) >= 3  # the rest of the wave waited its turn, visibly
    # One after the other, in the fixed order of sha256(intent/device).
    [canary, *rest] = devices.first_seen["v2"]
    assert rest == move_order("web", set(DEVICES) - {canary})
    shown = rollout_cli(base, "status", "web")
    assert shown.returncode == 0, shown.stderr
    assert "max unavailable 1" in shown.stdout and "waiting" in shown.stdout
    page = httpx.get(f"{base}/").text
    assert 'data-testid="rollout-unavailable">at most 1 unavailable at once' in page
    assert '<th scope="col" class="num">Waiting</th>' in page


STOPS_AT_A_FAILURE = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
                      "soak": "1s", "maxFailed": 1, "maxUnavailable": 1}


@pytest.mark.parametrize("fleet_server", [STOPS_AT_A_FAILURE], indirect=True)
def test_a_failure_within_the_budget_fills_max_unavailable_and_the_rest_waits(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    devices.fails = lambda device_id, greeting: greeting == "v2"
    set_greeting(fleet, "greeting-v2", base)
    view = until("the rest of the rollout to wait", devices, base,
                 lambda v: bool(v["blocked"]))
    assert view["status"] == "progressing" and view["openWave"] == 1
    assert view["unavailable"] == 1 and view["waves"][1]["waiting"] == 5
    assert "1 device(s) unavailable, maxUnavailable 1" in view["blocked"]
    shown = rollout_cli(base, "status", "web")
    assert "waits: 1 device(s) unavailable" in shown.stdout, shown.stdout
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        devices.step()
        time.sleep(0.2)
    assert len([d for d, seen in devices.seen.items() if "v2" in seen]) == 1
    assert rollout_cli(base, "abort", "web").returncode == 0
    until("the rollout rolled back", devices, base, lambda v: v["status"] == "rolled back")



NO_SOAK = {"waves": [{"name": "canary", "devices": 1}, {"name": "half", "devices": "50%"},
                     {"name": "rest"}], "waveDeadline": "5m"}


@pytest.mark.parametrize("fleet_server", [NO_SOAK], indirect=True)
def test_without_a_soak_a_wave_still_waits_for_the_previous_one_to_install(
        fleet_server: tuple[Fleet, str, Devices]) -> None:
    fleet, base, devices = fleet_server
    devices.installing_first = True  # a moved device is unavailable for a poll or more
    set_greeting(fleet, "greeting-v2", base)
    done = until("the rollout to complete", devices, base, lambda v: v["status"] == "complete")
    assert devices.on("v2") == set(DEVICES)
    assert [w["devices"] for w in done["waves"]] == [1, 3, 2]
    spec = RolloutSpec((Wave("canary", count=1), Wave("half", percent=50), Wave("rest")))
    waves = assign_waves("web", spec, [(d, {}, {}) for d in DEVICES])  # as the compiler does
    for device_id in DEVICES:
        earlier = {d for d, w in waves.items() if w < waves[device_id]}
        installed = devices.installed_before["v2", device_id]
        assert earlier <= installed, (device_id, earlier, installed)
