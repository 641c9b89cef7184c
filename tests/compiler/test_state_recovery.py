"""A damaged compiler state is set aside and rebuilt, never a reason to stop compiling
(issue 15: "a corrupt compiler-state.sqlite blocks every compile until deleted"). The state
is a cache of what the device branches and the source say: `CompilerState` moves a file
that is not a database, or fails its integrity check, to `<name>.corrupt-<time>` (with its
-wal and -shm), says so in the log, and starts a new one; the next compile is a full one."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import pytest
from kits.damagekit import damage_table
from kits.fleetkit import Fleet, app, device, intent

from compiler import statedamage
from compiler.state import CompilerState, is_damage, is_sound


def _fleet(root: Path, devices: int = 3) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web")
    for index in range(devices):
        fleet.devices[f"edge-{index}"] = device(f"edge-{index}")
    return fleet


def _aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"))


def test_a_state_overwritten_with_garbage_is_set_aside_and_the_compile_rebuilds_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fleet = _fleet(tmp_path)
    first = fleet.compile()
    assert not first.errors and first.commits == 3
    path = fleet.repos / "compiler-state.sqlite"
    garbage = os.urandom(40_000)
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="margo.compiler.state"):
        again = fleet.compile()
    assert not again.errors
    assert again.commits == 0  # a full compile, but the branches already hold it all
    assert fleet.deployment("edge-1", "web")["spec"]["deploymentProfile"]
    [moved] = _aside(path)
    assert moved.read_bytes() == garbage  # kept, for whoever wants to look
    assert "damaged" in caplog.text and moved.name in caplog.text and "full one" in caplog.text
    assert is_sound(path)
    fleet.intents["other"] = intent("other")  # and the new state works on
    assert fleet.compile().commits == 3


def test_a_damaged_page_is_found_by_the_first_open_of_a_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = _fleet(tmp_path, devices=40)
    fleet.compile()
    path = fleet.repos / "compiler-state.sqlite"
    damage_table(path, "placements")
    assert not is_sound(path)
    monkeypatch.setattr(statedamage, "CHECKED", set())  # as in a server started now
    state = CompilerState(path)
    try:
        assert state.placements_for("edge-1") == {}  # a new, empty state
    finally:
        state.close()
    assert len(_aside(path)) == 1 and is_sound(path)
    report = fleet.compile()
    assert not report.errors and report.commits == 0


def test_only_damage_counts_as_damage() -> None:
    assert is_damage(sqlite3.DatabaseError("integrity check failed"))
    locked = sqlite3.connect(":memory:")
    try:
        locked.execute("SELECT * FROM nowhere")
    except sqlite3.OperationalError as exc:
        assert not is_damage(exc)  # a statement error, not a damaged file
    finally:
        locked.close()
    assert not is_damage(OSError("disk full"))
