"""A branch the compiler made and the repository lost is rebuilt by the next compile (never
left missing because nothing changed); a forgotten device starts again from nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kits.fleetkit import Fleet, app, device, intent

from compiler.gitstore import DeviceCommit, GitStoreError, InvalidCommitError, device_ref
from compiler.recorded import recorded_branch
from compiler.state import CompilerState


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    f = Fleet(tmp_path)
    f.apps["com-example-app"] = app()
    f.intents["everywhere"] = intent("everywhere", parameters={
        "greeting": "hi {{ device.labels['site'] }}"})
    f.devices["d1"] = device("d1", labels={"site": "one"})
    f.devices["d2"] = device("d2", labels={"site": "two"})
    return f


def drop_ref(repos: Path, ref: str) -> None:
    packed = repos / "fleet-state.git" / "packed-refs"
    packed.write_text("".join(line for line in packed.read_text().splitlines(keepends=True)
                              if not line.rstrip("\n").endswith(" " + ref)))
    (repos / "fleet-state.git" / ref).unlink(missing_ok=True)


def test_a_lost_branch_is_rebuilt_by_a_compile_with_nothing_changed(fleet: Fleet) -> None:
    assert fleet.compile().restored_branches == 0
    tree = fleet.store.tree_ids("d1")
    tip = fleet.store.tip("d1")
    assert tree and recorded_branch(fleet.repos, "d1") == tip
    drop_ref(fleet.repos, device_ref("d1"))
    assert fleet.store.tip("d1") is None
    assert recorded_branch(fleet.repos, "d1") == tip  # what says the state is lost
    report = fleet.compile()  # no input changed
    assert report.commits == 1
    # (what tells a replica that the compile's own pack is not all the branch needs)
    assert report.restored_branches == 1
    assert fleet.store.tree_ids("d1") == tree
    # The rebuilt branch continues its history: a fast-forward for a device on Git.
    newest = fleet.store.history("d1", limit=1)[0]
    assert newest.parent == tip
    assert newest.message.startswith("Restore the lost branch of d1")
    assert fleet.compile().commits == 0


def test_a_lost_branch_whose_commit_is_gone_too_starts_again(fleet: Fleet) -> None:
    fleet.compile()
    tree = fleet.store.tree_ids("d1")
    drop_ref(fleet.repos, device_ref("d1"))
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:  # the state names a commit the repository does not have
        with state.transaction() as db:
            db.execute("UPDATE device_trees SET tip = ? WHERE device_id = 'd1'", ("0" * 40,))
    finally:
        state.close()
    assert fleet.compile().commits == 1
    assert fleet.store.tree_ids("d1") == tree
    assert fleet.store.history("d1")[0].parent is None


def test_forgotten_devices_lose_branch_and_records(fleet: Fleet) -> None:
    fleet.compile()
    old = fleet.store.tip("d1")
    store = fleet.store
    with store.lock():
        assert store.delete_branches(["d1", "nobody"]) == {"d1": old}
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        state.forget(["d1"])
        assert "d1" not in state.devices() and state.placements_for("d1") == {}
    finally:
        state.close()
    assert store.tip("d1") is None and store.tip("d2") is not None
    assert recorded_branch(fleet.repos, "d1") is None
    git_dir = fleet.repos / "fleet-state.git"
    listed = subprocess.run(["git", f"--git-dir={git_dir}", "for-each-ref"],
                            capture_output=True, text=True, check=True).stdout
    assert device_ref("d1") not in listed
    fleet.devices["d1"] = device("d1", labels={"site": "new-owner"})
    fleet.compile()
    history = fleet.store.history("d1")
    assert len(history) == 1 and history[0].parent is None and history[0].id != old


def test_restoring_a_branch_that_exists_moves_nothing(fleet: Fleet) -> None:
    fleet.compile()
    store = fleet.store
    tip = store.tip("d1")
    assert tip is not None
    restore = DeviceCommit("d1", {"x.yaml": b"x: 1\n"}, "restore", 1, parent=tip,
                           parent_known=True, branch_lost=True)
    with store.lock(), pytest.raises(GitStoreError):
        store.write([restore])
    assert store.tip("d1") == tip
    with pytest.raises(InvalidCommitError):
        store.write([DeviceCommit("d1", {}, "restore", 1, parent_known=True,
                                  branch_lost=True)])
    drop_ref(fleet.repos, device_ref("d1"))
    with store.lock():
        new = store.write([restore])["d1"]
    assert store.history("d1")[0].id == new and store.history("d1")[0].parent == tip


def test_a_compile_racing_a_deletion_never_revives_the_old_history(fleet: Fleet) -> None:
    """A compile that read the state before a device was forgotten may write its records
    back afterwards; the id, registered again, must still start from nothing."""
    fleet.compile()
    old = fleet.store.tip("d1")
    store = fleet.store
    path = fleet.repos / "compiler-state.sqlite"
    state = CompilerState(path)
    try:
        stale = state.devices()["d1"], state.trees_of(["d1"])["d1"]
        with store.lock():
            store.delete_branches(["d1"])
        state.forget(["d1"])
        state.save(intents=[], forget_intents=[], devices=[stale[0]], placements=[],
                   forget_devices=[], trees={"d1": stale[1]})  # the racing compile's save
        assert state.forgotten() == {"d1"}
    finally:
        state.close()
    assert recorded_branch(fleet.repos, "d1") is None  # not "lost": deleted on purpose
    fleet.compile()
    history = fleet.store.history("d1")
    assert [c.parent for c in history] == [None] and history[0].id != old
    state = CompilerState(path)
    try:
        assert state.forgotten() == frozenset()
    finally:
        state.close()
