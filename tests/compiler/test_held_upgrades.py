"""Held upgrades (docs/intents.md, "Capacity accounting", rule 4; issue 28): a change of a
placed deployment that raises what it takes and no longer fits keeps the file the device
runs, says why in numbers, and moves on as soon as it fits. Real compiles through the Git
store and state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.fleetkit import Fleet, app, device, intent

from compiler.explain import explain_device
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from margo.canonical import canonical_yaml
from margo.kinds import GENERATIONS, detect
from reconciler.capabilities import shape_capabilities

ROOT = Path(__file__).resolve().parents[2]
APP = "com-example-app"
COMPOSE_ONLY = {"greeting": {"value": "hello", "targets": [{"pointer": "GREETING",
                                                             "components": ["web-compose"]}]}}


def description(version: str, cores: float, *, memory: str | None = None,
                storage: str | None = None) -> dict[str, Any]:
    """A Compose application whose only profile needs `cores` (and `memory`, `storage`)."""
    doc = app(APP, version, revision=version, parameters=COMPOSE_ONLY)
    capacity: dict[str, Any] = {"cpu": {"cores": cores}}
    if memory:
        capacity["memory"] = memory
    if storage:
        capacity["storage"] = storage
    doc["deploymentProfiles"] = [{**doc["deploymentProfiles"][1],
                                  "deviceConstraints": {"capacityRequirements": capacity}}]
    return doc


def box(cores: float, memory: str = "8Gi", generation: str = "rc.3") -> dict[str, Any]:
    """The box's report as a client of `generation` writes it: its files are written in
    that generation's shape, and each says what it takes in its own way (rc.3 and rc.2 in
    the file, Oct-2024 through the profile it holds: `compiler.storedfiles`)."""
    return shape_capabilities(device("box", cores=cores, memory=memory, types=("compose",)),
                              generation)


def fleet_of(tmp_path: Path, *names: str, cores: float, generation: str = "rc.3",
             **spec: Any) -> Fleet:
    """Intents `names` of the application's version 1.0.0 (1 core) on one box."""
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps[APP] = description("1.0.0", 1)
    for name in names:
        fleet.intents[name] = intent(name, APP, **spec.get(name, {}))
    fleet.devices["box"] = box(cores, generation=generation)
    return fleet


def release(fleet: Fleet, version: str, cores: float, **kw: Any) -> None:
    """Version `version` of the application joins the source (the newest: every intent
    without a version moves to it)."""
    fleet.raw_files[f"apps/{APP}/{version}/margo.yaml"] = canonical_yaml(
        description(version, cores, **kw)).decode()


def versions(fleet: Fleet) -> dict[str, str]:
    """Intent -> the component revision (= application version) its file on the box has."""
    out = {}
    for name, data in fleet.tree("box").items():
        doc = yaml.safe_load(data)
        out[name.removesuffix(".yaml")] = doc["spec"]["deploymentProfile"]["components"][0][
            "properties"]["revision"]
    return out


def notes(report: Any) -> list[str]:
    return [n for r in report.results if r.device_id == "box" for n in r.notes]


def changes(report: Any) -> list[tuple[str, str]]:
    return [(c.action, c.intent) for r in report.results for c in r.changes]


@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_upgrade_that_no_longer_fits_is_held_at_its_version(tmp_path: Path,
                                                               generation: str) -> None:
    """The issue's case: two 1-core deployments on 2 cores; the next version needs 1.5."""
    fleet = fleet_of(tmp_path, "x", "y", cores=2, generation=generation)
    fleet.compile(now=1_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "1.0.0"}
    assert {detect(yaml.safe_load(data)).shape for data in fleet.tree("box").values()} == {
        generation}
    release(fleet, "2.0.0", 1.5)
    report = fleet.compile(now=2_000)
    assert not report.errors
    assert changes(report) == []  # nothing moves: 1.5 + 1 cores do not fit in 2
    assert versions(fleet) == {"x": "1.0.0", "y": "1.0.0"}
    assert notes(report) == [
        "x: held at 1.0.0: the new version needs 1.5 cores; the device has 2, of which 1 is "
        "assigned to y",
        "y: held at 1.0.0: the new version needs 1.5 cores; the device has 2, of which 1 is "
        "assigned to x"]
    # Compiled again with nothing changed: still held, nothing committed.
    assert fleet.compile(now=3_000).commits == 0
    # Capacity added: both move on.
    fleet.devices["box"] = box(3, generation=generation)
    report = fleet.compile(now=4_000)
    assert changes(report) == [("update", "x"), ("update", "y")]
    assert versions(fleet) == {"x": "2.0.0", "y": "2.0.0"}
    assert notes(report) == []


