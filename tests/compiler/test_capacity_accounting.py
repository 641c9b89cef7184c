"""Capacity accounting: the compiler counts what it has placed (docs/intents.md, "Capacity
accounting"). Real compiles through the Git store and state; the devices are capability
documents, including cluster reports that say which scheduled pods are whose."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.explain import explain_device
from compiler.render import deployment_id
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from compiler.state import CompilerState
from margo.cluster import device_capabilities_from_cluster

SMALL = {"capacityRequirements": {"cpu": {"cores": 1}, "memory": "512Mi"}}
GPU_RULE = {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
    {"key": "/peripherals", "operator": "ContainsAll", "itemSelector": {"matchExpressions": [
        {"key": "/type", "operator": "In", "values": ["gpu"]},
        {"key": "/manufacturer", "operator": "In", "values": ["NVIDIA"]}]}}]}}]}
HELM_ONLY = {"greeting": {"value": "hello", "targets": [{"pointer": "config.greeting",
                                                          "components": ["web"]}]}}


def workers(tmp_path: Path, *names: str, constraints: dict[str, Any] = SMALL,
            **devices: dict[str, Any]) -> Fleet:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app(constraints=constraints, compose=False,
                                        parameters=HELM_ONLY)
    for name in names:
        fleet.intents[name] = intent(name)
    fleet.devices.update(devices)
    return fleet


def placed(fleet: Fleet, device_id: str) -> list[str]:
    return sorted(name.removesuffix(".yaml") for name in fleet.tree(device_id))


def notes(report: Any, device_id: str) -> list[str]:
    return next(r.notes for r in report.results if r.device_id == device_id)


def test_three_one_core_deployments_on_one_core_place_one(tmp_path: Path) -> None:
    """The issue's case: 1 core and 512Mi received three deployments of 1 core and 512Mi."""
    fleet = workers(tmp_path, "w-one", "w-two", "w-three",
                    box=device("box", cores=1, memory="512Mi"))
    report = fleet.compile()
    assert placed(fleet, "box") == ["w-one"]
    assert notes(report, "box") == [
        "w-three: waits for capacity: needs 1 core; the device has 1, of which 1 is "
        "assigned to w-one; needs 512Mi memory; the device has 512Mi, of which 512Mi is "
        "assigned to w-one",
        "w-two: waits for capacity: needs 1 core; the device has 1, of which 1 is assigned "
        "to w-one; needs 512Mi memory; the device has 512Mi, of which 512Mi is assigned to "
        "w-one"]


def test_sums_of_several_placements_are_named(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "hello", "vision", "web",
                    constraints={"capacityRequirements": {"cpu": {"cores": 1.75}}},
                    box=device("box", cores=4))
    report = fleet.compile()
    assert placed(fleet, "box") == ["hello", "vision"]
    assert notes(report, "box") == ["web: waits for capacity: needs 1.75 cores; the device "
                                    "has 4, of which 3.5 are assigned to hello, vision"]


def test_placements_are_never_evicted_by_accounting(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "a", "b", box=device("box", cores=2, memory="1Gi"))
    fleet.compile()
    assert placed(fleet, "box") == ["a", "b"]
    fleet.devices["box"] = device("box", cores=1, memory="512Mi")  # the box shrank
    report = fleet.compile()
    assert placed(fleet, "box") == ["a", "b"]  # each still fits on its own: both stay
    assert report.commits == 0
    fleet.devices["box"] = device("box", cores=0.5, memory="512Mi")
    fleet.compile()
    assert placed(fleet, "box") == []  # an eligibility failure does remove them


def test_added_capacity_lets_waiting_intents_in_on_the_next_compile(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "w-one", "w-two", "w-three",
                    box=device("box", cores=1, memory="1Gi"))
    fleet.compile()
    assert placed(fleet, "box") == ["w-one"]
    assert fleet.compile().commits == 0  # waiting changes nothing by itself
    fleet.devices["box"] = device("box", cores=2, memory="1Gi")
    report = fleet.compile()
    assert placed(fleet, "box") == ["w-one", "w-three"]  # (names in order: "h" < "w")
    assert [(c.intent, c.action, c.reasons) for c in report.results[0].changes] == [
        ("w-three", "add", ("device became eligible",))]
    fleet.devices["box"] = device("box", cores=3, memory="2Gi")
    fleet.compile()
    assert placed(fleet, "box") == ["w-one", "w-three", "w-two"]


