"""Shortcuts of a recompile that compiles a tenth of the fleet: the steady devices'
deployments summed over the smaller side, placements read column by column (each range of
devices by the process that compiles it), the devices an intent placed read from an index
alone, trees serialised by one encoder. Each gives exactly what the plain way gives."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from compiler.planning import _steady_deployments
from compiler.state import CompilerState, DeviceRecord, PlacementRecord, files_json


@given(st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers(0, 9)),
       st.data())
def test_steady_deployments_are_the_sum_over_the_steady_records(
        counts: dict[str, int], data: st.DataObject) -> None:
    previous = {d: DeviceRecord(d, "sha256:x", 1.0, "t", n) for d, n in counts.items()}
    steady = data.draw(st.sets(st.sampled_from(sorted(previous)))) if previous else set()
    expected = sum(previous[d].deployments for d in steady)
    assert _steady_deployments(previous, sum(counts.values()), steady) == expected


def test_placements_read_together_are_the_records_saved(tmp_path: Path) -> None:
    records = [PlacementRecord("a", "i", True, True, None, "p"),
               PlacementRecord("a", "j", False, False, 12.5, None, False),
               PlacementRecord("b", "i", True, False, None, "q", True)]
    state = CompilerState(tmp_path / "state.sqlite")
    try:
        state.save(intents=[], forget_intents=[], placements=records, forget_devices=[],
                   devices=[DeviceRecord("a", "sha256:1", 1.0, "t", 1),
                            DeviceRecord("b", "sha256:2", 1.0, "t", 0)])
        together = state.placements_of(["b", "a", "c", "a"])
        alone = {d: state.placements_for(d) for d in ("a", "b", "c")}
    finally:
        state.close()
    assert list(together) == ["b", "a", "c"]
    assert together == alone == {"a": {"i": records[0], "j": records[1]},
                                 "b": {"i": records[2]}, "c": {}}
    for record in together["a"].values():  # booleans, not SQLite's 0 and 1
        assert [type(v) for v in record[2:4]] == [bool, bool] and type(record[6]) is bool


def test_the_devices_an_intent_placed_are_read_from_the_index_alone(tmp_path: Path) -> None:
    """`devices_placed_by` is answered by an index on (intent, device id), also in a state
    written with the index on the intent alone (replaced when it is opened)."""
    import sqlite3

    path = tmp_path / "state.sqlite"
    CompilerState(path).close()
    old = sqlite3.connect(path, isolation_level=None)
    old.executescript("DROP INDEX placements_of_intent; "
                      "CREATE INDEX placements_by_intent ON placements (intent);")
    old.close()
    state = CompilerState(path)
    try:
        state.save(intents=[], forget_intents=[], forget_devices=[],
                   placements=[PlacementRecord(d, i, True, True, None, "p")
                               for d in ("a", "b") for i in ("i", "j")][1:],
                   devices=[DeviceRecord(d, "sha256:1", 1.0, "t", 1) for d in ("a", "b")])
        assert state.devices_placed_by(["i"]) == {"b"}
        assert state.devices_placed_by(["i", "j", "k"]) == {"a", "b"}
        plan = state._db.execute("EXPLAIN QUERY PLAN SELECT device_id FROM placements "
                                 "WHERE intent=?", ("i",)).fetchall()
        indexes = state._db.execute("SELECT name FROM sqlite_master WHERE type='index' "
                                    "AND tbl_name='placements'").fetchall()
    finally:
        state.close()
    assert "COVERING INDEX placements_of_intent" in plan[0][-1]
    assert ("placements_by_intent",) not in indexes


#: The state a forked process reads in `test_a_forked_process_reads_the_rows_itself`.
_FORKED_STATE: list[CompilerState] = []


def _rows_read_in_a_forked_process() -> tuple[object, object, bool]:
    state = _FORKED_STATE[0]
    rows = (state.placements_of(["b", "a"]), state.tree_texts_of(["a", "b"]))
    return *rows, state._reader() is not state._db  # a connection of its own


def test_a_forked_process_reads_the_rows_itself(tmp_path: Path) -> None:
    """A compile's worker reads the rows of the devices it compiles (`compiler.workers`)
    through a connection of its own, never the inherited one; the parent's stays usable."""
    import multiprocessing

    record = PlacementRecord("a", "i", True, True, None, "p")
    state = CompilerState(tmp_path / "state.sqlite")
    try:
        state.save(intents=[], forget_intents=[], placements=[record], forget_devices=[],
                   devices=[DeviceRecord("a", "sha256:1", 1.0, "t", 1)],
                   trees={"a": ("c" * 40, {"i.yaml": "b" * 40})})
        _FORKED_STATE.append(state)
        with multiprocessing.get_context("fork").Pool(1) as pool:
            placements, trees, own = pool.apply(_rows_read_in_a_forked_process)
        assert own and placements == state.placements_of(["b", "a"]) == {
            "b": {}, "a": {"i": record}}
        assert trees == state.tree_texts_of(["a"]) == {
            "a": ("c" * 40, json.dumps({"i.yaml": "b" * 40}, separators=(",", ":")))}
        state.forget(["a"])  # written through the parent's connection, read back
        assert state.placements_of(["a"]) == {"a": {}} and state.tree_texts_of(["a"]) == {}
    finally:
        _FORKED_STATE.clear()
        state.close()


def test_each_range_is_loaded_by_the_process_that_works_it_out() -> None:
    """`load(start, end)` runs once per range, before its items, in whichever process
    works them out (a worker, or this one when it shares the ranges)."""
    import os

    from compiler.parallel import forked_state, map_in_chunks

    loaded: dict[int, tuple[int, int, int]] = {}

    def load(start: int, end: int) -> None:
        assert not set(loaded).intersection(range(start, end))  # once per range
        loaded.update((i, (start, end, os.getpid())) for i in range(start, end))

    def work(i: int) -> tuple[int, int, int, int]:
        return (*loaded.pop(i), os.getpid())

    with forked_state(work=work, pack=lambda r: r, load=load):
        for share in (False, True):
            results = list(map_in_chunks(300, workers=2, share=share, unpack=lambda r: r))
            assert len(results) == 300 and not loaded
            for i, (start, end, loader, worker) in enumerate(results):
                assert start <= i < end and loader == worker
            # Only the workers, or this process too (it takes the first range itself).
            assert (os.getpid() in {worker for *_, worker in results}) is share


@given(st.dictionaries(st.text(), st.text()))
def test_trees_are_serialised_as_json_dumps_does(files: dict[str, str]) -> None:
    assert files_json(files) == json.dumps(files, sort_keys=True, separators=(",", ":"))