def test_the_order_of_new_placements_decides_which_upgrade_fits(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2.5)
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    report = fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "2.0.0", "y": "1.0.0"}  # by name: x first
    assert notes(report) == ["y: held at 1.0.0: the new version needs 1.5 cores; the device "
                             "has 2.5, of which 1.5 are assigned to x"]
    # A higher priority orders decisions, but never preempts: x keeps its 1.5 cores.
    fleet.intents["y"]["spec"]["priority"] = 5
    report = fleet.compile(now=3_000)
    assert versions(fleet) == {"x": "2.0.0", "y": "1.0.0"}
    # x deleted: y moves on in the same compile.
    del fleet.intents["x"]
    report = fleet.compile(now=4_000)
    assert changes(report) == [("remove", "x"), ("update", "y")]
    assert versions(fleet) == {"y": "2.0.0"}


def test_priority_decides_which_upgrade_goes_first(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2.5, y={"priority": 5})
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "2.0.0"}


def test_a_shrinking_change_is_never_held(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2)
    fleet.compile(now=1_000)
    fleet.devices["box"] = box(1)  # the box shrank under both: they stay (never evicted)
    fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "1.0.0"}
    release(fleet, "2.0.0", 0.5)  # takes less: moves on although nothing fits
    report = fleet.compile(now=3_000)
    assert versions(fleet) == {"x": "2.0.0", "y": "2.0.0"}
    assert notes(report) == []


def test_overcommit_intents_are_never_held(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2, x={"overcommit": True})
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    report = fleet.compile(now=2_000)
    # x takes nothing and is never held; y sees only itself: 1.5 fits in 2.
    assert versions(fleet) == {"x": "2.0.0", "y": "2.0.0"}
    assert notes(report) == []


def test_a_held_upgrade_counts_at_what_the_version_it_runs_takes(tmp_path: Path) -> None:
    """New placements see the held deployment at 1 core, not at the 1.5 it waits for."""
    fleet = fleet_of(tmp_path, "x", cores=2)
    fleet.intents["z"] = intent("z", APP, application={"id": APP, "version": "1.0.0"})
    fleet.compile(now=1_000)
    assert versions(fleet) == {"x": "1.0.0", "z": "1.0.0"}
    release(fleet, "2.0.0", 1.5)
    fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "1.0.0", "z": "1.0.0"}  # x held: z holds 1 of 2
    del fleet.intents["z"]
    fleet.intents["w"] = intent("w", APP, application={"id": APP, "version": "1.0.0"})
    report = fleet.compile(now=3_000)
    # z's core is free, and w is decided before x (by name): w takes it.
    assert versions(fleet) == {"w": "1.0.0", "x": "1.0.0"}
    assert notes(report) == ["x: held at 1.0.0: the new version needs 1.5 cores; the device "
                             "has 2, of which 1 is assigned to w"]


def test_an_intent_edit_that_raises_the_demand_is_held_too(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2.5, x={"application": {"id": APP,
                                                                       "version": "1.0.0"}})
    release(fleet, "2.0.0", 1.5)
    fleet.compile(now=1_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "2.0.0"}
    fleet.intents["x"]["spec"]["application"]["version"] = "2.0.0"
    report = fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "2.0.0"}
    assert notes(report) == ["x: held at 1.0.0: the new version needs 1.5 cores; the device "
                             "has 2.5, of which 1.5 are assigned to y"]
    # Pinned back: the change is gone, and so is the hold.
    fleet.intents["x"]["spec"]["application"]["version"] = "1.0.0"
    report = fleet.compile(now=3_000)
    assert notes(report) == [] and changes(report) == []


@pytest.mark.parametrize("generation", GENERATIONS)
def test_held_upgrades_decide_the_same_from_scratch(tmp_path: Path, generation: str) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2.5, generation=generation)
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    fleet.compile(now=2_000)
    fleet.intents["y"]["spec"]["parameters"] = {"greeting": "changed"}  # held stays held
    fleet.compile(now=3_000)
    incremental = fleet.tree("box")
    assert yaml.safe_load(incremental["y.yaml"])["spec"]["parameters"]["greeting"][
        "value"] == "hello"
    (fleet.repos / "compiler-state.sqlite").unlink()
    assert fleet.compile(now=4_000).commits == 0
    assert fleet.tree("box") == incremental
    # The library, with the device's files only (the server's read API), says the same.
    files = {n.removesuffix(".yaml"): d for n, d in incremental.items()}
    by_name = {e.intent: e for e in explain_device(
        load_source(fleet.source), load_snapshot(fleet.caps), "box", placed=files)}
    assert (by_name["y"].status, by_name["y"].held_at) == ("held for capacity", "1.0.0")
    assert by_name["y"].assigned == {"cpu": 1}


