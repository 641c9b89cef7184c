"""One intent's error is that intent's alone (issue 28): an intent whose parameters fail on a
device keeps the file it had there (or gets none), its problem is reported, and the device's
other intents are placed, updated and removed as usual. Real compiles through the Git store
and state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kits.fleetkit import Fleet, app, device, intent

ROOT = Path(__file__).resolve().parents[2]
APP = "com-example-app"
HELM_ONLY = {"greeting": {"value": "hello", "targets": [{"pointer": "config.greeting",
                                                          "components": ["web"]}]}}
#: Fails where the device's `slots` label is 0 (division by zero in the sandbox).
PER_SLOT = "{{ 'one in ' ~ (10 // device.labels['slots']) }}"


def fleet_of(tmp_path: Path, *, slots: int, cores: float = 4) -> Fleet:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps[APP] = app(APP, constraints={"capacityRequirements": {"cpu": {"cores": 1}}},
                          compose=False, parameters=HELM_ONLY)
    for name in ("bad", "edited", "gone"):
        fleet.intents[name] = intent(name, APP)
    fleet.devices["box"] = device("box", cores=cores, labels={"slots": slots})
    fleet.devices["other"] = device("other", cores=cores, labels={"slots": 2})
    return fleet


def greeting(fleet: Fleet, device_id: str, name: str) -> Any:
    return yaml.safe_load(fleet.tree(device_id)[f"{name}.yaml"])["spec"]["parameters"][
        "greeting"]["value"]


def test_a_failing_expression_freezes_only_its_intent(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, slots=0)
    fleet.compile(now=1_000)
    bad_before = fleet.tree("box")["bad.yaml"]
    fleet.intents["bad"]["spec"]["parameters"] = {"greeting": PER_SLOT}
    fleet.intents["edited"]["spec"]["parameters"] = {"greeting": "edited"}
    del fleet.intents["gone"]
    fleet.intents["added"] = intent("added", APP)
    report = fleet.compile(now=2_000)
    # The error: located in the intent's file, naming the device.
    [(device_id, problem)] = report.errors
    assert device_id == "box"
    assert problem.file is not None and problem.file.endswith("deployments/bad.yaml")
    assert problem.json_path == "$.spec.parameters.greeting"
    assert "on device box" in problem.message
    # The device's other intents moved on, and were committed.
    box = next(r for r in report.results if r.device_id == "box")
    assert box.status == "committed"
    assert sorted((c.action, c.intent) for c in box.changes) == [
        ("add", "added"), ("reconfigure", "edited"), ("remove", "gone")]
    assert sorted(fleet.tree("box")) == ["added.yaml", "bad.yaml", "edited.yaml"]
    assert fleet.tree("box")["bad.yaml"] == bad_before  # the bad one keeps its file
    assert greeting(fleet, "box", "edited") == "edited"
    assert "bad: keeps its file: it cannot be rendered for this device (see the errors)" \
        in box.notes
    assert greeting(fleet, "other", "bad") == "one in 5"
    # Reported again on every compile while it fails (the source condition stays invalid).
    again = fleet.compile(now=3_000)
    assert [d for d, _ in again.errors] == ["box"] and again.commits == 0
    # Fixed: it moves on.
    fleet.devices["box"]["labels"] = {"slots": 1}
    fixed = fleet.compile(now=4_000)
    assert fixed.errors == [] and greeting(fleet, "box", "bad") == "one in 10"


def test_a_new_intent_that_fails_gets_no_file_and_the_rest_is_placed(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, slots=0)
    fleet.intents["bad"]["spec"]["parameters"] = {"greeting": PER_SLOT}
    report = fleet.compile(now=1_000)
    assert [d for d, _ in report.errors] == ["box"]
    assert sorted(fleet.tree("box")) == ["edited.yaml", "gone.yaml"]
    assert sorted(fleet.tree("other")) == ["bad.yaml", "edited.yaml", "gone.yaml"]


def test_a_kept_file_still_takes_its_share(tmp_path: Path) -> None:
    """2 cores: bad and edited hold one each; bad fails now and keeps its file, so a new
    intent waits instead of taking bad's core."""
    fleet = fleet_of(tmp_path, slots=0, cores=2)
    del fleet.intents["gone"]
    fleet.compile(now=1_000)
    fleet.intents["bad"]["spec"]["parameters"] = {"greeting": PER_SLOT}
    fleet.intents["added"] = intent("added", APP)
    report = fleet.compile(now=2_000)
    assert sorted(fleet.tree("box")) == ["bad.yaml", "edited.yaml"]
    box = next(r for r in report.results if r.device_id == "box")
    assert "added: waits for capacity: needs 1 core; the device has 2, of which 2 are " \
           "assigned to bad, edited" in box.notes


def test_plan_and_compile_print_the_error_and_the_other_changes(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, slots=0)
    fleet.compile(now=1_000)
    fleet.intents["bad"]["spec"]["parameters"] = {"greeting": PER_SLOT}
    fleet.intents["edited"]["spec"]["parameters"] = {"greeting": "edited"}
    fleet.write()
    paths = ["--source", str(fleet.source), "--capabilities", str(fleet.caps),
             "--repos", str(fleet.repos)]
    plan = margo("plan", *paths)
    assert plan.returncode == 1  # errors
    assert "deployments/bad.yaml" in plan.stderr + plan.stdout
    assert "on device box" in plan.stderr + plan.stdout
    assert "no changes" not in plan.stdout
    assert "  reconfigure edited.yaml (intent edited)" in plan.stdout
    compiled = margo("compile", *paths)
    assert compiled.returncode == 1
    assert "box: reconfigure edited" in compiled.stdout
    assert greeting(fleet, "box", "edited") == "edited"


def test_a_failing_expression_is_one_problem_not_also_a_missing_value(tmp_path: Path) -> None:
    """A required, immutable setting whose expression fails on a device: the expression's
    error is the one problem (no "a value is required", no "cannot be removed" for the value
    it could not give), in the compile report and in `margo explain`."""
    fleet = fleet_of(tmp_path, slots=1)
    fleet.apps[APP] = app(APP, compose=False, parameters=HELM_ONLY, schema=[
        {"name": "text", "dataType": "string", "minLength": 1, "allowEmpty": False}],
        settings=[{"parameter": "greeting", "name": "Greeting", "schema": "text",
                   "immutable": True}])
    fleet.intents["bad"]["spec"]["parameters"] = {"greeting": PER_SLOT}
    assert fleet.compile(now=1_000).errors == []
    assert greeting(fleet, "box", "bad") == "one in 10"
    fleet.devices["box"]["labels"] = {"slots": 0}
    report = fleet.compile(now=2_000)
    [(device_id, problem)] = report.errors
    assert device_id == "box" and problem.message == "on device box: division by zero", \
        problem
    fleet.write()
    explained = margo("explain", "--source", str(fleet.source), "--capabilities",
                      str(fleet.caps), "--repos", str(fleet.repos), "--device", "box",
                      "--intent", "bad")
    assert explained.returncode == 0, explained.stderr
    assert [line for line in explained.stdout.splitlines() if "$.spec.parameters" in line] \
        == [f"    - {problem.format()}"], explained.stdout


def margo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=120)
