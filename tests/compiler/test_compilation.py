"""The compiler end to end, through real files, the real Git store and SQLite state."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kits.fleetkit import Fleet, app, device, intent

from compiler.context import source_problems
from compiler.explain import explain_device
from compiler.gitstore import DeviceStore
from compiler.render import deployment_id
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from margo.validation import validate_document

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden-fleet"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    f = Fleet(tmp_path)
    f.apps["com-example-app"] = app(constraints={"capacityRequirements": {"memory": "4Gi"}})
    f.intents["everywhere"] = intent("everywhere", namespace="demo")
    f.devices["k8s-a"] = device("k8s-a", labels={"site": "a"})
    f.devices["k8s-b"] = device("k8s-b", memory="2Gi", labels={"site": "b"})
    f.devices["box-c"] = device("box-c", types=("compose",), labels={"site": "c"})
    return f


def test_example_fleet_matches_the_golden_trees(tmp_path: Path) -> None:
    """The example fleet compiles to exactly the committed trees, byte for byte."""
    fleet = Fleet(tmp_path)
    store_root = tmp_path / "repos"
    result = subprocess.run(
        [".venv/bin/margo" if Path(".venv/bin/margo").exists() else "margo", "compile",
         "--source", str(EXAMPLES / "fleet"), "--capabilities", str(EXAMPLES / "capabilities"),
         "--repos", str(store_root)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], check=False)
    assert result.returncode == 0, result.stderr
    store = fleet.store
    actual = {d: store.read_files(d) or {} for d in store.device_ids()}
    if os.environ.get("UPDATE_GOLDEN"):
        shutil.rmtree(GOLDEN, ignore_errors=True)
        for device_id, files in actual.items():
            (GOLDEN / device_id).mkdir(parents=True)
            (GOLDEN / device_id / ".keep").write_text("")
            for name, data in files.items():
                (GOLDEN / device_id / name).write_bytes(data)
    expected = {d.name: {f.name: f.read_bytes() for f in d.iterdir() if f.name != ".keep"}
                for d in GOLDEN.iterdir()}
    assert actual == expected
    for files in actual.values():
        for name, data in files.items():
            assert validate_document(data, file=name).valid


def test_two_compiles_of_the_same_inputs_give_identical_trees(tmp_path: Path) -> None:
    trees = []
    for attempt in ("one", "two"):
        fleet = Fleet(tmp_path / attempt)
        fleet.apps["com-example-app"] = app()
        fleet.intents["everywhere"] = intent("everywhere", parameters={
            "greeting": "hi {{ device.labels['site'] }}"})
        for i in range(5):
            fleet.devices[f"d{i}"] = device(f"d{i}", labels={"site": f"s{i}"})
        fleet.compile(now=1_000_000 + (attempt == "two") * 5000)
        trees.append({d: (fleet.store.tree_ids(d)) for d in fleet.store.device_ids()})
    assert trees[0] == trees[1]


def test_profiles_follow_the_device_type_and_constraints(fleet: Fleet) -> None:
    report = fleet.compile()
    assert (report.devices, report.commits, report.errors) == (3, 3, [])
    assert fleet.deployment("k8s-a", "everywhere")["spec"]["deploymentProfile"]["type"] == "helm"
    compose = fleet.deployment("box-c", "everywhere")
    assert compose["spec"]["deploymentProfile"]["type"] == "compose"
    assert compose["spec"]["parameters"]["greeting"]["targets"] == [
        {"pointer": "GREETING", "components": ["web-compose"]}]
    assert fleet.tree("k8s-b") == {}  # not enough memory: nothing, but the branch exists
    doc = fleet.deployment("k8s-a", "everywhere")
    assert doc["id"] == deployment_id("everywhere", "k8s-a")
    assert doc["metadata"] == {"name": "everywhere", "namespace": "demo", "deviceId": "k8s-a",
                               "labels": {"margo-gitops.dev/intent": "everywhere"}}
    assert doc["spec"]["deploymentProfile"]["deviceConstraints"] == {
        "capacityRequirements": {"memory": "4Gi"}}


def test_no_op_recompile_commits_nothing_and_skips_every_device(fleet: Fleet) -> None:
    fleet.compile()
    tips = {d: fleet.store.tip(d) for d in fleet.store.device_ids()}
    report = fleet.compile(now=2_000_000)
    assert (report.commits, report.unchanged, report.results) == (0, 3, [])
    assert {d: fleet.store.tip(d) for d in fleet.store.device_ids()} == tips


def test_a_new_compiler_version_evaluates_every_device_again(fleet: Fleet) -> None:
    """Remembered placements are decisions of one compiler version: a newer one (which may
    match differently) must not reuse them, but it rewrites nothing that did not change."""
    import sqlite3

    fleet.compile()
    tips = {d: fleet.store.tip(d) for d in fleet.store.device_ids()}
    with sqlite3.connect(fleet.repos / "compiler-state.sqlite") as conn:
        conn.execute("UPDATE meta SET value = 'an older compiler' WHERE key = 'compiler_version'")
    report = fleet.compile(now=2_000_000)
    assert len(report.results) == 3 and report.commits == 0  # re-evaluated, same trees
    assert {d: fleet.store.tip(d) for d in fleet.store.device_ids()} == tips
    assert fleet.compile(now=3_000_000).results == []  # and remembered again


def test_editing_an_intent_updates_the_same_deployment(fleet: Fleet) -> None:
    fleet.compile()
    before = fleet.deployment("k8s-a", "everywhere")
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "bonjour"}
    report = fleet.compile(now=2_000_000)
    after = fleet.deployment("k8s-a", "everywhere")
    assert after["id"] == before["id"]
    assert after["spec"]["parameters"]["greeting"]["value"] == "bonjour"
    change = next(r for r in report.results if r.device_id == "k8s-a").changes[0]
    assert (change.action, change.reasons) == ("reconfigure", ("intent edited",))
    history = fleet.store.history("k8s-a")
    assert len(history) == 2 and history[0].parent == history[1].id
    assert "reconfigure everywhere" in history[0].message
    assert "- everywhere.yaml: reconfigure (intent edited)" in history[0].message


def test_a_new_application_version_is_an_update_with_its_reason(fleet: Fleet) -> None:
    fleet.compile()
    fleet.apps["com-example-app"] = app(version="1.1.0", revision="1.1.0",
                                        constraints={"capacityRequirements": {"memory": "4Gi"}})
    report = fleet.compile(now=2_000_000)
    change = next(r for r in report.results if r.device_id == "k8s-a").changes[0]
    assert change.action == "update"
    assert change.reasons == ("application version 1.0.0 -> 1.1.0",)
    components = fleet.deployment("k8s-a", "everywhere")["spec"]["deploymentProfile"]
    assert components["components"][0]["properties"]["revision"] == "1.1.0"


def test_capability_changes_add_and_remove_deployments(fleet: Fleet) -> None:
    fleet.compile()
    fleet.devices["k8s-b"] = device("k8s-b", memory="16Gi", labels={"site": "b"})
    report = fleet.compile(now=2_000_000)
    [result] = report.results
    assert result.device_id == "k8s-b"
    assert [(c.action, c.reasons) for c in result.changes] == [
        ("add", ("device became eligible",))]
    fleet.devices["k8s-b"] = device("k8s-b", memory="3.5Gi", labels={"site": "b"})
    report = fleet.compile(now=3_000_000)
    [change] = report.results[0].changes
    assert change.action == "remove"
    assert "device no longer eligible" in change.reasons[0]
    assert "needs 4Gi memory, has 3.5Gi" in change.reasons[0]
    assert fleet.tree("k8s-b") == {}
    assert "needs 4Gi memory, has 3.5Gi" in fleet.store.history("k8s-b")[0].message


def test_grace_period_keeps_a_deployment_while_capabilities_flap(fleet: Fleet) -> None:
    fleet.intents["everywhere"]["spec"]["gracePeriod"] = "10m"
    fleet.compile(now=1_000_000)
    fleet.devices["k8s-a"] = device("k8s-a", memory="2Gi", labels={"site": "a"})
    report = fleet.compile(now=1_000_100)
    assert "everywhere.yaml" in fleet.tree("k8s-a")
    [result] = report.results
    assert result.notes and "kept for the grace period, 600s left" in result.notes[0]
    assert report.commits == 0
    # Still within the grace period: still there, and re-evaluated every compile.
    report = fleet.compile(now=1_000_500)
    assert "everywhere.yaml" in fleet.tree("k8s-a")
    # Expired: removed, and the message says why.
    report = fleet.compile(now=1_000_700)
    assert "everywhere.yaml" not in fleet.tree("k8s-a")
    assert "grace period of 600s expired" in report.results[0].changes[0].reasons[0]


def test_explained_with_the_devices_files_a_kept_deployment_is_in_its_grace_period(
        fleet: Fleet) -> None:
    """The server's read API (and `margo explain --url`) explains with the files the
    device's branch holds and without the compiler's records: a deployment kept there for
    its grace period was explained as merely "not eligible" (found by the device matrix,
    tests/matrix/test_matrix_reeligibility.py)."""
    def explained() -> tuple[str, str | None]:
        files = {n.removesuffix(".yaml"): d for n, d in fleet.tree("k8s-a").items()}
        [found] = explain_device(load_source(fleet.source), load_snapshot(fleet.caps),
                                 "k8s-a", intent_name="everywhere", placed=files)
        return found.status, found.note

    fleet.intents["everywhere"]["spec"]["gracePeriod"] = "10m"
    fleet.compile(now=1_000_000)
    fleet.devices["k8s-a"] = device("k8s-a", memory="2Gi", labels={"site": "a"})
    fleet.compile(now=1_000_100)
    assert explained() == ("grace period",
                           "still deployed: kept for the grace period of 600s")
    fleet.compile(now=1_000_700)  # expired: removed from the branch
    assert explained() == ("not eligible", None)


def test_grace_period_ends_when_the_device_recovers(fleet: Fleet) -> None:
    fleet.intents["everywhere"]["spec"]["gracePeriod"] = "10m"
    fleet.compile(now=1_000_000)
    fleet.devices["k8s-a"] = device("k8s-a", memory="2Gi", labels={"site": "a"})
    fleet.compile(now=1_000_100)
    fleet.devices["k8s-a"] = device("k8s-a", memory="8Gi", labels={"site": "a"})
    fleet.compile(now=1_000_200)
    fleet.devices["k8s-a"] = device("k8s-a", memory="2Gi", labels={"site": "a"})
    fleet.compile(now=1_000_650)  # a new flap: its own full grace period starts now
    assert "everywhere.yaml" in fleet.tree("k8s-a")


def test_targets_by_id_and_selector(fleet: Fleet) -> None:
    fleet.intents["pinned"] = intent("pinned", targets={"devices": ["k8s-b"]},
                                     profile={"type": "helm"})
    fleet.apps["com-example-app"] = app()  # no constraints
    fleet.intents["site-a"] = intent("site-a", targets={"selectors": [{"labelSelector": {
        "matchExpressions": [{"key": "site", "operator": "In", "values": ["a"]}]}}]})
    fleet.compile()
    assert set(fleet.tree("k8s-b")) == {"everywhere.yaml", "pinned.yaml"}
    assert set(fleet.tree("k8s-a")) == {"everywhere.yaml", "site-a.yaml"}
    assert set(fleet.tree("box-c")) == {"everywhere.yaml"}
    del fleet.intents["site-a"]
    report = fleet.compile(now=2_000_000)
    assert [(r.device_id, [(c.action, c.reasons) for c in r.changes]) for r in report.results
            if r.changes] == [("k8s-a", [("remove", ("intent deleted",))])]


def test_expressions_are_evaluated_per_device(fleet: Fleet) -> None:
    fleet.intents["everywhere"]["spec"]["parameters"] = {
        "greeting": "hello {{ device.labels['site'] | upper }} ({{ device.id }})"}
    fleet.compile()
    value = fleet.deployment("box-c", "everywhere")["spec"]["parameters"]["greeting"]["value"]
    assert value == "hello C (box-c)"


def test_invalid_parameter_values_keep_the_device_state(fleet: Fleet) -> None:
    schema = [{"name": "short", "dataType": "string", "maxLength": 8}]
    settings = [{"parameter": "greeting", "name": "Greeting", "schema": "short"}]
    fleet.apps["com-example-app"] = app(schema=schema, settings=settings)
    fleet.intents["everywhere"]["spec"]["parameters"] = {
        "greeting": "hi {{ device.labels['site'] }}"}
    fleet.compile()
    before = fleet.tree("k8s-a")
    fleet.devices["k8s-a"]["labels"] = {"site": "a-site-with-a-long-name"}
    fleet.devices["k8s-b"]["labels"] = {"site": "b2"}
    report = fleet.compile(now=2_000_000)
    assert fleet.tree("k8s-a") == before
    [(device_id, problem)] = report.errors
    assert device_id == "k8s-a"
    assert problem.file and problem.file.endswith("deployments/everywhere.yaml")
    assert problem.line and problem.json_path == "$.spec.parameters.greeting"
    assert "on device k8s-a" in problem.message and "at most 8" in problem.message
    assert fleet.deployment("k8s-b", "everywhere")["spec"]["parameters"]["greeting"][
        "value"] == "hi b2"
    # The failed device is retried on the next compile, and recovers when fixed.
    fleet.devices["k8s-a"]["labels"] = {"site": "a2"}
    report = fleet.compile(now=3_000_000)
    assert report.errors == []
    assert fleet.deployment("k8s-a", "everywhere")["spec"]["parameters"]["greeting"][
        "value"] == "hi a2"


def test_immutable_settings_cannot_change_once_deployed(fleet: Fleet) -> None:
    schema = [{"name": "text", "dataType": "string"}]
    settings = [{"parameter": "greeting", "name": "Greeting", "schema": "text",
                 "immutable": True}]
    fleet.apps["com-example-app"] = app(schema=schema, settings=settings)
    fleet.compile()
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "changed"}
    report = fleet.compile(now=2_000_000)
    assert {d for d, _ in report.errors} == {"k8s-a", "k8s-b", "box-c"}
    assert "immutable" in report.errors[0][1].message
    assert fleet.deployment("k8s-a", "everywhere")["spec"]["parameters"]["greeting"][
        "value"] == "hello"


def test_a_broken_intent_keeps_its_deployments_and_the_rest_compiles(fleet: Fleet) -> None:
    fleet.intents["other"] = intent("other")
    fleet.compile()
    everywhere = fleet.tree("k8s-a")["everywhere.yaml"]
    del fleet.intents["everywhere"]
    fleet.raw_files["deployments/everywhere.yaml"] = "apiVersion: [unclosed\n"
    fleet.intents["other"]["spec"]["namespace"] = "other-ns"
    report = fleet.compile(now=2_000_000)
    assert fleet.tree("k8s-a")["everywhere.yaml"] == everywhere
    assert yaml.safe_load(fleet.tree("k8s-a")["other.yaml"])["metadata"]["namespace"] == (
        "other-ns")
    [(device_id, problem)] = report.errors
    assert device_id is None and problem.file.endswith("deployments/everywhere.yaml")
    assert problem.line == 2 and "invalid YAML" in problem.message


def test_a_broken_descriptor_freezes_its_intents(fleet: Fleet) -> None:
    fleet.compile()
    before = fleet.tree("k8s-a")
    fleet.apps["com-example-app"]["deploymentProfiles"][0]["components"][0]["properties"][
        "revision"] = "v2"
    report = fleet.compile(now=2_000_000)
    assert fleet.tree("k8s-a") == before
    messages = [p.format() for _, p in report.errors]
    assert any("apps/com-example-app/margo.yaml:" in m and "revision" in m for m in messages)
    assert any("deployments/everywhere.yaml" in m and "has errors" in m for m in messages)


@pytest.mark.parametrize("unfreeze", ["same intent", "parameters fixed"])
def test_an_intent_unfrozen_is_evaluated_again(fleet: Fleet, unfreeze: str) -> None:
    """While an intent is frozen its devices keep their deployments and records, even when
    their capabilities change; once it is usable again, every device is evaluated afresh,
    never placed from a record made before the freeze (a device that lost eligibility in
    between loses the deployment)."""
    fleet.compile(now=1_000_000)
    assert "everywhere.yaml" in fleet.tree("k8s-a")
    good = fleet.intents["everywhere"]
    fleet.intents["everywhere"] = intent("everywhere", namespace="demo",
                                         parameters={"greting": "typo"})
    fleet.devices["k8s-a"]["properties"]["memory"] = "1Gi"  # no longer eligible
    report = fleet.compile(now=2_000_000)
    assert "everywhere.yaml" in fleet.tree("k8s-a")  # frozen: kept
    assert any("greting" in p.message for _, p in report.errors)
    fleet.intents["everywhere"] = good if unfreeze == "same intent" else intent(
        "everywhere", namespace="demo", parameters={"greeting": "fixed"})
    report = fleet.compile(now=3_000_000)
    assert not report.errors
    assert "everywhere.yaml" not in fleet.tree("k8s-a")


def test_unknown_parameters_and_applications_are_located_errors(fleet: Fleet) -> None:
    fleet.intents["typo"] = intent("typo", parameters={"greting": "x"})
    fleet.intents["missing"] = intent("missing", app_id="com-example-nope")
    report = fleet.compile()
    messages = [p.format() for _, p in report.errors]
    assert any("typo.yaml:" in m and "$.spec.parameters.greting" in m and
               "has no parameter 'greting'" in m for m in messages)
    assert any("missing.yaml:" in m and "no application com-example-nope" in m
               for m in messages)
    assert set(fleet.tree("k8s-a")) == {"everywhere.yaml"}


def test_a_literal_no_device_could_take_is_one_located_error_and_freezes_the_intent(
        fleet: Fleet) -> None:
    """A literal value breaking the application's configuration rule is found without any
    device (`compiler.context.source_problems`): one error located in the intent file, not
    one per device; the intent is frozen (devices keep what it gave them). Expressions are
    still checked per device."""
    schema = [{"name": "short", "dataType": "string", "maxLength": 8}]
    settings = [{"parameter": "greeting", "name": "Greeting", "schema": "short"}]
    fleet.apps["com-example-app"] = app(schema=schema, settings=settings)
    fleet.compile()
    before = fleet.tree("k8s-a")
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "far too long a text"}
    report = fleet.compile(now=2_000_000)
    [(device_id, problem)] = report.errors
    assert device_id is None
    assert problem.file and problem.file.endswith("deployments/everywhere.yaml")
    assert problem.line and problem.json_path == "$.spec.parameters.greeting"
    assert "at most 8" in problem.message and "on device" not in problem.message
    assert fleet.tree("k8s-a") == before
    assert [p.format() for p in source_problems(load_source(fleet.source))] == [
        problem.format()]
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "{{ device.id }} says hi"}
    report = fleet.compile(now=3_000_000)
    assert sorted(d for d, _ in report.errors) == ["box-c", "k8s-a", "k8s-b"]
    assert source_problems(load_source(fleet.source)) == []


def test_broken_capabilities_leave_the_device_alone(fleet: Fleet) -> None:
    fleet.compile()
    before = fleet.tree("k8s-a")
    fleet.devices["k8s-a"]["properties"]["memory"] = "plenty"
    report = fleet.compile(now=2_000_000)
    assert fleet.tree("k8s-a") == before
    assert any("memory" in p.json_path for _, p in report.errors)


def test_plan_writes_nothing(fleet: Fleet) -> None:
    fleet.compile()
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "plan"}
    tips = {d: fleet.store.tip(d) for d in fleet.store.device_ids()}
    report = fleet.compile(now=2_000_000, dry_run=True)
    assert {r.device_id for r in report.results if r.changes} == {"k8s-a", "box-c"}
    assert {d: fleet.store.tip(d) for d in fleet.store.device_ids()} == tips
    assert fleet.compile(now=3_000_000).commits == 2  # state was not advanced by the plan


def test_oct_2024_output_for_older_devices(fleet: Fleet) -> None:
    fleet.intents["everywhere"]["spec"]["outputShape"] = "oct-2024"
    fleet.compile()
    doc = fleet.deployment("k8s-a", "everywhere")
    assert doc["apiVersion"] == "application.margo.org/v1alpha1"
    assert doc["metadata"]["annotations"]["id"] == deployment_id("everywhere", "k8s-a")
    assert doc["spec"]["deploymentProfile"]["type"] == "helm.v3"


def test_losing_the_state_recompiles_without_new_commits(fleet: Fleet) -> None:
    fleet.compile()
    (fleet.repos / "compiler-state.sqlite").unlink()
    report = fleet.compile(now=2_000_000)
    assert (report.commits, report.unchanged) == (0, 3)


def test_update_versus_reconfigure_is_read_from_the_canonical_text() -> None:
    from compiler.specdiff import classify as _classify
    from compiler.specdiff import spec_sections as _spec_sections
    from margo.canonical import canonical_yaml

    base = {"id": "x", "metadata": {"name": "n", "namespace": "ns", "deviceId": "d"},
            "spec": {"applicationId": "a", "deploymentProfile": {
                "type": "helm", "components": [{"name": "c", "properties": {
                    "repository": "oci://r/c", "revision": "1.0.0"}}]},
                "parameters": {"p": {"value": 1, "targets": [
                    {"pointer": "a.b", "components": ["c"]}]}}}}

    def variant(change: object) -> bytes:
        import copy

        doc = copy.deepcopy(base)
        change(doc)  # type: ignore[operator]
        return canonical_yaml(doc)

    old = canonical_yaml(base)
    assert set(_spec_sections(old)) == {b"applicationId", b"deploymentProfile", b"parameters"}
    params = variant(lambda d: d["spec"]["parameters"]["p"].update(value=2))
    revision = variant(lambda d: d["spec"]["deploymentProfile"]["components"][0][
        "properties"].update(revision="1.1.0"))
    namespace = variant(lambda d: d["metadata"].update(namespace="other"))
    no_params = variant(lambda d: d["spec"].pop("parameters"))
    assert _classify(old, params) == "reconfigure"
    assert _classify(old, no_params) == "reconfigure"
    assert _classify(old, revision) == "update"
    assert _classify(old, namespace) == "update"
    assert _classify(b"not yaml", params) == "update"
    # Remembering answers by spec text gives the same answers, also for another device's
    # documents (same spec, other id and device) and for ones whose spec alone differs.
    memo: dict[tuple[bytes, bytes], str] = {}
    other_device = variant(lambda d: d["metadata"].update(deviceId="another"))
    for pair in [(old, params), (other_device, params), (old, revision), (old, namespace),
                 (b"not yaml", params), (old, params), (other_device, revision)]:
        assert _classify(*pair, memo) == _classify(*pair)


def test_incremental_compiles_end_where_a_fresh_compile_starts(tmp_path: Path) -> None:
    """After a series of edits, the incrementally maintained trees equal the trees a
    compile from scratch of the final inputs produces."""
    fleet = Fleet(tmp_path / "incremental")
    fleet.apps["com-example-app"] = app(constraints={"capacityRequirements": {"memory": "4Gi"}})
    fleet.apps["com-example-other"] = app("com-example-other")
    fleet.intents["a"] = intent("a", parameters={"greeting": "{{ device.labels['site'] }}"})
    fleet.intents["b"] = intent("b", app_id="com-example-other", targets={"selectors": [
        {"labelSelector": {"matchExpressions": [
            {"key": "site", "operator": "In", "values": ["s1", "s2"]}]}}]})
    for i in range(8):
        fleet.devices[f"d{i}"] = device(f"d{i}", memory=f"{2 + i}Gi", labels={"site": f"s{i}"},
                                        types=("helm",) if i % 3 else ("compose",))
    fleet.compile(now=1_000)
    fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
    fleet.compile(now=2_000)
    fleet.devices["d1"]["labels"] = {"site": "s5"}
    fleet.devices["d6"]["properties"]["memory"] = "1Gi"
    fleet.compile(now=3_000)
    fleet.intents["c"] = intent("c", targets={"devices": ["d2", "d3"]})
    del fleet.intents["a"]
    fleet.compile(now=4_000)
    fresh = Fleet(tmp_path / "fresh", fleet.apps, fleet.intents, fleet.devices)
    fresh.compile(now=4_000)
    store, fresh_store = fleet.store, fresh.store
    assert store.device_ids() == fresh_store.device_ids()
    for device_id in store.device_ids():
        assert store.read_files(device_id) == fresh_store.read_files(device_id), device_id


def _counting_place(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the device of every placement the compiler evaluates."""
    import compiler.decisions as decisions
    import compiler.device_compile as device_compile
    evaluated: list[str] = []
    real = device_compile.place

    def place(intent, app, device, *args, **kwargs):  # type: ignore[no-untyped-def]
        evaluated.append(device.id)
        return real(intent, app, device, *args, **kwargs)

    for module in (device_compile, decisions):
        monkeypatch.setattr(module, "place", place)
    return evaluated


