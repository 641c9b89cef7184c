"""The compiler's SQLite state: bulk reads and saves staged until Git has moved the branches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compiler.device_compile import placement_changes
from compiler.snapshot import SnapshotMemo
from compiler.state import (
    CompilerState,
    DeviceRecord,
    IntentRecord,
    PlacementRecord,
    files_json,
)

#: A memo with a document that has no digest (it had problems) and one that is not plain.
MEMO = SnapshotMemo("1:abc", {"d0": "sha256:0", "d1": "sha256:1"},
                    {"d0": (1, 20), "d1": (25, 40), "broken": (45, 50)}, frozenset({"d0"}))


@pytest.fixture
def state(tmp_path: Path):
    state = CompilerState(tmp_path / "state.sqlite")
    yield state
    state.close()


def _records(n: int) -> dict[str, object]:
    devices = [DeviceRecord(f"d{i}", f"sha256:{i}", 1.0, f"tree{i}", 2) for i in range(n)]
    placements = [PlacementRecord(f"d{i}", name, i % 2 == 0, True, 5.0 if i == 3 else None,
                                  "app-helm" if i % 2 == 0 else None)
                  for i in range(n) for name in ("a", "b")]
    return {"intents": [IntentRecord("a", "sha256:a", "app", "1", "sha256:x", "sha256:p")],
            "forget_intents": [], "devices": devices, "placements": placements,
            "forget_devices": [], "snapshot": MEMO}


def test_placements_of_many_devices_equal_one_by_one(state: CompilerState) -> None:
    state.save(**_records(1_203))  # type: ignore[arg-type]
    wanted = [f"d{i}" for i in range(0, 1_203, 2)] + ["unknown", "d0"]
    found = state.placements_of(wanted)
    assert list(found) == wanted[:-1]  # each device once, in the order asked
    assert found == {d: state.placements_for(d) for d in wanted[:-1]}
    assert found["unknown"] == {} and found["d2"]["a"].eligible
    assert found["d2"]["a"].profile == "app-helm" and found["d4"]["a"].profile == "app-helm"
    assert state.placements_for("d1")["a"].profile is None
    assert state.placements_of([]) == {}


def test_a_staged_save_is_invisible_until_committed(tmp_path: Path,
                                                    state: CompilerState) -> None:
    staged = state.stage(**_records(3))  # type: ignore[arg-type]
    reader = CompilerState(tmp_path / "state.sqlite")
    try:
        assert reader.devices() == {} and reader.snapshot_memo() is None
        staged.commit()
        assert sorted(reader.devices()) == ["d0", "d1", "d2"]
        assert reader.snapshot_memo() == MEMO
    finally:
        reader.close()
    assert not staged.pending
    with pytest.raises(RuntimeError, match="already committed or rolled back"):
        staged.rollback()


@pytest.mark.parametrize("as_text", [True, False])
def test_trees_staged_without_a_tip_are_recorded_at_the_tips_given_later(
        state: CompilerState, as_text: bool) -> None:
    """What a compile stages while Git still writes: the trees of committed devices get
    their tips before the commit; one given none has no tree recorded, and committing
    before the tips are given is refused (it would keep the old tips). Alike whether the
    files come as their JSON text (a compile's) or as a mapping."""
    text: Any = files_json if as_text else dict
    records = _records(3)
    records["trees"] = {"d0": ("tip0", {"f": "1"}), "d1": ("old1", {"f": "2"}),
                        "d2": ("old2", {"f": "3"})}
    state.save(**records)  # type: ignore[arg-type]
    records["trees"] = {"d0": ("tip0", text({"f": "1"})), "d1": (None, text({"f": "4"})),
                        "d2": (None, text({"f": "5"}))}
    staged = state.stage(**records)  # type: ignore[arg-type]
    staged.record_tips({"d1": "new1"})
    staged.commit()
    assert state.trees_of(["d0", "d1", "d2"]) == {"d0": ("tip0", {"f": "1"}),
                                                  "d1": ("new1", {"f": "4"})}
    staged = state.stage(**records)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="without a tip were not given one"):
        staged.commit()
    assert not staged.pending
    assert state.trees_of(["d1"]) == {"d1": ("new1", {"f": "4"})}  # rolled back


