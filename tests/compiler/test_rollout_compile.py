"""Staged rollouts, the compiler's side (compiler/rollout.py): waves, held devices, moves
and their bases, rollback to the base, and the compile after the rollout ends. Real
compiles through the Git store and state."""

from __future__ import annotations

from pathlib import Path

from kits.fleetkit import Fleet, app, device, intent

from compiler.rollout import RolloutPlan, RolloutSpec, Wave, assign_waves, budget_of

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