def _grace_fleet(root: Path) -> Fleet:
    """Helm and Compose devices, some too small for the helm profile, one of them kept in
    a grace period, targeted by a selector."""
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app(constraints={"capacityRequirements": {"memory": "4Gi"}})
    fleet.intents["a"] = intent("a", gracePeriod="1h", parameters={"greeting": "one"},
                                targets={"selectors": [{"labelSelector": {"matchExpressions": [
                                    {"key": "site", "operator": "In", "values": ["s1", "s2"]}]}}]})
    for i in range(6):
        fleet.devices[f"d{i}"] = device(f"d{i}", memory=f"{2 + 2 * (i % 4)}Gi",
                                        labels={"site": f"s{1 + i % 3}"},
                                        types=("helm", "compose") if i % 2 else ("compose",))
    fleet.compile(now=1_000)
    fleet.devices["d1"]["properties"].update(  # in a grace period from now on
        memory="1Gi", supportedDeploymentTypes=["helm"])
    fleet.compile(now=2_000)
    return fleet


def test_a_parameter_edit_places_devices_as_before(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing only an intent's parameters cannot change which devices it places, nor with
    which profile: devices whose capabilities did not change keep their recorded placement
    (only a grace period is evaluated again, since time is an input), and the trees equal
    those of a compile from scratch."""
    fleet = _grace_fleet(tmp_path / "edited")
    evaluated = _counting_place(monkeypatch)
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "two"}
    report = fleet.compile(now=3_000)
    assert set(evaluated) == {"d1"}
    assert report.commits == 3  # d0, d3, d4 (d1 is kept as it was during its grace period)
    monkeypatch.undo()
    fresh = Fleet(tmp_path / "fresh", fleet.apps, fleet.intents, fleet.devices)
    fresh.compile(now=3_000)
    for device_id in fleet.devices:
        if device_id != "d1":  # fresh has no grace period to keep it in
            assert fleet.tree(device_id) == fresh.tree(device_id), device_id
    assert fleet.deployment("d3", "a")["spec"]["deploymentProfile"]["type"] == "helm"
    assert fleet.deployment("d0", "a")["spec"]["deploymentProfile"]["type"] == "compose"


@pytest.mark.parametrize("edit", [
    lambda spec: spec["targets"]["selectors"][0]["labelSelector"]["matchExpressions"][0]
    .update(values=["s1"]),
    lambda spec: spec.update(profile={"type": "compose"}),
    lambda spec: spec.update(constraints={"capacityRequirements": {"memory": "5Gi"}}),
])
def test_editing_what_decides_placement_evaluates_every_device(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Targets, profile and constraints decide placement: an edit to any of them (with a
    parameter edit alongside) is evaluated for every device, as a fresh compile is."""
    fleet = _grace_fleet(tmp_path / "edited")
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "two"}
    edit(fleet.intents["a"]["spec"])
    fleet.compile(now=3_000)
    fleet.compile(now=9_000)  # every grace period has run out: nothing is kept for one
    fresh = Fleet(tmp_path / "fresh", fleet.apps, fleet.intents, fleet.devices)
    fresh.compile(now=9_000)
    for device_id in fleet.devices:
        assert fleet.tree(device_id) == fresh.tree(device_id), device_id


