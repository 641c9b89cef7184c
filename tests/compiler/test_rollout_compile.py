"""Staged rollouts, the compiler's side (compiler/rollout.py): waves, held devices, moves
and their bases, rollback to the base, the compile after the rollout ends, and a wave
capped by `maxUnavailable` moving only the devices the plan admits. Real compiles through
the Git store and state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.rollout import (
    RolloutPlan,
    RolloutSpec,
    Wave,
    assign_waves,
    budget_of,
    move_order,
    next_admissions,
    unavailable_limit,
)

ROLLOUT = {"waves": [{"name": "canary", "devices": 1}, {"name": "half", "devices": "50%"},
                     {"name": "rest"}], "soak": "1m", "maxFailed": 1}


def fleet_of(tmp_path: Path, count: int = 6) -> Fleet:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", parameters={"greeting": "v1"}, rollout=ROLLOUT)
    for i in range(count):
        fleet.devices[f"d{i}"] = device(f"d{i}", labels={"site": "a" if i < 2 else "b"})
    return fleet


def _greeting(fleet: Fleet, device_id: str) -> str:
    text = fleet.tree(device_id)["web.yaml"].decode()
    return "v2" if "v2" in text else "v1"


def test_waves_are_filled_in_order_deterministically() -> None:
    spec = RolloutSpec((Wave("canary", count=1), Wave("half", percent=50), Wave("rest")))
    devices = [(f"d{i}", {}, {}) for i in range(10)]
    waves = assign_waves("web", spec, devices)
    assert waves == assign_waves("web", spec, list(reversed(devices)))
    assert sorted(waves.values()) == [0] + [1] * 5 + [2] * 4
    assert assign_waves("other", spec, devices) != waves  # the order depends on the intent
    assert budget_of(RolloutSpec((), max_failed=None, max_failed_percent=10), 25) == 2


def test_a_rollout_moves_open_waves_holds_the_rest_and_rolls_back(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path)
    fleet.compile()
    assert {_greeting(fleet, f"d{i}") for i in range(6)} == {"v1"}
    fleet.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
    canary = RolloutPlan("r2", "progressing", open_wave=0)
    report = fleet.compile(rollouts={"web": canary})
    waves = report.rollout_waves["web"]
    on_new = {d for d in waves if _greeting(fleet, d) == "v2"}
    assert on_new == {d for d, w in waves.items() if w == 0} and len(on_new) == 1
    [moved] = on_new
    assert set(report.rollout_moves["web"]) == {moved}
    base = report.rollout_moves["web"][moved]
    held = next(r for r in report.results if r.device_id != moved)
    assert any("held by its rollout" in note for note in held.notes)

    half = fleet.compile(rollouts={"web": RolloutPlan("r2", "progressing", open_wave=1)})
    assert {d for d in waves if _greeting(fleet, d) == "v2"} == {
        d for d, w in waves.items() if w <= 1}
    assert moved not in half.rollout_moves.get("web", {})  # already moved: not again

    bases = {moved: base, **half.rollout_moves["web"]}
    back = fleet.compile(rollouts={"web": RolloutPlan("r2", "rolled back", open_wave=1,
                                                      base=bases, reason="2 failed")})
    assert {_greeting(fleet, f"d{i}") for i in range(6)} == {"v1"}
    rolled = [r for r in back.results if r.status == "committed"]
    assert {r.device_id for r in rolled} == set(bases)
    assert all(c.action == "rollback" and "2 failed" in c.reasons[0]
               for r in rolled for c in r.changes)
    again = fleet.compile(rollouts={"web": RolloutPlan("r2", "rolled back", base=bases)})
    assert again.commits == 0  # rolled back stays rolled back


def test_the_compile_after_a_rollout_completes_moves_every_device(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path)
    fleet.compile()
    fleet.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
    fleet.compile(rollouts={"web": RolloutPlan("r2", "progressing", open_wave=0)})
    assert sum(_greeting(fleet, f"d{i}") == "v2" for i in range(6)) == 1
    fleet.compile(rollouts={"web": RolloutPlan("r2", "complete")})
    assert {_greeting(fleet, f"d{i}") for i in range(6)} == {"v2"}


def test_a_device_new_to_the_intent_gets_the_new_revision_at_once(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, count=3)
    fleet.compile()
    fleet.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
    fleet.devices["late"] = device("late")
    report = fleet.compile(rollouts={"web": RolloutPlan("r2", "progressing", open_wave=0)})
    assert _greeting(fleet, "late") == "v2"
    assert "late" not in report.rollout_moves.get("web", {})


def test_rollout_specs_are_validated_with_located_errors(tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path, count=1)
    fleet.intents["web"]["spec"]["rollout"] = {
        "waves": [{"name": "a", "devices": "150%"}], "soak": "soon"}
    fleet.write()
    from compiler.source import load_source

    problems = [p.format() for p in load_source(fleet.source).problems]
    assert any("$.spec.rollout.waves[0].devices" in p for p in problems), problems
    assert any("$.spec.rollout.soak" in p for p in problems), problems
    fleet.intents["web"]["spec"]["rollout"] = {"waves": [
        {"name": "a", "devices": 1}, {"name": "a", "devices": 1,
                                      "selectors": [{"labelSelector": {"matchExpressions": [
                                          {"key": "site", "operator": "In",
                                           "values": ["a"]}]}}]}]}
    fleet.write()
    problems = [p.format() for p in load_source(fleet.source).problems]
    assert any("waves[1].name" in p and "named twice" in p for p in problems), problems
    assert any("waves[1]" in p and "not both" in p for p in problems), problems


def test_a_capped_wave_moves_only_the_admitted_devices_and_a_recompile_moves_the_same(
        tmp_path: Path) -> None:
    fleet = fleet_of(tmp_path)
    fleet.compile()
    fleet.intents["web"]["spec"]["rollout"]["maxUnavailable"] = 1
    fleet.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
    probe = fleet.compile(dry_run=True, rollouts={"web": RolloutPlan("r2", "progressing")})
    waves = probe.rollout_waves["web"]
    half = move_order("web", [d for d, w in waves.items() if w == 1])
    canary = [d for d, w in waves.items() if w == 0]
    plan = RolloutPlan("r2", "progressing", open_wave=1, admitted=frozenset(half[:1]))
    report = fleet.compile(rollouts={"web": plan})
    on_new = {d for d in waves if _greeting(fleet, d) == "v2"}
    assert on_new == {*canary, half[0]}  # the earlier wave whole, one of the open wave
    assert set(report.rollout_moves["web"]) == on_new
    waiting = next(r for r in report.results if r.device_id == half[1])
    assert any("held by its rollout" in note for note in waiting.notes)
    trees = {d: fleet.tree(d) for d in waves}
    again = fleet.compile(rollouts={"web": plan})
    assert again.commits == 0 and {d: fleet.tree(d) for d in waves} == trees
    # The same plan on a fleet that reported in another order moves the same devices.
    other = fleet_of(tmp_path / "other")
    other.devices = dict(reversed(other.devices.items()))
    other.compile()
    other.intents["web"]["spec"]["rollout"]["maxUnavailable"] = 1
    other.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
    other.compile(rollouts={"web": plan})
    assert {d: other.tree(d) for d in waves} == trees


def test_the_next_devices_through_a_cap_are_a_function_of_the_inputs() -> None:
    devices = [f"d{i}" for i in range(8)]
    first = next_admissions("web", devices, unavailable=0, limit=2)
    assert first == move_order("web", devices)[:2]
    assert next_admissions("web", list(reversed(devices)), 0, 2) == first
    assert next_admissions("web", devices, unavailable=1, limit=2) == first[:1]
    assert next_admissions("web", devices, unavailable=3, limit=2) == []
    assert move_order("other", devices) != move_order("web", devices)
    spec = RolloutSpec((Wave("all"),), max_unavailable_percent=10)
    assert unavailable_limit(spec, 25) == 2  # rounded down...
    assert unavailable_limit(spec, 5) == 1  # ...but never below 1
    assert unavailable_limit(RolloutSpec((Wave("all"),), max_unavailable=3), 25) == 3
    assert unavailable_limit(RolloutSpec((Wave("all"),)), 25) is None
    plan = RolloutPlan("r", "progressing", open_wave=1, admitted=frozenset({"a"}))
    assert plan.is_open(0, "b") and plan.is_open(1, "a")
    assert not plan.is_open(1, "b") and not plan.is_open(2, "a") and not plan.is_open(1)
    assert RolloutPlan("r", "progressing", open_wave=1).is_open(1, "b")


@pytest.mark.parametrize("bad, expected", [
    (-1, "less than the minimum of 1"),
    (0, "less than the minimum of 1"),
    ("150%", "found '150%'"),
    ("0%", "found '0%'"),
    ("abc", "found 'abc'"),
    (True, "expected an integer"),
    (2.5, "expected an integer"),
    ([1], "expected an integer"),
])
def test_max_unavailable_is_validated_with_located_errors(tmp_path: Path, bad: Any,
                                                          expected: str) -> None:
    from compiler.source import load_source

    fleet = fleet_of(tmp_path, count=1)
    fleet.intents["web"]["spec"]["rollout"] = {**ROLLOUT, "maxUnavailable": bad}
    fleet.write()
    problems = [p.format() for p in load_source(fleet.source).problems]
    assert any(p.startswith("deployments/web.yaml:") and
               "$.spec.rollout.maxUnavailable" in p and expected in p
               for p in problems), problems


@pytest.mark.parametrize("good, count, percent", [(1, 1, None), (2.0, 2, None),
                                                  ("25%", None, 25), ("100%", None, 100)])
def test_max_unavailable_is_read_as_a_count_or_a_percentage(
        tmp_path: Path, good: Any, count: int | None, percent: int | None) -> None:
    from compiler.source import load_source

    fleet = fleet_of(tmp_path, count=1)
    fleet.intents["web"]["spec"]["rollout"] = {**ROLLOUT, "maxUnavailable": good}
    fleet.write()
    source = load_source(fleet.source)
    assert not source.problems
    spec = source.intents["web"].rollout
    assert spec is not None
    assert (spec.max_unavailable, spec.max_unavailable_percent) == (count, percent)