def test_a_removed_intent_frees_its_share_in_the_same_compile(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "w-one", "w-two", box=device("box", cores=1, memory="1Gi"))
    fleet.compile()
    del fleet.intents["w-one"]
    report = fleet.compile()
    assert placed(fleet, "box") == ["w-two"]
    assert sorted((c.intent, c.action) for c in report.results[0].changes) == [
        ("w-one", "remove"), ("w-two", "add")]


def test_priority_orders_new_placements_but_never_preempts(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "alpha", "omega", box=device("box", cores=1, memory="1Gi"))
    fleet.intents["omega"]["spec"]["priority"] = 10
    fleet.compile()
    assert placed(fleet, "box") == ["omega"]
    fleet.intents["alpha"]["spec"]["priority"] = 100  # placed later: no preemption
    fleet.compile()
    assert placed(fleet, "box") == ["omega"]


def test_overcommit_opts_out_both_ways(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "agent", "main", "side",
                    box=device("box", cores=1, memory="512Mi"))
    fleet.intents["agent"]["spec"]["overcommit"] = True
    report = fleet.compile()
    # agent is placed without accounting and takes nothing from the others.
    assert placed(fleet, "box") == ["agent", "main"]
    assert [n.split(":")[0] for n in notes(report, "box")] == ["side"]


def test_a_gpu_is_taken_by_one_deployment(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "infer-a", "infer-b", constraints=GPU_RULE,
                    box=device("box", gpu=True))
    report = fleet.compile()
    assert placed(fleet, "box") == ["infer-a"]
    assert notes(report, "box") == [
        "infer-b: waits for capacity: needs a GPU with /manufacturer In ['NVIDIA']; the "
        "device has 1 matching GPU, assigned to infer-a"]


def test_a_smaller_profile_is_used_when_the_first_does_not_fit(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "fleet")
    doc = app(constraints={"capacityRequirements": {"cpu": {"cores": 2}}}, compose=False,
              parameters=HELM_ONLY)
    small = {**doc["deploymentProfiles"][0], "id": "small",
             "deviceConstraints": {"capacityRequirements": {"cpu": {"cores": 1}}}}
    doc["deploymentProfiles"].append(small)
    fleet.apps["com-example-app"] = doc
    fleet.intents.update({n: intent(n) for n in ("a", "b")})
    fleet.devices["box"] = device("box", cores=3)
    fleet.compile()
    assert placed(fleet, "box") == ["a", "b"]
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    records = state.placements_for("box")
    state.close()
    assert (records["a"].profile, records["b"].profile) == ("com-example-app-helm", "small")
    explained = {e.intent: e for e in explain_device(
        load_source(fleet.source), load_snapshot(fleet.caps), "box", placements=records)}
    assert (explained["a"].profile, explained["b"].profile) == ("com-example-app-helm",
                                                                "small")
    assert explained["b"].assigned == {"cpu": 1}


def test_incremental_and_full_compiles_agree(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "a", "b", "c", "d",
                    **{f"d{i}": device(f"d{i}", cores=i, memory=f"{i}Gi") for i in range(5)})
    fleet.compile()
    fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
    fleet.intents["e"] = intent("e")
    fleet.compile()
    incremental = {d: fleet.tree(d) for d in fleet.devices}
    (fleet.repos / "compiler-state.sqlite").unlink()
    assert fleet.compile().commits == 0  # a compile from scratch decides the same
    assert {d: fleet.tree(d) for d in fleet.devices} == incremental


# --- clusters: what the report already counts is not counted again ----------------------


def node(name: str, *, cores: float, memory: str, requested_cores: float = 0,
         requested_memory: str = "0", workloads: list[dict[str, Any]] | None = None,
         gpus: int = 0, gpus_requested: int = 0) -> dict[str, Any]:
    from decimal import Decimal

    from margo.cluster import exact_binary
    from margo.quantity import parse_quantity

    def left(total: str, used: str) -> str:
        return exact_binary(max(Decimal(0), parse_quantity(total) - parse_quantity(used)))

    allocatable: dict[str, Any] = {"cpu": cores, "memory": memory}
    requested: dict[str, Any] = {"cpu": requested_cores, "memory": requested_memory}
    available: dict[str, Any] = {"cpu": cores - requested_cores,
                                 "memory": left(memory, requested_memory)}
    if gpus:
        allocatable["nvidia.com/gpu"] = gpus
        requested["nvidia.com/gpu"] = gpus_requested
        available["nvidia.com/gpu"] = gpus - gpus_requested
    entry: dict[str, Any] = {
        "name": name, "roles": ["worker"], "controlPlane": False, "ready": True,
        "schedulable": True, "architecture": "amd64", "allocatable": allocatable,
        "requested": requested, "available": available,
        "gpus": [{"resource": "nvidia.com/gpu", "count": gpus, "manufacturer": "NVIDIA"}]
        if gpus else [], "taints": [], "labels": {}}
    if workloads is not None:
        entry["workloads"] = workloads
    return entry