def test_a_rolled_back_save_changes_nothing(state: CompilerState) -> None:
    state.save(**_records(2))  # type: ignore[arg-type]
    before = (state.intents(), state.devices(), state.placements_of(["d0", "d1"]),
              state.snapshot_memo())
    changed = _records(5)
    changed["forget_devices"] = ["d0"]
    changed["snapshot"] = None
    staged = state.stage(**changed)  # type: ignore[arg-type]
    assert staged.pending
    staged.rollback()
    assert (state.intents(), state.devices(), state.placements_of(["d0", "d1"]),
            state.snapshot_memo()) == before
    state.save(**changed)  # type: ignore[arg-type]  # the connection is usable again
    assert "d0" not in state.devices() and state.snapshot_memo() is None


def test_a_state_of_an_older_schema_is_started_over(tmp_path: Path) -> None:
    """The state is a cache: one written by an older compiler (fewer columns) is dropped
    and rebuilt, not misread."""
    import sqlite3
    path = tmp_path / "state.sqlite"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '2');
        CREATE TABLE intents (name TEXT PRIMARY KEY, digest TEXT NOT NULL,
            app_id TEXT NOT NULL, app_version TEXT NOT NULL, app_digest TEXT NOT NULL);
        INSERT INTO intents VALUES ('a', 'sha256:a', 'app', '1', 'sha256:x');
        CREATE TABLE placements (device_id TEXT NOT NULL, intent TEXT NOT NULL,
            eligible INTEGER NOT NULL, deployed INTEGER NOT NULL, ineligible_since REAL,
            PRIMARY KEY (device_id, intent));
        INSERT INTO placements VALUES ('d0', 'a', 1, 1, NULL);""")
    old.commit()
    old.close()
    state = CompilerState(path)
    try:
        assert state.intents() == {} and state.placements_for("d0") == {}
        state.save(**_records(2))  # type: ignore[arg-type]
        assert state.intents()["a"].placement_digest == "sha256:p"
    finally:
        state.close()


def test_the_devices_read_for_trusted_digests_serve_the_next_read_once(
        state: CompilerState) -> None:
    """`trusted_digests` reads every device record; the compile's own `devices` call right
    after gets that read, and any later call reads again (so it sees later saves)."""
    state.save(**_records(3))  # type: ignore[arg-type]
    trusted = state.trusted_digests()
    assert trusted == {f"d{i}": f"sha256:{i}" for i in range(3)}
    first = state.devices()
    assert sorted(first) == ["d0", "d1", "d2"]
    changed = _records(5)
    changed["forget_devices"] = ["d0"]
    state.save(**changed)  # type: ignore[arg-type]
    assert sorted(state.devices()) == ["d1", "d2", "d3", "d4"]
    state.trusted_digests()
    state.save(**_records(6))  # type: ignore[arg-type]  # a write drops the read-ahead
    assert sorted(state.devices()) == [f"d{i}" for i in range(6)]


def test_recorded_trees_round_trip_and_go_with_their_devices(state: CompilerState) -> None:
    """A device's recorded tree (tip and files) is replaced with its device record, dropped
    when a save records the device without one, and forgotten with the device."""
    records = _records(3)
    records["trees"] = {"d0": ("c" * 40, {"a.yaml": "1" * 40, "b.yaml": "2" * 40}),
                        "d1": ("d" * 40, {})}
    state.save(**records)  # type: ignore[arg-type]
    assert state.trees_of(["d0", "d1", "d2", "nope"]) == {
        "d0": ("c" * 40, {"a.yaml": "1" * 40, "b.yaml": "2" * 40}), "d1": ("d" * 40, {})}
    again = _records(2)  # d0 and d1 again: d0 without a tree now
    again["trees"] = {"d1": ("e" * 40, {"c.yaml": "3" * 40})}
    state.save(**again)  # type: ignore[arg-type]
    assert state.trees_of(["d0", "d1"]) == {"d1": ("e" * 40, {"c.yaml": "3" * 40})}
    forget = _records(0)
    forget["forget_devices"] = ["d1"]
    state.save(**forget)  # type: ignore[arg-type]
    assert state.trees_of(["d0", "d1"]) == {}


def test_placements_saved_against_what_was_read_equal_a_full_replace(tmp_path: Path) -> None:
    """Leaving alone the rows the state already holds gives the table that replacing every
    row of the devices gives: kept, changed, dropped and added placements alike (the rows
    to write and delete worked out by `placement_changes`, as a compile does)."""
    diffed, replaced = (CompilerState(tmp_path / f"{name}.sqlite")
                        for name in ("diffed", "replaced"))
    try:
        for state in (diffed, replaced):
            state.save(**_records(4))  # type: ignore[arg-type]
        before = diffed.placements_of(["d0", "d1", "d2"])
        again = _records(3)
        placements = [p for p in again["placements"]  # type: ignore[attr-defined]
                      if (p.device_id, p.intent) != ("d1", "b")]  # d1 loses "b"
        placements = [p._replace(deployed=False) if (p.device_id, p.intent) == ("d2", "a")
                      else p for p in placements]
        again["placements"] = [*placements, PlacementRecord("d0", "c", True, True, None, None)]
        written: list[PlacementRecord] = []
        dropped: list[tuple[str, str]] = []
        for device_id, previous in before.items():
            changed, gone = placement_changes(previous, [
                p for p in again["placements"] if p.device_id == device_id])  # type: ignore[attr-defined]
            written += changed
            dropped += [(device_id, name) for name in gone]
        assert sorted(written) == [PlacementRecord("d0", "c", True, True, None, None),
                                   placements[3]]  # (d2, a): no longer deployed
        assert dropped == [("d1", "b")]
        diffed.save(**{**again, "placements": written},  # type: ignore[arg-type]
                    dropped_placements=dropped)
        replaced.save(**again)  # type: ignore[arg-type]
        ids = ["d0", "d1", "d2", "d3"]
        assert diffed.placements_of(ids) == replaced.placements_of(ids)
        assert set(diffed.placements_of(["d1"])["d1"]) == {"a"}
        assert not diffed.placements_of(["d2"])["d2"]["a"].deployed
    finally:
        diffed.close()
        replaced.close()


def test_the_memo_remembered_in_memory_is_only_served_while_the_state_holds_it(
        tmp_path: Path, state: CompilerState) -> None:
    """A recompile does not read the memo's rows again while the state still names the id
    they were saved with; rows replaced by any other writer (a new id, or another key) are
    read again, and a save rolled back leaves the memo that was committed."""
    import sqlite3

    state.save(**_records(2))  # type: ignore[arg-type]
    assert state.snapshot_memo() == MEMO
    raw = sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)
    try:
        # Another writer replaces the rows under the same key, with an id of its own.
        raw.execute("UPDATE snapshot_documents SET digest = 'sha256:other' WHERE device_id='d0'")
        raw.execute("UPDATE meta SET value = 'another-id' WHERE key = 'snapshot_id'")
        assert state.snapshot_memo().digests["d0"] == "sha256:other"  # type: ignore[union-attr]
        # A compiler that writes no id replaces the memo: its key differs.
        raw.execute("UPDATE meta SET value = '1:def' WHERE key = 'snapshot'")
        raw.execute("DELETE FROM meta WHERE key = 'snapshot_id'")
        memo = state.snapshot_memo()
        assert memo is not None and memo.key == "1:def"
    finally:
        raw.close()
    changed = _records(2)
    changed["snapshot"] = SnapshotMemo("1:ghi", {"d0": "sha256:9"}, {}, frozenset())
    state.stage(**changed).rollback()  # type: ignore[arg-type]
    memo = state.snapshot_memo()
    assert memo is not None and memo.key == "1:def" and memo.digests["d0"] == "sha256:other"


def test_a_memo_saved_without_an_id_gets_one_when_saved_again(tmp_path: Path,
                                                              state: CompilerState) -> None:
    """A state written by a compiler that saved no memo id gets one at the next compile that
    reads the same file (which otherwise leaves the memo's rows as they are)."""
    import sqlite3

    state.save(**_records(1))  # type: ignore[arg-type]
    raw = sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)
    try:
        raw.execute("DELETE FROM meta WHERE key = 'snapshot_id'")
        assert state.snapshot_memo() == MEMO  # read from its rows
        state.save(**_records(1))  # type: ignore[arg-type]
        ids = raw.execute("SELECT value FROM meta WHERE key = 'snapshot_id'").fetchall()
    finally:
        raw.close()
    assert len(ids) == 1 and state.snapshot_memo() == MEMO
