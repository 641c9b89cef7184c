"""One server serves a compile's new state from the moment its branches move, as a
Git-source device sees it then, not once the compiler's state is committed and the compile's
objects freed (at a million devices those took 8 of the 10 s before the first manifest,
issue 35); and the full collection after a compile waits until devices have taken the
change up. Real Git, real SQLite; the compile service as `margo serve` runs it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import CompileReport
from compiler.gitstore import DeviceStore
from compiler.snapshot import snapshot_from_documents
from compiler.state import CompilerState
from tools.polling import poll_until
from wfm.fleet import compiles
from wfm.fleet.compiles import CompileService, SourceConfig
from wfm.telemetry.metrics import PROCESS


def _fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", parameters={"greeting": "one"})
    for index in range(3):
        fleet.devices[f"edge-{index}"] = device(f"edge-{index}")
    fleet.write()
    return fleet


def _recorded_trees(repos: Path) -> dict[str, str]:
    state = CompilerState(repos / "compiler-state.sqlite")
    try:
        return {d: r.tree for d, r in state.devices().items()}
    finally:
        state.close()


def test_the_new_state_is_served_before_the_compiler_state_is_committed(
        tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "fleet")
    repos = tmp_path / "repos"
    seen: list[tuple[CompileReport, dict[str, str | None], dict[str, str]]] = []

    def served(report: CompileReport | None) -> None:
        assert report is not None
        store = DeviceStore(repos)
        branches = {d: store.tree_id(d) for d in store.device_ids()}
        seen.append((report, branches, _recorded_trees(repos)))

    service = CompileService(
        repos, SourceConfig(fleet.source),
        lambda trusted: snapshot_from_documents(dict(fleet.devices), trusted=trusted),
        served, debounce=0)
    try:
        service.trigger()
        assert service.wait_idle() and service.last_error is None
        first_trees = _recorded_trees(repos)
        fleet.intents["web"]["spec"]["parameters"] = {"greeting": "two"}
        fleet.write()
        service.trigger()
        assert service.wait_idle() and service.last_error is None
        fleet.intents["web"]["spec"]["parameters"] = {"greeting": "two"}
        service.trigger()  # nothing changes: served once the compile is done
        assert service.wait_idle() and service.compiles == 3
    finally:
        service.stop()
    assert len(seen) == 3
    _, moved_to, recorded_then = seen[1]
    assert recorded_then == first_trees  # the state still said what the first compile did
    assert moved_to != first_trees and moved_to == _recorded_trees(repos)
    assert seen[2][0].commits == 0


def test_the_collection_after_a_compile_waits_for_a_quiet_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full collection after a compile holds the interpreter (1.3 s of a push window at
    10,000 devices): it waits while devices still take up the change (`quiet` says no), at
    most until `COLLECT_LATEST`. Observed through the real `freeze_survivors`, wrapped."""
    monkeypatch.setattr(compiles, "COLLECT_AFTER", 0.1)
    monkeypatch.setattr(compiles, "COLLECT_LATEST", 60.0)
    monkeypatch.setattr(compiles, "QUIET_RECHECK", 0.05)
    collected: list[float] = []

    def freeze_survivors() -> None:
        collected.append(time.monotonic())
        real_freeze()

    real_freeze = compiles.freeze_survivors
    monkeypatch.setattr(compiles, "freeze_survivors", freeze_survivors)
    count_before = _value("margo_compile_collection_duration_seconds_count")
    fleet = _fleet(tmp_path / "fleet")
    busy_until = [float("inf")]
    service = CompileService(
        tmp_path / "repos", SourceConfig(fleet.source),
        lambda trusted: snapshot_from_documents(dict(fleet.devices), trusted=trusted),
        lambda report: None, debounce=0, quiet=lambda: time.monotonic() >= busy_until[0])
    try:
        service.trigger()
        assert service.wait_idle()
        compiled = time.monotonic()
        time.sleep(0.6)
        assert collected == []  # due after 0.1 s, but the server is busy
        busy_until[0] = time.monotonic()  # quiet from now on
        poll_until("the collection once quiet", lambda: collected, timeout=5, interval=0.02)
        assert collected[0] - compiled < 30  # (not at the latest: that is 60 s)
        poll_until("the collection timed", lambda: _timed(count_before + 1), timeout=5,
                   interval=0.02)
        assert _value("margo_compile_collection_last_timestamp_seconds") >= \
            _value("margo_compile_last_success_timestamp_seconds")
        busy_until[0] = float("inf")  # busy for good: collected at the latest anyway
        monkeypatch.setattr(compiles, "COLLECT_LATEST", 1.5)
        fleet.intents["web"]["spec"]["parameters"] = {"greeting": "again"}
        fleet.write()
        service.trigger()
        assert service.wait_idle()
        compiled = time.monotonic()
        poll_until("the collection at the latest", lambda: len(collected) == 2, timeout=10,
                   interval=0.02)
        assert collected[1] - compiled >= 1.2
    finally:
        service.stop()


def _value(sample: str) -> float:
    """One sample of this process's metrics (`wfm.telemetry.metrics.PROCESS`)."""
    return PROCESS.get_sample_value(sample) or 0.0


def _timed(count: float) -> bool:
    """Whether `count` collections after compiles were timed (the gauge is set after)."""
    return _value("margo_compile_collection_duration_seconds_count") >= count and \
        _value("margo_compile_collection_last_timestamp_seconds") > 0
