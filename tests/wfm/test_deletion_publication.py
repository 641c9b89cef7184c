"""A device deletion published by any replica (`wfm.fleet.deletions.publish_deletion`) against
the compiling replica's side of it: a compile that raced the deletion publishes nothing of
the deleted branch, an idle holder drops the branch and what its compiler state remembers of
the device before it compiles again, and neither the served copy nor a later publication
ever brings the branch back."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kits.replicakit import lease_holder

from compiler.gitstore import REPOSITORY_NAME, device_ref
from compiler.state import CompilerState
from tools.polling import poll_until
from wfm.store import replica_rows
from wfm.store.pgdb import PostgresDatabase

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator


@pytest.fixture
def holder(pg_url: str, tmp_path: Path) -> Iterator[tuple[PostgresDatabase, object]]:
    with lease_holder(pg_url, tmp_path / "data") as held:
        yield held


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    return subprocess.run(["git", f"--git-dir={repo}", *args], capture_output=True, text=True,
                          env=env, check=True).stdout.strip()


def commit(repo: Path, device_id: str, text: str) -> str:
    """A commit on the device's branch (after its tip, if any) holding `text`."""
    blob = subprocess.run(["git", f"--git-dir={repo}", "hash-object", "-w", "--stdin"],
                          input=text, capture_output=True, text=True, check=True).stdout.strip()
    tree = subprocess.run(["git", f"--git-dir={repo}", "mktree"],
                          input=f"100644 blob {blob}\td.yaml\n", capture_output=True,
                          text=True, check=True).stdout.strip()
    ref = device_ref(device_id)
    parent = subprocess.run(["git", f"--git-dir={repo}", "rev-parse", "--verify", "-q", ref],
                            capture_output=True, text=True).stdout.strip()
    made = git(repo, "commit-tree", tree, *(("-p", parent) if parent else ()), "-m", text)
    git(repo, "update-ref", ref, made)
    return made


def tip(repo: Path, device_id: str) -> str | None:
    done = subprocess.run(["git", f"--git-dir={repo}", "rev-parse", "--verify", "-q",
                           device_ref(device_id)], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def published(db: PostgresDatabase, device_id: str) -> str | None:
    return db.read(lambda c: c.execute("SELECT target FROM git_refs WHERE name = ?",
                                       (device_ref(device_id),)).fetchone()[0])


def first_generation(coordinator: Coordinator) -> tuple[Path, str, str]:
    """The holder's first publication, with branches `gone` and `kept` (and its compiler
    state): its work folder and the two tips."""
    work = coordinator.prepare()
    assert work is not None
    repo = work / REPOSITORY_NAME
    gone, kept = commit(repo, "gone", "secret of the first owner"), commit(repo, "kept", "k")
    assert coordinator.publish() is not None
    CompilerState(work / "compiler-state.sqlite").close()
    return work, gone, kept


def test_a_compile_that_raced_a_deletion_publishes_nothing_of_the_deleted_branch(
        holder: tuple[PostgresDatabase, object]) -> None:
    from wfm.fleet.coordination import Coordinator
    from wfm.fleet.deletions import publish_deletion

    db, coordinator = holder
    assert isinstance(coordinator, Coordinator)
    work, old, kept = first_generation(coordinator)
    repo = work / REPOSITORY_NAME

    # The next compile has read the old state; the device is deleted before it publishes.
    coordinator.prepare()
    raced = commit(repo, "gone", "more of the first owner")
    moved = commit(repo, "kept", "k2")
    db.write_sync(lambda conn: publish_deletion(conn, ["gone"]))
    result = coordinator.publish()
    assert result is not None and result.refs == 1
    assert published(db, "gone") is None and published(db, "kept") == moved
    assert tip(repo, "gone") is None and tip(coordinator.serving.path, "gone") is None
    assert tip(coordinator.serving.path, "kept") == moved
    # The pack published holds the other device's new commit, nothing of the deleted one.
    newest = db.read(lambda c: replica_rows.read_snapshot(
        c, "devices", replica_rows.published_generation(c, "devices") - 1,
        dialect=db.dialect, spool=work)).packs[-1].pack
    unpacked = work / "unpacked.git"
    subprocess.run(["git", "init", "-q", "--bare", str(unpacked)], check=True)
    subprocess.run(["git", f"--git-dir={unpacked}", "index-pack", "--stdin"], input=newest,
                   capture_output=True, check=True)
    present = {oid: subprocess.run(["git", f"--git-dir={unpacked}", "cat-file", "-e", oid],
                                   capture_output=True).returncode == 0
               for oid in (raced, moved)}
    assert present == {raced: False, moved: True}
    assert raced not in git(coordinator.serving.path, "rev-list", "--all")
    forgotten = CompilerState(work / "compiler-state.sqlite")
    try:
        assert "gone" in forgotten.forgotten()
    finally:
        forgotten.close()
    assert old != raced and kept != moved


def test_an_idle_holder_drops_the_branch_and_forgets_the_device_before_it_compiles(
        holder: tuple[PostgresDatabase, object]) -> None:
    from wfm.fleet.coordination import Coordinator
    from wfm.fleet.deletions import publish_deletion

    db, coordinator = holder
    assert isinstance(coordinator, Coordinator)
    work, _, kept = first_generation(coordinator)
    repo = work / REPOSITORY_NAME

    generation = db.write_sync(lambda conn: publish_deletion(conn, ["gone"]))
    poll_until("the served copy to drop the branch",
               lambda: coordinator.generation == generation, timeout=10)
    assert tip(coordinator.serving.path, "gone") is None
    assert tip(coordinator.serving.path, "kept") == kept
    assert coordinator.prepare() == work
    assert tip(repo, "gone") is None and tip(repo, "kept") == kept
    # The state is kept (the deletion is the only publication since this holder's own),
    # without the device: a re-registered id is compiled as a new one.
    state = CompilerState(work / "compiler-state.sqlite")
    try:
        assert "gone" in state.forgotten()
    finally:
        state.close()
    fresh = commit(repo, "gone", "the new owner's")
    assert coordinator.publish() is not None
    assert published(db, "gone") == fresh
    assert git(coordinator.serving.path, "rev-list", "--max-parents=0",
               device_ref("gone")) == fresh
    # The whole published state applied again (a repair) agrees.
    coordinator._sync(full=True)
    assert tip(coordinator.serving.path, "gone") == fresh