def test_explain_plan_and_compile_say_why_it_is_held(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, "x", "y", cores=2.5)
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    fleet.write()
    paths = ["--source", str(fleet.source), "--capabilities", str(fleet.caps),
             "--repos", str(fleet.repos)]
    plan = margo("plan", *paths)
    assert plan.returncode == 0, plan.stderr
    assert "  update      x.yaml (application version 1.0.0 -> 2.0.0)" in plan.stdout
    assert ("  note        y: held at 1.0.0: the new version needs 1.5 cores; the device has "
            "2.5, of which 1.5 are assigned to x") in plan.stdout
    assert "y.yaml" not in plan.stdout
    compiled = margo("compile", *paths)
    assert compiled.returncode == 0, compiled.stderr
    assert "box: y: held at 1.0.0: the new version needs 1.5 cores" in compiled.stdout
    again = margo("plan", *paths)
    assert "  note        y: is held for capacity (margo explain --device box says why)" \
        in again.stdout
    explained = json.loads(margo("explain", *paths, "--device", "box", "--json").stdout)
    states = {e["intent"]: e for e in explained["intents"]}
    assert states["x"]["status"] == "eligible"
    assert states["y"]["status"] == "held for capacity"
    assert states["y"]["heldAt"] == "1.0.0"
    assert [f["message"] for f in states["y"]["capacity"]] == [
        "needs 1.5 cores; the device has 2.5, of which 1.5 are assigned to x"]
    text = margo("explain", *paths, "--device", "box", "--intent", "y").stdout
    assert ("    - held at 1.0.0: the new version needs 1.5 cores; the device has 2.5, of "
            "which 1.5 are assigned to x") in text.splitlines()
    # The library, with the device's files, says the same.
    files = {n.removesuffix(".yaml"): d for n, d in fleet.tree("box").items()}
    by_name = {e.intent: e for e in explain_device(
        load_source(fleet.source), load_snapshot(fleet.caps), "box", placed=files)}
    assert by_name["y"].status == "held for capacity"
    assert by_name["x"].assigned == {"cpu": 1.5}
    assert by_name["y"].assigned == {"cpu": 1}


def test_assigned_never_exceeds_reported_after_an_upgrade(tmp_path: Path) -> None:
    """Memory too: the upgrade needs more memory than is left."""
    fleet = fleet_of(tmp_path, "x", "y", cores=4)
    fleet.devices["box"] = box(4, memory="1Gi")
    fleet.apps[APP] = description("1.0.0", 1, memory="512Mi")
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1, memory="768Mi")
    report = fleet.compile(now=2_000)
    assert versions(fleet) == {"x": "1.0.0", "y": "1.0.0"}
    assert notes(report)[0] == ("x: held at 1.0.0: the new version needs 768Mi memory; the "
                                "device has 1Gi, of which 512Mi is assigned to y")


def margo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=120)


def test_a_rollout_does_not_move_a_device_whose_upgrade_is_held(tmp_path: Path) -> None:
    from compiler.rollout import RolloutPlan

    fleet = fleet_of(tmp_path, "x", "y", cores=2.5,
                     y={"rollout": {"waves": [{"name": "all"}]}})
    fleet.devices["roomy"] = {**box(8), "properties": {**box(8)["properties"], "id": "roomy"}}
    fleet.compile(now=1_000)
    release(fleet, "2.0.0", 1.5)
    report = fleet.compile(now=2_000, rollouts={"y": RolloutPlan("r2", "progressing",
                                                                 open_wave=0)})
    # The wave is open: roomy moves, box's upgrade of y is held and box is not moved.
    assert set(report.rollout_moves["y"]) == {"roomy"}
    assert versions(fleet) == {"x": "2.0.0", "y": "1.0.0"}
    assert any(n.startswith("y: held at 1.0.0") for n in notes(report))


def test_an_upgrade_that_frees_room_lets_an_earlier_waiting_one_in_at_once(
        tmp_path: Path) -> None:
    """Found by the sequence property test: d0's upgrade needs storage instead of memory;
    a1, decided before it by name, waited for that memory. Both must be settled in one
    compile, or compiling the same inputs again places a1."""
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps[APP] = description("1.0.0", 0.5, memory="1Gi")
    fleet.apps["com-example-small"] = {**description("1.0.0", 0.5, memory="512Mi"),
                                       "id": "com-example-small"}
    fleet.intents["d0"] = intent("d0", APP)
    fleet.devices["box"] = box(2, memory="1Gi")
    fleet.compile(now=1_000)
    fleet.intents["a1"] = intent("a1", "com-example-small")
    fleet.compile(now=2_000)
    assert versions(fleet) == {"d0": "1.0.0"}  # a1 waits for memory
    release(fleet, "2.0.0", 0.5, storage="1Gi")  # storage instead of memory: it grows
    report = fleet.compile(now=3_000)
    assert versions(fleet) == {"a1": "1.0.0", "d0": "2.0.0"}
    assert notes(report) == []
    assert fleet.compile(now=4_000).commits == 0