def test_a_file_the_state_has_no_record_of_is_evaluated_again(fleet: Fleet) -> None:
    """A steady intent's file with no placement record (a state that lost rows) is not
    taken as "not targeted": it is evaluated, and kept, when another intent changes."""
    import sqlite3
    fleet.intents["other"] = intent("other", parameters={"greeting": "one"})
    fleet.compile(now=1_000)
    before = fleet.tree("k8s-a")
    assert {"everywhere.yaml", "other.yaml"} <= before.keys()
    db = sqlite3.connect(fleet.repos / "compiler-state.sqlite")
    db.execute("DELETE FROM placements WHERE device_id='k8s-a' AND intent='everywhere'")
    db.commit()
    db.close()
    fleet.intents["other"]["spec"]["parameters"] = {"greeting": "two"}
    fleet.compile(now=2_000)
    after = fleet.tree("k8s-a")
    assert after["everywhere.yaml"] == before["everywhere.yaml"]
    assert after["other.yaml"] != before["other.yaml"]


def _assert_same_branches(serial: DeviceStore, parallel: DeviceStore) -> None:
    """Both stores hold the same trees, and every commit has the same message."""
    assert serial.device_ids() == parallel.device_ids()
    for device_id in serial.device_ids():
        assert serial.read_files(device_id) == parallel.read_files(device_id)
        assert ([c.message for c in serial.history(device_id)]
                == [c.message for c in parallel.history(device_id)])


