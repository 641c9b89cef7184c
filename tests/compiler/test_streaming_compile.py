"""How a compile writes: commits stream to Git while devices render, the state is saved only
when every branch has moved, and the lock is held only while something is written. Real Git,
real SQLite, real worker processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pygit2
import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler import workers as compile_workers
from compiler.compilation import CompileReport, compile_fleet
from compiler.gitstore import DeviceStore, GitStoreError
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from compiler.state import CompilerState


def _fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app(constraints={"capacityRequirements": {"memory": "4Gi"}})
    fleet.apps["com-example-other"] = app("com-example-other")
    fleet.intents["a"] = intent("a", parameters={"greeting": "{{ device.labels['site'] }}"})
    fleet.intents["b"] = intent("b", app_id="com-example-other", targets={"selectors": [
        {"labelSelector": {"matchExpressions": [
            {"key": "site", "operator": "In", "values": ["s1", "s2", "s3"]}]}}]})
    for i in range(8):
        fleet.devices[f"d{i}"] = device(f"d{i}", memory=f"{2 + i}Gi", labels={"site": f"s{i}"},
                                        types=("helm",) if i % 3 else ("compose",))
    return fleet


def _compile(fleet: Fleet, store: DeviceStore, *, now: float,
             dry_run: bool = False) -> CompileReport:
    """`Fleet.compile`, but through the given store (e.g. one with another git program)."""
    fleet.write()
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        return compile_fleet(load_source(fleet.source),
                             load_snapshot(fleet.caps, trusted=state.trusted_digests()),
                             store, state, now=now, dry_run=dry_run)
    finally:
        state.close()


def _remembered(fleet: Fleet) -> tuple[object, ...]:
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        return (state.intents(), state.devices(),
                state.placements_of(sorted(fleet.devices)))
    finally:
        state.close()


def test_the_state_remembers_the_trees_git_has(tmp_path: Path) -> None:
    """Tree ids are computed while rendering, never read back: they must be Git's."""
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
    fleet.devices["d1"]["labels"] = {"site": "s3"}
    fleet.compile(now=2_000)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        records = state.devices()
    finally:
        state.close()
    assert sorted(records) == fleet.store.device_ids()
    for device_id, record in records.items():
        assert record.tree == fleet.store.tree_id(device_id), device_id


def test_a_failed_branch_update_saves_nothing_and_the_next_compile_catches_up(
        tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "fleet")
    fleet.compile(now=1_000)
    tips = {d: fleet.store.tip(d) for d in fleet.store.device_ids()}
    remembered = _remembered(fleet)
    fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
    del fleet.intents["a"]

    held = fleet.store.path / "packed-refs.lock"  # as a git process writing refs holds it
    held.touch()
    with pytest.raises(GitStoreError, match=r"packed-refs\.lock exists"):
        _compile(fleet, DeviceStore(fleet.repos), now=2_000)
    held.unlink()
    assert {d: fleet.store.tip(d) for d in fleet.store.device_ids()} == tips
    assert _remembered(fleet) == remembered  # the staged records were rolled back

    report = fleet.compile(now=3_000)
    assert report.commits == len(fleet.devices) and not report.errors
    fresh = Fleet(tmp_path / "fresh", fleet.apps, fleet.intents, fleet.devices)
    fresh.compile(now=3_000)
    for device_id in fleet.store.device_ids():
        assert fleet.tree(device_id) == fresh.tree(device_id), device_id


def test_the_lock_is_taken_only_when_something_is_written(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    with DeviceStore(fleet.repos).lock():
        assert fleet.compile(now=2_000).commits == 0  # a no-op compile writes nothing
        fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
        remembered = _remembered(fleet)
        with pytest.raises(GitStoreError, match="another compiler"):
            fleet.compile(now=3_000)
        assert _remembered(fleet) == remembered
    assert fleet.compile(now=4_000).commits == 3  # d1, d2, d3: the devices "b" targets


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_plan_consumes_every_device_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: str) -> None:
    monkeypatch.setenv("MARGO_COMPILE_WORKERS", workers)
    fleet = _fleet(tmp_path)
    report = fleet.compile(now=1_000, dry_run=True)
    assert (report.commits, len(report.results)) == (8, 8)
    assert fleet.store.device_ids() == []
    assert _remembered(fleet)[:2] == ({}, {})


