"""What a process remembers between compiles (the device records, the ref listing, a lazy
snapshot of a keyed file the state trusts) never hides a change: each input a recompile
skips reading is read again once it changed, whoever changed it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import compile_fleet
from compiler.gitstore import DeviceStore, device_ref
from compiler.packedrefs import ref_names
from compiler.report import CompileReport
from compiler.snapshot import LazyDevices, load_snapshot
from compiler.source import load_source
from compiler.state import CompilerState, DeviceRecord


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    f = Fleet(tmp_path)
    f.apps["com-example-app"] = app()
    f.intents["plant"] = intent("plant", targets={"selectors": [{"labelSelector": {
        "matchExpressions": [{"key": "site", "operator": "In", "values": ["plant"]}]}}]},
        parameters={"greeting": "hi"})
    for n in range(4):
        f.devices[f"d{n}"] = device(f"d{n}", labels={"site": "plant" if n % 2 else "lab"})
    return f


def compile_keyed(fleet: Fleet, now: float = 1_000_000.0) -> tuple[CompileReport, object]:
    """A compile as the server and `margo compile` run it: one keyed JSON file, read with
    the state's trusted digests; also returns the snapshot's devices."""
    fleet.write()
    keyed = fleet.root / "caps.json"
    keyed.write_text(json.dumps(fleet.devices, indent=1))
    fleet.repos.mkdir(parents=True, exist_ok=True)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        snapshot = load_snapshot(keyed, trusted=state.trusted_digests())
        report = compile_fleet(load_source(fleet.source), snapshot, DeviceStore(fleet.repos),
                               state, now=now)
    finally:
        state.close()
    assert not report.errors, report.errors
    return report, snapshot.devices


def test_a_noop_builds_no_device_and_every_change_is_still_noticed(fleet: Fleet) -> None:
    assert compile_keyed(fleet)[0].commits == 4
    report, devices = compile_keyed(fleet)
    assert isinstance(devices, LazyDevices) and report.commits == 0 and report.unchanged == 4
    assert report.deployments == 2
    fleet.devices["d0"] = device("d0", labels={"site": "plant"})  # a document changed
    report, _ = compile_keyed(fleet)
    assert report.commits == 1 and report.deployments == 3
    fleet.devices["d9"] = device("d9", labels={"site": "plant"})  # a device added
    assert compile_keyed(fleet)[0].commits == 1
    del fleet.devices["d1"]  # a device removed: left as it is, no longer counted
    report, _ = compile_keyed(fleet)
    assert report.commits == 0 and report.unchanged == 4 and report.deployments == 3
    fleet.intents["plant"]["spec"]["parameters"]["greeting"] = "hello"
    assert compile_keyed(fleet)[0].commits == 3  # an intent changed: its devices
    assert compile_keyed(fleet)[0].commits == 0


def test_a_branch_lost_after_the_listing_was_remembered_is_rebuilt(fleet: Fleet) -> None:
    compile_keyed(fleet)
    compile_keyed(fleet)  # the listing of this packed-refs is remembered now
    git_dir = fleet.repos / "fleet-state.git"
    subprocess.run(["git", "--git-dir", str(git_dir), "update-ref", "-d", device_ref("d1")],
                   check=True)
    assert compile_keyed(fleet)[0].commits == 1 and fleet.store.tip("d1") is not None
    (git_dir / "packed-refs").unlink()  # every branch lost
    assert compile_keyed(fleet)[0].commits == 4
    assert compile_keyed(fleet)[0].commits == 0


def test_the_remembered_listing_is_what_libgit2_lists(fleet: Fleet) -> None:
    compile_keyed(fleet)
    git_dir = fleet.repos / "fleet-state.git"
    store = DeviceStore(fleet.repos)
    listed = frozenset(store._own_repo().listall_references())
    assert store.branch_names() == ref_names(git_dir) == listed
    tip = store.tip("d0")
    assert tip is not None  # a loose ref, as git writes one, is seen at once
    subprocess.run(["git", "--git-dir", str(git_dir), "update-ref", "refs/heads/devices/x",
                    tip], check=True)
    assert store.branch_names() == listed | {"refs/heads/devices/x"}


def test_records_changed_by_another_writer_are_read_again(fleet: Fleet) -> None:
    compile_keyed(fleet)
    path = fleet.repos / "compiler-state.sqlite"
    raw = sqlite3.connect(path, isolation_level=None)
    try:  # a writer that knows nothing of the id (an older compiler, a hand edit)
        raw.execute("UPDATE devices SET caps_digest = 'sha256:x' WHERE device_id = 'd0'")
    finally:
        raw.close()
    state = CompilerState(path)
    try:
        assert state.devices()["d0"].caps_digest == "sha256:x"
    finally:
        state.close()
    report, _ = compile_keyed(fleet)
    assert report.commits == 0  # d0 compiled again (its tree unchanged), its record mended
    state = CompilerState(path)
    try:
        memo = state.snapshot_memo()
        assert memo is not None and state.devices()["d0"].caps_digest == memo.digests["d0"]
    finally:
        state.close()


def test_remembered_records_equal_a_fresh_read_after_a_save_or_a_rollback(
        tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    state = CompilerState(path)
    empty: dict[str, list[object]] = {"intents": [], "forget_intents": [], "placements": []}
    try:
        state.devices()
        state.save(devices=[DeviceRecord("a", "sha256:1", 5, "t", 2),  # type: ignore[arg-type]
                            DeviceRecord("b", "sha256:2", 6.5, "t", 1)],
                   forget_devices=["b"], **empty)
        remembered = state.device_records()
        state.stage(devices=[DeviceRecord("c", "sha256:3", 7.0, "t", 1)],  # type: ignore
                    forget_devices=[], **empty).rollback()
        after_rollback = state.device_records()
    finally:
        state.close()
    fresh = sqlite3.connect(path)
    try:
        rows = fresh.execute("SELECT * FROM devices").fetchall()
    finally:
        fresh.close()
    assert rows == [("a", "sha256:1", 5.0, "t", 2)]
    expected = ({"a": DeviceRecord("a", "sha256:1", 5.0, "t", 2)}, {"a": "sha256:1"}, 2)
    assert remembered == after_rollback == expected
    assert isinstance(remembered[0]["a"].compiled_at, float)


def test_forgetting_devices_is_noticed(fleet: Fleet) -> None:
    compile_keyed(fleet)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        assert "d1" in state.devices()
        state.forget(["d1"])
        assert "d1" not in state.devices()
    finally:
        state.close()


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_lazy_devices_are_the_documents_of_the_file(fleet: Fleet, ensure_ascii: bool) -> None:
    """ASCII files are read span by span from their bytes, others from their text: a device
    with non-ASCII labels is the same either way, and the same as read eagerly."""
    fleet.devices["d0"] = device("d0", labels={"site": "plant", "note": "caf\u00e9 \u2713"})
    compile_keyed(fleet)
    keyed = fleet.root / "caps.json"
    keyed.write_text(json.dumps(fleet.devices, indent=1, ensure_ascii=ensure_ascii),
                     encoding="utf-8")
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        snapshot = load_snapshot(keyed, trusted=state.trusted_digests())
        compile_fleet(load_source(fleet.source), snapshot, DeviceStore(fleet.repos), state,
                      now=2_000_000.0)
        lazy = load_snapshot(keyed, trusted=state.trusted_digests()).devices
    finally:
        state.close()
    eager = load_snapshot(keyed).devices
    assert isinstance(lazy, LazyDevices) and not isinstance(eager, LazyDevices)
    assert sorted(lazy) == sorted(eager)
    for device_id in eager:
        assert lazy[device_id].labels == eager[device_id].labels
        assert lazy[device_id].capabilities == eager[device_id].capabilities
        assert lazy[device_id] == eager[device_id]


def test_a_noop_takes_its_devices_as_recorded_only_from_the_records_it_read(
        fleet: Fleet) -> None:
    """A lazy snapshot whose every digest the state's trusted digests hold is recorded as
    it is without comparing the digests again, but only while the state still holds the
    records those digests were copied from: a writer changing a record in between makes
    the compile compare, and compile that device."""
    compile_keyed(fleet)
    keyed = fleet.root / "caps.json"
    path = fleet.repos / "compiler-state.sqlite"
    state = CompilerState(path)
    try:
        trusted = state.trusted_digests()
        snapshot = load_snapshot(keyed, trusted=trusted)
        assert isinstance(snapshot.devices, LazyDevices)
        assert snapshot.devices.vouched_by is trusted and state.records_are_those_of(trusted)
        raw = sqlite3.connect(path, isolation_level=None)
        try:
            raw.execute("UPDATE devices SET caps_digest = 'sha256:x' WHERE device_id = 'd0'")
        finally:
            raw.close()
        assert not state.records_are_those_of(trusted)
        report = compile_fleet(load_source(fleet.source), snapshot, DeviceStore(fleet.repos),
                               state, now=2_000_000.0)
        mended = state.devices()["d0"].caps_digest
    finally:
        state.close()
    assert not report.errors and mended == trusted["d0"]  # d0 compiled again, its record mended


def test_a_full_read_works_out_what_the_next_noop_asks_of_its_memo(fleet: Fleet) -> None:
    compile_keyed(fleet)
    memo = load_snapshot(fleet.root / "caps.json").memo
    assert memo is not None and {"ids", "plain_ids", "all_plain_digested"} <= vars(memo).keys()
    assert memo.ids == sorted(memo.spans) == sorted(fleet.devices)
    assert memo.plain_ids and memo.all_plain_digested