def test_worker_processes_produce_the_same_trees_and_messages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = []
    for workers in ("1", "2"):
        monkeypatch.setenv("MARGO_COMPILE_WORKERS", workers)
        fleet = Fleet(tmp_path / workers)
        fleet.apps["com-example-app"] = app(
            constraints={"capacityRequirements": {"memory": "4Gi"}})
        fleet.intents["a"] = intent("a", parameters={"greeting": "{{ device.id }}"})
        # d9 has room for both deployments (4Gi each): the broken one is rendered there.
        fleet.intents["broken-values"] = intent("broken-values", targets={"devices": ["d9"]},
                                                parameters={"greeting": "{{ device.nope }}"})
        for i in range(12):
            fleet.devices[f"d{i}"] = device(f"d{i}", memory=f"{i}Gi")
        report = fleet.compile(now=1_000)
        assert [d for d, _ in report.errors] == ["d9"]
        fleet.intents["a"]["spec"]["parameters"] = {"greeting": "{{ device.id }}!"}
        report = fleet.compile(now=2_000)
        # d9's broken intent is its own error: d9 gets `a`'s new values like the others.
        assert report.commits == 8 and [d for d, _ in report.errors] == ["d9"]
        assert fleet.tree("d9").keys() == {"a.yaml"}
        stores.append(fleet.store)
    _assert_same_branches(*stores)