def test_forked_incremental_compiles_equal_single_process_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers read stored files (to classify changes) through their own Git handle; which
    devices each intent targets is worked out in two processes (as for a large fleet)."""
    monkeypatch.setattr(compile_workers, "PARALLEL_TARGETING", 1)
    histories, reports = [], []
    for workers in ("1", "2"):
        monkeypatch.setenv("MARGO_COMPILE_WORKERS", workers)
        fleet = _fleet(tmp_path / workers)
        fleet.intents["a"]["spec"]["gracePeriod"] = "10m"
        fleet.compile(now=1_000)
        fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
        fleet.compile(now=2_000)
        fleet.devices["d4"]["properties"]["memory"] = "1Gi"  # loses "a", kept for a while
        fleet.devices["d2"]["labels"] = {"site": "s9"}  # loses "b"
        report = fleet.compile(now=3_000)
        assert not report.errors
        reports.append([(r.device_id, r.status, r.changes, r.notes, r.grace_until)
                        for r in report.results])
        histories.append({d: [(c.message, fleet.store.read_files(d, c.id))
                               for c in fleet.store.history(d)]
                          for d in fleet.store.device_ids()})
    assert histories[0] == histories[1]
    assert reports[0] == reports[1]
    assert any(notes and grace for _, _, _, notes, grace in reports[0])
    assert "reconfigure" in histories[0]["d1"][0][0]  # the old file was read to say so


def test_unchanged_files_are_kept_exactly(tmp_path: Path) -> None:
    """Files a compile does not re-render are kept by blob id: same bytes, same tree."""
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    before = {d: fleet.tree(d) for d in fleet.store.device_ids()}
    fleet.intents["b"]["spec"]["parameters"] = {"greeting": "changed"}
    fleet.compile(now=2_000)
    for device_id, files in before.items():
        after = fleet.tree(device_id)
        assert after.get("a.yaml") == files.get("a.yaml")
        assert ("b.yaml" in after) == ("b.yaml" in files)


def test_worker_processes_are_gone_after_a_failed_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARGO_COMPILE_WORKERS", "2")
    fleet = _fleet(tmp_path)
    store = DeviceStore(fleet.repos)
    packs = store.path / "objects" / "pack"
    shutil.rmtree(packs)
    packs.write_bytes(b"")  # the pack cannot be written: a real file system failure
    # Other tests' session fixtures (servers, registries) are children of this process too:
    # only processes that appeared during the compile count.
    before = _children()
    with pytest.raises(GitStoreError, match="cannot write objects"):
        _compile(fleet, store, now=1_000)
    assert _children() - before == set()
    packs.unlink()
    assert fleet.compile(now=2_000).commits == 8


def _children() -> set[str]:
    return {pid for pid in os.listdir("/proc") if pid.isdigit()
            and _parent_of(pid) == os.getpid()}


def _parent_of(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_entries_no_compile_writes_are_removed_when_the_device_is_compiled(
        tmp_path: Path) -> None:
    """A subtree or an executable slipped into a device branch is not "the same tree"."""
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    compiled = fleet.tree("d1")
    repo = pygit2.Repository(str(fleet.store.path))
    tip = repo[fleet.store.tip("d1")]
    builder = repo.TreeBuilder(tip.tree)
    builder.insert("extra", repo.TreeBuilder().write(), pygit2.GIT_FILEMODE_TREE)
    builder.insert("run.sh", repo.create_blob(b"#!/bin/sh\n"), pygit2.GIT_FILEMODE_BLOB_EXECUTABLE)
    signature = pygit2.Signature("someone", "someone@example.invalid", 1_500, 0)
    tampered = repo.create_commit(None, signature, signature, "tamper\n", builder.write(),
                                  [tip.id])
    repo.references["refs/heads/devices/d1"].set_target(tampered)
    stored = fleet.store.tree("d1")
    assert stored is not None and stored.foreign and "run.sh" not in stored.ids
    (fleet.repos / "compiler-state.sqlite").unlink()  # recompile every device
    report = fleet.compile(now=2_000)
    assert [r.device_id for r in report.results if r.status == "committed"] == ["d1"]
    assert fleet.tree("d1") == compiled
    assert not fleet.store.tree("d1").foreign


def _compile_telling(fleet: Fleet, on_moved: object, *, now: float) -> CompileReport:
    fleet.write()
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        return compile_fleet(load_source(fleet.source),
                             load_snapshot(fleet.caps, trusted=state.trusted_digests()),
                             fleet.store, state, now=now, on_moved=on_moved)  # type: ignore
    finally:
        state.close()


def test_on_moved_sees_every_branch_moved_before_the_state_is_committed(
        tmp_path: Path) -> None:
    """What a server serves from the moment the branches move (a Git-source device sees
    them then): the report with its commits; the state still says what it said before."""
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    before = _remembered(fleet)
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "moved"}
    seen: list[tuple[dict[str, str], dict[str, str], tuple[object, ...]]] = []

    def on_moved(report: CompileReport) -> None:
        commits = {r.device_id: r.commit for r in report.results if r.status == "committed"}
        tips = {d: fleet.store.tip(d) for d in commits}
        seen.append((commits, tips, _remembered(fleet)))  # type: ignore[arg-type]

    report = _compile_telling(fleet, on_moved, now=2_000)
    assert len(seen) == 1
    commits, tips, remembered = seen[0]
    assert commits and commits == tips
    assert remembered == before
    assert _remembered(fleet) != before
    assert {r.device_id: r.commit for r in report.results
            if r.status == "committed"} == commits


def test_the_state_is_committed_when_on_moved_fails(tmp_path: Path) -> None:
    """The branches have moved: the state must say so even if what serves them failed."""
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    fleet.intents["a"]["spec"]["parameters"] = {"greeting": "moved"}

    def on_moved(report: CompileReport) -> None:
        raise RuntimeError("serving failed")

    with pytest.raises(RuntimeError, match="serving failed"):
        _compile_telling(fleet, on_moved, now=2_000)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        records = state.devices()
    finally:
        state.close()
    for device_id, record in records.items():
        assert record.tree == fleet.store.tree_id(device_id), device_id
    again = fleet.compile(now=3_000)
    assert again.commits == 0


def test_on_moved_is_not_called_when_no_branch_moves(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    fleet.compile(now=1_000)
    called: list[CompileReport] = []
    report = _compile_telling(fleet, called.append, now=2_000)
    assert report.commits == 0 and called == []
