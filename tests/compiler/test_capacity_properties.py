"""Properties of capacity accounting over random fleets and intents, through real compiles:
no device is given more than it reports (but for intents that overcommit), compiling again
changes nothing, and capacity added lets every waiting intent in."""

from __future__ import annotations

import tempfile
from decimal import Decimal
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kits.fleetkit import Fleet, app, device, intent

from margo.quantity import parse_quantity

HELM_ONLY = {"greeting": {"value": "hello", "targets": [{"pointer": "config.greeting",
                                                          "components": ["web"]}]}}
GPU_RULE = [{"propertySelector": {"matchExpressions": [
    {"key": "/peripherals", "operator": "ContainsAll", "itemSelector": {"matchExpressions": [
        {"key": "/type", "operator": "In", "values": ["gpu"]}]}}]}}]

requirements = st.fixed_dictionaries({
    "cores": st.sampled_from([None, 0.5, 1, 2]),
    "memory": st.sampled_from([None, "256Mi", "512Mi", "1Gi"]),
    "gpu": st.booleans(),
    "priority": st.sampled_from([0, 0, 5]),
    "overcommit": st.sampled_from([False, False, False, True]),
})
boxes = st.fixed_dictionaries({
    "cores": st.sampled_from([0.5, 1, 2, 3, 4]),
    "memory": st.sampled_from(["512Mi", "1Gi", "2Gi", "4Gi"]),
    "gpus": st.integers(0, 2),
})


def _constraints(req: dict[str, Any]) -> dict[str, Any]:
    capacity: dict[str, Any] = {}
    if req["cores"] is not None:
        capacity["cpu"] = {"cores": req["cores"]}
    if req["memory"] is not None:
        capacity["memory"] = req["memory"]
    out: dict[str, Any] = {"capacityRequirements": capacity} if capacity else {}
    if req["gpu"]:
        out["eligibilityRules"] = GPU_RULE
    return out


def _device(device_id: str, box: dict[str, Any]) -> dict[str, Any]:
    doc = device(device_id, cores=box["cores"], memory=box["memory"])
    doc["properties"]["peripherals"] = [{"type": "gpu", "manufacturer": "NVIDIA"}
                                        for _ in range(box["gpus"])]
    return doc


def _fleet(root: Path, reqs: list[dict[str, Any]], fleet_boxes: list[dict[str, Any]]) -> Fleet:
    fleet = Fleet(root)
    for i, req in enumerate(reqs):
        app_id = f"com-example-app-{i}"
        fleet.apps[app_id] = app(app_id, constraints=_constraints(req), compose=False,
                                 parameters=HELM_ONLY)
        spec: dict[str, Any] = {}
        if req["priority"]:
            spec["priority"] = req["priority"]
        if req["overcommit"]:
            spec["overcommit"] = True
        fleet.intents[f"i{i}"] = intent(f"i{i}", app_id, **spec)
    for j, box in enumerate(fleet_boxes):
        fleet.devices[f"d{j}"] = _device(f"d{j}", box)
    return fleet


def _placed(fleet: Fleet, device_id: str) -> set[int]:
    return {int(name.removesuffix(".yaml")[1:]) for name in fleet.tree(device_id)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(requirements, min_size=1, max_size=5),
       fleet_boxes=st.lists(boxes, min_size=1, max_size=3))
def test_accounting_never_gives_more_than_reported(reqs: list[dict[str, Any]],
                                                   fleet_boxes: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = _fleet(Path(tmp), reqs, fleet_boxes)
        report = fleet.compile()
        assert not report.errors
        trees = {}
        for j, box in enumerate(fleet_boxes):
            counted = [reqs[i] for i in _placed(fleet, f"d{j}") if not reqs[i]["overcommit"]]
            cores = sum(Decimal(str(r["cores"])) for r in counted if r["cores"] is not None)
            memory = sum(parse_quantity(r["memory"]) for r in counted if r["memory"])
            assert cores <= Decimal(str(box["cores"]))
            assert memory <= parse_quantity(box["memory"])
            assert sum(r["gpu"] for r in counted) <= box["gpus"]
            trees[j] = fleet.tree(f"d{j}")
        # The same inputs again: nothing changes.
        assert fleet.compile().commits == 0
        assert {j: fleet.tree(f"d{j}") for j in range(len(fleet_boxes))} == trees
        # Room for everything: every intent the devices wait for comes in.
        for j in range(len(fleet_boxes)):
            fleet.devices[f"d{j}"] = _device(f"d{j}", {"cores": 64, "memory": "256Gi",
                                                       "gpus": len(reqs)})
        fleet.compile()
        for j in range(len(fleet_boxes)):
            assert _placed(fleet, f"d{j}") == set(range(len(reqs)))
