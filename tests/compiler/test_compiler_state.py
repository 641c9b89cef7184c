"""The compiler's SQLite state: bulk reads and saves staged until Git has moved the branches."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiler.snapshot import SnapshotMemo
from compiler.state import CompilerState, DeviceRecord, IntentRecord, PlacementRecord


@pytest.fixture
def state(tmp_path: Path):
    state = CompilerState(tmp_path / "state.sqlite")
    yield state
    state.close()


def _records(n: int) -> dict[str, object]:
    devices = [DeviceRecord(f"d{i}", f"sha256:{i}", 1.0, f"tree{i}", 2) for i in range(n)]
    placements = [PlacementRecord(f"d{i}", name, i % 2 == 0, True, 5.0 if i == 3 else None)
                  for i in range(n) for name in ("a", "b")]
    return {"intents": [IntentRecord("a", "sha256:a", "app", "1", "sha256:x")],
            "forget_intents": [], "devices": devices, "placements": placements,
            "forget_devices": [], "snapshot": SnapshotMemo("1:abc", {"d0": "sha256:0"})}


def test_placements_of_many_devices_equal_one_by_one(state: CompilerState) -> None:
    state.save(**_records(1_203))  # type: ignore[arg-type]
    wanted = [f"d{i}" for i in range(0, 1_203, 2)] + ["unknown", "d0"]
    found = state.placements_of(wanted)
    assert list(found) == wanted[:-1]  # each device once, in the order asked
    assert found == {d: state.placements_for(d) for d in wanted[:-1]}
    assert found["unknown"] == {} and found["d2"]["a"].eligible
    assert state.placements_of([]) == {}


def test_a_staged_save_is_invisible_until_committed(tmp_path: Path,
                                                    state: CompilerState) -> None:
    staged = state.stage(**_records(3))  # type: ignore[arg-type]
    reader = CompilerState(tmp_path / "state.sqlite")
    try:
        assert reader.devices() == {} and reader.snapshot_memo() is None
        staged.commit()
        assert sorted(reader.devices()) == ["d0", "d1", "d2"]
        assert reader.snapshot_memo() == SnapshotMemo("1:abc", {"d0": "sha256:0"})
    finally:
        reader.close()
    assert not staged.pending
    with pytest.raises(RuntimeError, match="already committed or rolled back"):
        staged.rollback()


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