def test_a_recompile_shares_the_devices_between_this_process_and_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every device only re-evaluates a changed intent, this process compiles a share
    of them itself between the workers' results: same trees, same messages, same order."""
    import compiler.workers as workers_module
    stores, local = [], []
    for workers in ("1", "2"):
        monkeypatch.setenv("MARGO_COMPILE_WORKERS", workers)
        fleet = Fleet(tmp_path / workers)
        fleet.apps["com-example-app"] = app()
        fleet.intents["a"] = intent("a", parameters={"greeting": "{{ device.id }}"})
        for i in range(40):
            fleet.devices[f"d{i:02d}"] = device(f"d{i:02d}")
        fleet.compile(now=1_000)
        fleet.intents["a"]["spec"]["parameters"] = {"greeting": "{{ device.id }}!"}
        real, here = workers_module.compile_job, []

        def counted(ctx, store, job, real=real, here=here):  # type: ignore[no-untyped-def]
            here.append(job.device.id)  # (calls in forked workers are not seen here)
            return real(ctx, store, job)

        monkeypatch.setattr(workers_module, "compile_job", counted)
        report = fleet.compile(now=2_000)
        monkeypatch.setattr(workers_module, "compile_job", real)
        assert report.commits == 40
        assert [r.device_id for r in report.results] == sorted(fleet.devices)
        stores.append(fleet.store)
        local.append(here)
    assert len(local[0]) == 40 and 0 < len(local[1]) < 40
    _assert_same_branches(*stores)


