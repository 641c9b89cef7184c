"""Each device in its own generation (issue 33): a device's documents are written in the
shape of the spec generation it speaks (what the server saw its client use, else the shape
of its capability report) unless an intent forces one; what a shape cannot hold is a
located problem on that device, never a crash or a wrong document; the device client reads
every shape as the same deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kits.fleetkit import Fleet, app, device, intent
from kits.serverkit import assert_deployment_in_generation

from compiler.compilation import CompileReport, compile_fleet
from compiler.gitstore import DeviceStore
from compiler.snapshot import ReportedDocuments, snapshot_from_documents
from compiler.source import load_source
from compiler.state import CompilerState
from compiler.storedfiles import StoredFiles
from margo.kinds import GENERATIONS
from margo.schemas import validator_for
from reconciler.capabilities import shape_capabilities
from reconciler.desired import parse_deployment

APP = "com-example-app"
CONSTRAINTS = {"capacityRequirements": {"cpu": {"cores": 1}, "memory": "512Mi"}}


def reported(device_id: str, generation: str, **options: Any) -> dict[str, Any]:
    """A device's capability report as a client of `generation` writes it (rc.2: with
    apiVersion and kind; Oct-2024: roles and resources), which is all an offline compile
    tells its generation by."""
    return shape_capabilities(device(device_id, **options), generation)


def compile_reported(fleet: Fleet, generations: dict[str, str]) -> CompileReport:
    """Compile as the fleet server does: the stored documents with the generation each
    device's client spoke (`ReportedDocuments`), through the compiler's state."""
    fleet.write()
    fleet.repos.mkdir(parents=True, exist_ok=True)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        snapshot = snapshot_from_documents(ReportedDocuments(fleet.devices, generations),
                                           trusted=state.trusted_digests())
        return compile_fleet(load_source(fleet.source), snapshot, DeviceStore(fleet.repos),
                             state)
    finally:
        state.close()


def generation_fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps[APP] = app(APP, constraints=CONSTRAINTS)
    fleet.intents["hello"] = intent("hello", APP, parameters={"greeting": "{{ device.id }}"})
    fleet.intents["forced"] = intent("forced", APP, outputShape="rc.2",
                                     namespace="forced")
    for generation in GENERATIONS:
        fleet.devices[f"box-{generation}"] = reported(f"box-{generation}", generation)
    return fleet


def test_each_device_gets_documents_in_its_generations_shape(tmp_path: Path) -> None:
    fleet = generation_fleet(tmp_path / "a")
    assert fleet.compile().errors == []
    read = {}
    for generation in GENERATIONS:
        tree = fleet.tree(f"box-{generation}")
        assert_deployment_in_generation(generation, tree["hello.yaml"])
        assert_deployment_in_generation("rc.2", tree["forced.yaml"])  # the intent decides
        desired = parse_deployment(tree["hello.yaml"])
        read[generation] = (desired.name, desired.namespace, desired.application_id,
                            desired.profile_type,
                            [(c.name, c.repository, c.revision, c.wait, c.timeout_seconds,
                              c.spec_digest, c.extensions) for c in desired.components],
                            desired.components[0].values["config"]["greeting"])
    # The device client reads every shape as the same deployment (but for its own id).
    assert all(value[:5] == read["rc.3"][:5] for value in read.values())
    assert {generation: value[5] for generation, value in read.items()} == {
        g: f"box-{g}" for g in GENERATIONS}
    # rc.2 files say what they take (in our extension); Oct-2024 files cannot.
    stored = StoredFiles()
    rc2 = stored.constraints(fleet.tree("box-rc.2")["hello.yaml"])
    assert rc2 is not None and rc2 == stored.constraints(fleet.tree("box-rc.3")["hello.yaml"])
    assert stored.constraints(fleet.tree("box-oct-2024")["hello.yaml"]) is None
    # Deterministic: the same inputs compiled from scratch elsewhere give the same bytes,
    # and compiling again changes nothing.
    again = generation_fleet(tmp_path / "b")
    again.compile()
    for name in fleet.devices:
        assert again.tree(name) == fleet.tree(name)
    assert [r.status for r in fleet.compile(now=2_000_000.0).results
            if r.status != "unchanged"] == []


def test_the_generation_the_server_saw_decides_and_a_move_rewrites_the_documents(
        tmp_path: Path) -> None:
    """Our rc.2 client reports labels, so its document reads as rc.3: the server knows
    better (the API it called). A device whose client moves to another generation gets its
    documents rewritten at the next compile, its report unchanged; a generation the
    compiler does not know is ignored (the report's shape decides)."""
    fleet = Fleet(tmp_path)
    fleet.apps[APP] = app(APP)
    fleet.intents["hello"] = intent("hello", APP)
    fleet.devices["box"] = shape_capabilities(device("box", labels={"site": "a"}), "rc.2")
    steps = [("rc.2", "rc.2"), ("rc.2", "rc.2"), ("rc.3", "rc.3"), ("oct-2024", "oct-2024"),
             ("rc.9", "rc.3")]
    for told, shape in steps:
        report = compile_reported(fleet, {"box": told})
        assert report.errors == []
        assert_deployment_in_generation(shape, fleet.tree("box")["hello.yaml"])
    assert [r.status for r in compile_reported(fleet, {"box": "rc.9"}).results] == []


def test_what_a_generation_cannot_hold_is_a_located_problem_on_that_device(
        tmp_path: Path) -> None:
    """A `custom` profile exists in rc.3 only: an rc.2 or Oct-2024 device (or an intent
    forcing their shape) gets a problem naming the device and why, and keeps what it had;
    the rc.3 device gets its document."""
    fleet = Fleet(tmp_path)
    custom = app(APP, compose=False, parameters={"greeting": {"value": "hi", "targets": [
        {"pointer": "config.greeting", "components": ["web"]}]}})
    custom["deploymentProfiles"][0]["type"] = "custom"
    fleet.apps[APP] = custom
    fleet.intents["own"] = intent("own", APP)
    fleet.intents["forced"] = intent("forced", APP, outputShape="oct-2024")
    for generation in GENERATIONS:
        fleet.devices[f"box-{generation}"] = device(f"box-{generation}", types=("custom",))
    report = compile_reported(fleet, {f"box-{g}": g for g in GENERATIONS})
    found = sorted((device_id, problem.path[:2], problem.message)
                   for device_id, problem in report.errors)
    assert [(d, p) for d, p, _ in found] == [
        ("box-oct-2024", ("spec", "application")), ("box-oct-2024", ("spec", "outputShape")),
        ("box-rc.2", ("spec", "application")), ("box-rc.2", ("spec", "outputShape")),
        ("box-rc.3", ("spec", "outputShape"))]
    assert "on device box-rc.2: the profile is of type custom, which rc.2 documents cannot " \
           "hold (the device speaks rc.2)" in found[2][2]
    assert "this intent's outputShape asks for oct-2024" in found[4][2]
    assert all(problem.file and problem.file.endswith(".yaml") for _, problem in report.errors)
    assert fleet.tree("box-rc.2") == {}  # nothing written for the device
    # (Our rc.3 schema only: the official rc.3 OpenAPI lists custom deployment types for
    # devices but not for profiles, docs/spec-interpretation.md.)
    own = yaml.safe_load(fleet.tree("box-rc.3")["own.yaml"])
    assert list(validator_for("ApplicationDeployment", "rc.3").iter_errors(own)) == []
    assert own["spec"]["deploymentProfile"]["type"] == "custom"
