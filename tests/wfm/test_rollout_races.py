"""A rollout changed by two writers at once keeps both changes (`wfm.fleet.rollouts`,
`wfm.store.fleet_rows.replace_rollout`).

The compiling replica reads a rollout, moves it on and writes it back; an operator pauses it
from any replica (or, on one server, from a request thread) at any moment. Before rollouts
were written by compare-and-set, a pause that committed between the evaluation's read and
its write was overwritten: the CLI printed `progressing` right after `pause` (CI, stop 47).
These tests put the pause exactly there, on a real SQLite file and on a real PostgreSQL
database, with the real controller on both sides. The seam is the controller's read of the
stored statuses (it runs between the read and the write) and, for the write that runs inside
the writer's transaction, `replace_rollout` itself: a real race lands there only now and
then, so each test makes the interleaving happen, and says so here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.fleetkit import Fleet, app, device, intent
from kits.pgkit import fresh_database

from compiler.report import CompileReport
from compiler.source import FleetSource, load_source
from wfm.fleet import rollouts
from wfm.fleet.rollouts import RolloutController
from wfm.store.database import Database
from wfm.store.fleet_rows import load_rollouts
from wfm.store.opening import open_database

ROLLOUT = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}], "soak": "1h"}
DEVICES = ("d0", "d1", "d2")


def source_with(fleet: Fleet, greeting: str) -> FleetSource:
    fleet.intents["web"] = intent("web", parameters={"greeting": greeting},
                                  profile={"type": "compose"}, rollout=ROLLOUT)
    fleet.write()
    return load_source(fleet.source)


@pytest.fixture(params=["sqlite", "postgresql"])
def two_writers(request: pytest.FixtureRequest, tmp_path: Path
                ) -> Iterator[tuple[Database, Database]]:
    """The compiling side's database and the operator's: on SQLite the same one (one
    server, a request thread beside the compile's), on PostgreSQL two replicas' own."""
    if request.param == "sqlite":
        db = open_database(tmp_path / "fleet.sqlite")
        yield db, db
        db.close()
        return
    url = fresh_database()
    compiling, operating = open_database(url), open_database(url)
    yield compiling, operating
    compiling.close()
    operating.close()


def nothing_served(device_id: str, intent_name: str) -> None:
    return None


def progressing_rollout(tmp_path: Path, compiling: RolloutController) -> FleetSource:
    """A rollout of a second revision whose canary has moved (as a compile records it)."""
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.devices.update({d: device(d, types=("compose",)) for d in DEVICES})
    compiling.plans(source_with(fleet, "v1"), now=1000.0)  # the first revision: complete
    second = source_with(fleet, "v2")
    plans = compiling.plans(second, now=1001.0)
    assert plans["web"].status == "progressing"
    compiling.after_compile(CompileReport(
        revision="r2", rollout_waves={"web": {"d0": 0, "d1": 1, "d2": 1}},
        rollout_moves={"web": {"d0": "blob-before"}}))
    return second


def stored(db: Database) -> dict[str, Any]:
    state: dict[str, Any] = db.read(load_rollouts)["web"]
    return state


def test_a_pause_between_an_evaluations_read_and_its_write_is_kept(
        two_writers: tuple[Database, Database], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiling_db, operating_db = two_writers
    compiling = RolloutController(compiling_db, nothing_served)
    operating = RolloutController(operating_db, nothing_served)
    source = progressing_rollout(tmp_path, compiling)
    read_statuses = compiling._statuses
    paused: list[dict[str, Any]] = []

    def statuses_then_a_pause() -> dict[str, tuple[str, str | None]]:
        if not paused:  # after the evaluation read the rollout, before it writes it back
            paused.append(operating.act("web", "pause", now=1005.0))
        return read_statuses()

    monkeypatch.setattr(compiling, "_statuses", statuses_then_a_pause)
    plans = compiling.plans(source, now=1010.0)
    assert paused and paused[0]["status"] == "paused"
    assert stored(operating_db)["status"] == "paused"
    assert plans["web"].status == "paused"  # the compile is given the paused plan
    # What the compile recorded before the pause is still there.
    assert stored(operating_db)["moved"] == ["d0"]
    assert stored(operating_db)["base"] == {"d0": "blob-before"}


def test_a_pause_between_a_compiles_read_and_its_write_is_kept(
        two_writers: tuple[Database, Database], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiling_db, operating_db = two_writers
    if compiling_db is operating_db:
        pytest.skip("one SQLite server writes from one thread: its transactions never "
                    "interleave, so only replicas can race here")
    compiling = RolloutController(compiling_db, nothing_served)
    operating = RolloutController(operating_db, nothing_served)
    progressing_rollout(tmp_path, compiling)
    replace = rollouts.replace_rollout
    paused: list[bool] = []

    def a_pause_then_replace(conn: Any, name: str, expected: str | None,
                             state: dict[str, Any]) -> bool:
        if not paused:  # the other replica commits inside this transaction's window
            paused.append(True)  # (first: the pause's own write comes through here too)
            operating.act("web", "pause", now=1005.0)
        return replace(conn, name, expected, state)

    monkeypatch.setattr(rollouts, "replace_rollout", a_pause_then_replace)
    compiling.after_compile(CompileReport(
        revision="r2", rollout_waves={"web": {"d0": 0, "d1": 0, "d2": 1}},
        rollout_moves={"web": {"d1": "blob-before-1"}}))
    state = stored(operating_db)
    assert paused and state["status"] == "paused"
    assert state["waves"] == {"d0": 0, "d1": 0, "d2": 1}
    assert state["base"] == {"d0": "blob-before", "d1": "blob-before-1"}


def test_an_action_on_a_rollout_that_is_not_there_says_so(
        two_writers: tuple[Database, Database]) -> None:
    compiling_db, _ = two_writers
    with pytest.raises(rollouts.RolloutError, match="has no rollout"):
        RolloutController(compiling_db, nothing_served).act("web", "pause")