def test_a_recompile_takes_trees_from_the_state_while_branches_are_where_it_left_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device recompiled for one intent gets its tree from the state (the recorded commit
    and files) when its branch is still at that commit; a branch that moved, or a record
    that does not add up, is read from Git. The trees equal a fresh compile's."""
    import sqlite3

    from compiler.gitstore import DeviceCommit
    monkeypatch.setenv("MARGO_COMPILE_WORKERS", "1")
    fleet = Fleet(tmp_path / "edited")
    fleet.apps["com-example-app"] = app()
    fleet.apps["com-example-other"] = app("com-example-other")
    fleet.intents["a"] = intent("a", parameters={"greeting": "one"})
    fleet.intents["b"] = intent("b", app_id="com-example-other")
    for i in range(6):
        fleet.devices[f"d{i}"] = device(f"d{i}")
    fleet.compile(now=1_000)
    read: list[str] = []
    real = DeviceStore.tree
    monkeypatch.setattr(DeviceStore, "tree",
                        lambda self, d: read.append(d) or real(self, d))  # type: ignore[func-returns-value]
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "two"}
    assert fleet.compile(now=2_000).commits == 6
    assert read == []
    # d1's branch moves behind the compiler's back; d2's record is damaged.
    fleet.store.write([DeviceCommit("d1", {"extra.yaml": b"x: 1\n"}, "by hand\n", 2_500,
                                    fleet.store.tree_ids("d1") or {})])
    db = sqlite3.connect(fleet.repos / "compiler-state.sqlite")
    db.execute("UPDATE device_trees SET files='{\"a.yaml\": \"%s\"}' WHERE device_id='d2'"
               % ("0" * 40))
    db.commit()
    db.close()
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "three"}
    assert fleet.compile(now=3_000).commits == 6
    assert sorted(read) == ["d1", "d2"]
    monkeypatch.undo()
    fresh = Fleet(tmp_path / "fresh", fleet.apps, fleet.intents, fleet.devices)
    fresh.compile(now=3_000)
    for device_id in fleet.devices:
        assert fleet.tree(device_id) == fresh.tree(device_id), device_id


