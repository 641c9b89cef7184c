"""Shortcuts of a recompile that compiles a tenth of the fleet: the steady devices'
deployments summed over the smaller side, placements read column by column, trees
serialised by one encoder. Each gives exactly what the plain way gives."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from compiler.planning import _steady_deployments
from compiler.state import CompilerState, DeviceRecord, PlacementRecord, _files_json


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


@given(st.dictionaries(st.text(), st.text()))
def test_trees_are_serialised_as_json_dumps_does(files: dict[str, str]) -> None:
    assert _files_json(files) == json.dumps(files, sort_keys=True, separators=(",", ":"))


def test_the_pipe_to_git_is_widened_where_the_system_allows() -> None:
    """Where Linux lets an unprivileged process have a 1 MiB pipe, Git's input gets one
    (elsewhere the pipe keeps its size: only speed depends on it)."""
    import fcntl
    import subprocess

    from compiler.gitstore import _PIPE_SIZE, _widen_pipe

    process = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        _widen_pipe(process)
        assert process.stdin is not None
        getter = getattr(fcntl, "F_GETPIPE_SZ", None)
        limit = Path("/proc/sys/fs/pipe-max-size")
        if getter is not None and limit.exists() and int(limit.read_text()) >= _PIPE_SIZE:
            assert fcntl.fcntl(process.stdin.fileno(), getter) == _PIPE_SIZE
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait()
