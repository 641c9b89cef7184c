"""Names in the fleet source that travel on: located problems at the source, not failures on
the devices (issue 15's siblings). Intent names become ``<intent>.yaml`` and application ids
name the Kubernetes namespace when the intent gives none; listed device ids are device ids."""

from __future__ import annotations

from pathlib import Path

from kits.fleetkit import Fleet, app, device, intent

from compiler.source import load_source
from margo.identifiers import DNS_LABEL, file_name_problem


def test_an_application_id_that_names_no_namespace_needs_one_in_the_intent(
        tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.apps["-edge-app"] = app("-edge-app")
    fleet.apps["com-example-app"] = app()
    fleet.intents["dashed"] = intent("dashed", "-edge-app")
    fleet.intents["named"] = intent("named", "-edge-app", namespace="edge")
    fleet.intents["plain"] = intent("plain")
    fleet.devices["k8s-a"] = device("k8s-a")
    report = fleet.compile()
    problems = [p for _, p in report.errors]
    assert [(p.file, p.path) for p in problems] == [
        ("deployments/dashed.yaml", ("spec", "application", "id"))]
    assert problems[0].line is not None  # located in the file
    assert "set spec.namespace" in problems[0].message
    # The other intents (one for the same application, with a namespace) still compile.
    assert sorted(fleet.tree("k8s-a")) == ["named.yaml", "plain.yaml"]
    assert fleet.deployment("k8s-a", "named")["metadata"]["namespace"] == "edge"


def test_listed_device_ids_beyond_the_bounds_are_located(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["listed"] = intent("listed", targets={"devices": ["k8s-a", "~" * 100]})
    fleet.write()
    source = load_source(fleet.source)
    assert source.broken_intents == {"listed"}
    [problem] = source.problems
    assert problem.path == ("spec", "targets", "devices", 1) and problem.line is not None


def test_every_loaded_intent_name_is_a_file_name_and_a_dns_label(tmp_path: Path) -> None:
    """What `<intent>.yaml` on every device relies on (the schema already says DNS label)."""
    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    for name in ("a", "x" * 63, "with-dash-9"):
        fleet.intents[name] = intent(name)
    fleet.raw_files["deployments/Bad_Name.yaml"] = (
        "apiVersion: margo-gitops.dev/v1alpha1\nkind: DeploymentIntent\n"
        "metadata: {name: Bad_Name}\nspec: {application: {id: com-example-app}}\n")
    fleet.write()
    source = load_source(fleet.source)
    assert sorted(source.intents) == sorted(["a", "x" * 63, "with-dash-9"])
    assert source.broken_intents == {"Bad_Name"}
    for name in source.intents:
        assert DNS_LABEL.is_valid(name) and file_name_problem(f"{name}.yaml") is None
