"""Rendering through one shared cache (document templates, value plans, memoised checks)
gives every device exactly what rendering it alone gives, and skips no check."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import resolve_intents
from compiler.placement import ProfileConstraints, place
from compiler.render import NAMESPACE, RenderCache, RenderError, deployment_id, render
from compiler.snapshot import ReportedDocuments, load_snapshot, snapshot_from_documents
from compiler.source import load_source
from margo.kinds import detect


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_deployment_ids_are_uuid5_of_intent_and_device(intent_name: str, device_id: str) -> None:
    assert deployment_id(intent_name, device_id) == str(
        uuid.uuid5(NAMESPACE, f"{intent_name}/{device_id}"))


def _varied_fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app(parameters={
        "greeting": {"value": "hello", "targets": [
            {"pointer": "config.greeting", "components": ["web"]},
            {"pointer": "GREETING", "components": ["web-compose"]}]},
        "replicas": {"value": 1, "targets": [{"pointer": "replicaCount",
                                              "components": ["web"]}]}})
    fleet.intents["literal"] = intent("literal", namespace="demo",
                                      parameters={"greeting": "hi"})
    fleet.intents["per-site"] = intent("per-site", parameters={
        "greeting": "{{ device.labels['site'] }}", "replicas": "{{ device.labels['n'] }}"})
    fleet.intents["old-shape"] = intent("old-shape", outputShape="oct-2024",
                                        parameters={"greeting": "{{ device.id }}"})
    for index in range(12):
        labels = {"site": ["yes", "north", "2024-01-01", "ü"][index % 4], "n": index % 3}
        types = ("helm",) if index % 3 else ("compose",)
        fleet.devices[f"dev-{index:02d}"] = device(f"dev-{index:02d}", labels=labels,
                                                   types=types)
    fleet.devices["true"] = device("true", labels={"site": "x", "n": 1})  # id needs quotes
    for generation in ("rc.2", "oct-2024"):  # their own shapes, through the same cache
        fleet.devices[f"old-{generation}"] = device(f"old-{generation}",
                                                    labels={"site": "x", "n": 1})
    fleet.write()
    return fleet


def test_a_shared_cache_renders_each_device_as_a_fresh_one_does(tmp_path: Path) -> None:
    fleet = _varied_fleet(tmp_path)
    source = load_source(fleet.source)
    snapshot = snapshot_from_documents(ReportedDocuments(fleet.devices, {  # as the server
        "old-rc.2": "rc.2", "old-oct-2024": "oct-2024"}))                  # knows them
    shared, constraints, rendered = RenderCache(), ProfileConstraints(), 0
    for intent_obj, app_version in resolve_intents(source).usable.values():
        for dev in snapshot.devices.values():
            placement = place(intent_obj, app_version, dev, constraints, targeted=True)
            assert placement.eligible and placement.profile is not None
            together = render(intent_obj, app_version, placement.profile, dev, cache=shared)
            alone = render(intent_obj, app_version, placement.profile, dev)
            assert together == alone
            document = yaml.safe_load(together.data)
            expected_id = deployment_id(intent_obj.name, dev.id)
            shape = intent_obj.output_shape or dev.generation
            assert detect(document).shape == shape
            if shape == "oct-2024":
                assert document["metadata"]["annotations"]["id"] == expected_id
            else:
                assert (document["id"], document["metadata"]["deviceId"]) == (expected_id,
                                                                              dev.id)
            rendered += 1
    assert rendered == 3 * 15
    # Devices with the same values share one template per intent and profile.
    assert len(shared.templates) < rendered


def test_values_are_checked_per_device_even_where_they_do_not_reach_the_profile(
        tmp_path: Path) -> None:
    """A setting's rule applies to the intent's value whatever the profile: a template
    shared with a device whose value passed must not let another device's value skip it."""
    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app(
        parameters={"greeting": {"value": "hello", "targets": [
                        {"pointer": "config.greeting", "components": ["web"]}]},
                    "mode": {"value": "abc", "targets": [
                        {"pointer": "MODE", "components": ["web-compose"]}]}},
        schema=[{"name": "short", "dataType": "string", "maxLength": 3}],
        settings=[{"parameter": "mode", "name": "Mode", "schema": "short"}])
    fleet.intents["everywhere"] = intent("everywhere", parameters={
        "mode": "{{ device.labels['mode'] }}"})
    fleet.devices["k8s-a"] = device("k8s-a", labels={"mode": "abc"})
    fleet.devices["k8s-b"] = device("k8s-b", labels={"mode": "far-too-long"})
    fleet.write()
    source, snapshot = load_source(fleet.source), load_snapshot(fleet.caps)
    [(intent_obj, app_version)] = resolve_intents(source).usable.values()
    cache = RenderCache()
    helm = app_version.description.profile("com-example-app-helm")
    assert helm is not None
    first = render(intent_obj, app_version, helm, snapshot.devices["k8s-a"], cache=cache)
    assert b"MODE" not in first.data and b"far" not in first.data
    try:
        render(intent_obj, app_version, helm, snapshot.devices["k8s-b"], cache=cache)
    except RenderError as exc:
        assert "on device k8s-b" in str(exc) and "at most 3" in str(exc)
    else:
        raise AssertionError("k8s-b's value was not checked")
    report = fleet.compile()
    assert [d for d, _ in report.errors] == ["k8s-b"]


#: Values that compare or print alike but are different data (None: the device is refused).
_LABEL_VALUES = st.sampled_from([1, 1.0, True, "1", "true", "x", 0.0, -0.0, None])


@pytest.fixture(scope="module")
def expression_fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    fleet = Fleet(tmp_path_factory.mktemp("expressions"))
    names = ("keyed", "section", "whole", "own-id")
    fleet.apps["com-example-app"] = app(compose=False, parameters={
        name: {"value": "-", "targets": [{"pointer": f"p.{name}", "components": ["web"]}]}
        for name in names})
    fleet.intents["exprs"] = intent("exprs", parameters={
        "keyed": "{{ device.labels['a'] | default('missing') }}",
        "section": "{{ device.labels.get('a', 'none') ~ '/' ~ device.labels.get('b', 'none') }}",
        "whole": "{{ device.labels | tojson }}",
        "own-id": "{{ device.id }}"})
    fleet.devices["d"] = device("d")
    fleet.write()
    [(intent_obj, app_version)] = resolve_intents(load_source(fleet.source)).usable.values()
    return intent_obj, app_version


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b"]), _LABEL_VALUES, max_size=2),
                min_size=2, max_size=12))
def test_expression_results_shared_between_devices_are_theirs(
        expression_fleet: tuple[Any, Any], labels: list[dict[str, Any]]) -> None:
    """Devices that agree on what an expression reads share its result; the results are
    exactly what evaluating each device alone gives (types included: 1, 1.0, true, "1")."""
    intent_obj, app_version = expression_fleet
    profile = app_version.description.profile("com-example-app-helm")
    assert profile is not None
    documents = {f"dev-{i}": device(f"dev-{i}", labels=dict(found) or None)
                 for i, found in enumerate(labels)}
    snapshot = snapshot_from_documents(documents)
    shared = RenderCache()
    for dev in snapshot.devices.values():
        outcomes = []
        for cache in (shared, RenderCache()):
            try:
                outcomes.append(render(intent_obj, app_version, profile, dev, cache=cache).data)
            except RenderError as exc:
                outcomes.append([p.message for p in exc.problems])
        assert outcomes[0] == outcomes[1]