def test_a_branch_someone_else_committed_to_gets_a_whole_tree_again(fleet: Fleet) -> None:
    """Compiles send Git only the difference from a branch's tree, except when the tree holds
    what no compile writes (here a subtree): then the whole tree is written, without it."""
    import pygit2

    from compiler.gitstore import device_ref

    fleet.intents["other"] = intent("other")
    fleet.compile()
    expected, box = fleet.tree("k8s-a"), fleet.tree("box-c")
    repo = pygit2.Repository(str(fleet.store.path))
    tip = repo[fleet.store.tip("k8s-a")]
    builder = repo.TreeBuilder(tip.tree)
    builder.insert("stray", tip.tree.id, pygit2.GIT_FILEMODE_TREE)
    repo.create_commit(device_ref("k8s-a"), tip.author, tip.committer, "by hand\n",
                       builder.write(), [tip.id])
    fleet.intents["other"]["spec"]["parameters"] = {"greeting": "changed"}
    fleet.compile(now=2_000_000)
    files = fleet.tree("k8s-a")
    assert set(files) == set(expected) and files["everywhere.yaml"] == expected["everywhere.yaml"]
    assert b"changed" in files["other.yaml"]
    stored = fleet.store.tree("k8s-a")
    assert stored is not None and not stored.foreign
    # box-c's branch was not touched by hand: its commit changed other.yaml alone.
    after = fleet.tree("box-c")
    assert after["everywhere.yaml"] == box["everywhere.yaml"] and set(after) == set(box)
    assert after["other.yaml"] != box["other.yaml"] and b"changed" in after["other.yaml"]