def cluster(device_id: str, *nodes: dict[str, Any]) -> dict[str, Any]:
    body = {"metadata": {"id": device_id, "kubernetesVersion": "v1.36.3"},
            "apiSurface": {"apiGroups": []},
            "resources": {"allocatable": {"cpu": "1", "memory": "1Gi"},
                          "nodeCount": len(nodes), "nodes": list(nodes)},
            "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True}}
    return device_capabilities_from_cluster(body)


def running(intent_name: str, device_id: str, cores: float, memory: str,
            gpus: int = 0) -> dict[str, Any]:
    requested: dict[str, Any] = {"cpu": cores, "memory": memory}
    if gpus:
        requested["nvidia.com/gpu"] = gpus
    return {"deployment": deployment_id(intent_name, device_id), "pods": 1,
            "requested": requested}


def test_a_scheduled_deployment_is_counted_once(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "w-one", "w-two",
                    k8s=cluster("k8s", node("n1", cores=2, memory="2Gi", workloads=[])))
    fleet.compile()
    assert placed(fleet, "k8s") == ["w-one", "w-two"]
    fleet.intents["w-three"] = intent("w-three")
    # w-one's pods run (the report subtracted them), w-two's are not scheduled yet.
    fleet.devices["k8s"] = cluster("k8s", node(
        "n1", cores=2, memory="2Gi", requested_cores=1, requested_memory="512Mi",
        workloads=[running("w-one", "k8s", 1, "512Mi")]))
    report = fleet.compile()
    # 1 core left in the report, which w-two will take: no room for w-three, and w-one and
    # w-two stay (w-one is checked as if its own pods were not counted).
    assert placed(fleet, "k8s") == ["w-one", "w-two"]
    assert notes(report, "k8s") == [
        "w-three: waits for capacity: needs 1 core; the cluster has 1 available, of which 1 "
        "is assigned to w-two (not yet running)"]
    # Both run now: the report shows no core left, and nothing is counted twice.
    fleet.devices["k8s"] = cluster("k8s", node(
        "n1", cores=3, memory="3Gi", requested_cores=2, requested_memory="1Gi",
        workloads=[running("w-one", "k8s", 1, "512Mi"), running("w-two", "k8s", 1,
                                                                 "512Mi")]))
    fleet.compile()
    assert placed(fleet, "k8s") == ["w-one", "w-three", "w-two"]


def test_an_unattributed_cluster_report_counts_placements_in_full(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "w-one", "w-two",
                    k8s=cluster("k8s", node("n1", cores=2, memory="2Gi")))
    fleet.compile()
    assert placed(fleet, "k8s") == ["w-one", "w-two"]
    fleet.intents["w-three"] = intent("w-three")
    fleet.devices["k8s"] = cluster("k8s", node("n1", cores=3, memory="3Gi",
                                               requested_cores=1, requested_memory="512Mi"))
    report = fleet.compile()
    assert placed(fleet, "k8s") == ["w-one", "w-two"]
    assert notes(report, "k8s") == [
        "w-three: waits for capacity: needs 1 core; the cluster has 2 available, of which 2 "
        "are assigned to w-one, w-two (the cluster does not say which pods are ours, so "
        "placed deployments count in full)"]


def test_a_gpu_held_by_a_pod_is_not_offered(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "infer", constraints=GPU_RULE,
                    k8s=cluster("k8s", node("gpu-1", cores=8, memory="16Gi", gpus=1,
                                            gpus_requested=1, workloads=[])))
    fleet.compile()
    assert placed(fleet, "k8s") == []  # someone else's pod holds the only GPU
    fleet.devices["k8s"] = cluster("k8s", node("gpu-1", cores=8, memory="16Gi", gpus=1,
                                               workloads=[]))
    fleet.compile()
    assert placed(fleet, "k8s") == ["infer"]
    # Its own pod now holds the GPU: it stays, and the next one waits for a GPU.
    fleet.intents["infer-2"] = intent("infer-2")
    fleet.devices["k8s"] = cluster("k8s", node(
        "gpu-1", cores=8, memory="16Gi", gpus=1, gpus_requested=1,
        workloads=[running("infer", "k8s", 0, "0", gpus=1)]))
    fleet.compile()
    assert placed(fleet, "k8s") == ["infer"]


# --- what people read -------------------------------------------------------------------


def test_explain_says_it_in_numbers(tmp_path: Path) -> None:
    fleet = workers(tmp_path, "hello", "vision", "web",
                    constraints={"capacityRequirements": {"cpu": {"cores": 1.75}}},
                    box=device("box", cores=4))
    fleet.compile()
    explained = {e.intent: e for e in explain_device(
        load_source(fleet.source), load_snapshot(fleet.caps), "box", placed={"hello",
                                                                             "vision"})}
    assert explained["web"].status == "waiting for capacity"
    assert "  - waits for capacity: needs 1.75 cores; the device has 4, of which 3.5 are " \
           "assigned to hello, vision" in explained["web"].lines()
    assert explained["hello"].assigned == {"cpu": 1.75}
    assert explained["web"].to_json()["capacity"][0]["actual"] == {
        "reported": 4, "assigned": {"hello": 1.75, "vision": 1.75}}


@pytest.mark.parametrize("flag", ["priority", "overcommit"])
def test_bad_accounting_fields_are_located_problems(tmp_path: Path, flag: str) -> None:
    fleet = workers(tmp_path, "a", box=device("box"))
    fleet.intents["a"]["spec"][flag] = "high"
    report = fleet.compile()
    assert [(p.file.endswith("deployments/a.yaml"), p.path) for _, p in report.errors] == [
        (True, ("spec", flag))]
    assert placed(fleet, "box") == []
    shutil.rmtree(fleet.repos)


# --- where placed deployments are counted: packed, not first fit in name order ----------


def _apps_needing(fleet: Fleet, **needs: dict[str, Any]) -> None:
    for name, constraints in needs.items():
        fleet.apps[f"com-example-{name}"] = app(f"com-example-{name}", compose=False,
                                                constraints=constraints, parameters=HELM_ONLY)


def test_cores_are_packed_onto_entries_whatever_the_order_placements_came_in(
        tmp_path: Path) -> None:
    """Entries of 2 and 1 cores: b (2) was placed first, then a (1). Counted first fit by
    name, a took the 2-core entry, b overflowed it, and c (1) was let onto the entry a
    really holds: 4 cores on 3."""
    fleet = Fleet(tmp_path / "fleet")
    _apps_needing(fleet, **{n: {"capacityRequirements": {"cpu": {"cores": c}}}
                            for n, c in (("a", 1), ("b", 2), ("c", 1))})
    box = device("box")
    box["properties"]["cpus"] = [{"cores": 2, "architecture": "amd64"},
                                 {"cores": 1, "architecture": "amd64"}]
    fleet.devices["box"] = box
    for step, name in enumerate(("b", "a", "c")):
        fleet.intents[name] = intent(name, f"com-example-{name}")
        report = fleet.compile(now=1_000 + step)
    assert placed(fleet, "box") == ["a", "b"]
    assert notes(report, "box") == [
        "c: waits for capacity: needs 1 core on one CPU entry (entries are never summed); "
        "the device has 2 on its best entry, of which 2 are assigned to b"]


def test_gpu_claims_are_matched_whatever_the_order_placements_came_in(
        tmp_path: Path) -> None:
    """An NVIDIA GPU and an AMD one: b (NVIDIA only) was placed first, then a (any GPU).
    Counted first free by name, a took the NVIDIA GPU, b got none, and c (any GPU) was let
    onto the AMD GPU a really holds."""
    def gpu(*vendors: str) -> dict[str, Any]:
        items = [{"key": "/type", "operator": "In", "values": ["gpu"]}]
        if vendors:
            items.append({"key": "/manufacturer", "operator": "In", "values": list(vendors)})
        return {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
            {"key": "/peripherals", "operator": "ContainsAll",
             "itemSelector": {"matchExpressions": items}}]}}]}

    fleet = Fleet(tmp_path / "fleet")
    _apps_needing(fleet, a=gpu(), b=gpu("NVIDIA"), c=gpu())
    box = device("box")
    box["properties"]["peripherals"] = [{"type": "gpu", "manufacturer": "NVIDIA"},
                                        {"type": "gpu", "manufacturer": "AMD"}]
    fleet.devices["box"] = box
    for step, name in enumerate(("b", "a", "c")):
        fleet.intents[name] = intent(name, f"com-example-{name}")
        report = fleet.compile(now=1_000 + step)
    assert placed(fleet, "box") == ["a", "b"]
    assert notes(report, "box") == ["c: waits for capacity: needs a GPU; the device has 2 "
                                    "matching GPUs, assigned to b, a"]