def test_a_file_name_no_compile_could_write_makes_the_tree_foreign(fleet: Fleet) -> None:
    """A plain file named with a newline (Git allows it) is never sent back to Git as a
    removal: the device gets a whole tree without it, and the rest of the fleet compiles."""
    import pygit2

    from compiler.gitstore import device_ref

    fleet.compile()
    expected = fleet.tree("k8s-a")
    repo = pygit2.Repository(str(fleet.store.path))
    tip = repo[fleet.store.tip("k8s-a")]
    builder = repo.TreeBuilder(tip.tree)
    builder.insert("odd\nname.yaml", repo.create_blob(b"x"), pygit2.GIT_FILEMODE_BLOB)
    repo.create_commit(device_ref("k8s-a"), tip.author, tip.committer, "by hand\n",
                       builder.write(), [tip.id])
    stored = fleet.store.tree("k8s-a")
    assert stored is not None and stored.foreign and "odd\nname.yaml" not in stored.ids
    fleet.intents["everywhere"]["spec"]["parameters"] = {"greeting": "changed"}
    report = fleet.compile(now=2_000_000)
    assert report.errors == []
    assert set(fleet.tree("k8s-a")) == set(expected)
    assert b"changed" in fleet.tree("k8s-a")["everywhere.yaml"]
