"""Rollback protection of the Git source, against a real `margo serve` over smart HTTP.

The REST source refuses a manifestVersion that does not grow; the Git source refuses a
branch tip that does not descend from the commit the device adopted (a branch moved back,
history rewritten), unless the operator accepted that tip. The branch is moved here the way
an attacker (or an operator) with access to the server's repository would: `git update-ref`
and `git commit-tree` in `fleet-state.git`. The device's cache is a shallow clone, as in
production, so these tests also show that the history needed to decide is fetched only
when the adopted commit is not the new tip's parent.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pygit2
import pytest
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet

from reconciler.desired import DesiredState
from reconciler.sources import Adopted, IntegrityError
from reconciler.sources.git_source import GitSource

GPU = "k8s-cluster-gpu"
_confidence = itertools.count(51)  # 0.51, 0.52, ...: inside the application's 0.1-0.99


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    root = tmp_path_factory.mktemp("git-history")
    with fleet_server(root, fleet=write_fleet(root / "fleet")) as running:
        running.put_capabilities(capabilities(GPU))
        running.wait_for_deployments(4)
        yield running


def git(server: FleetServer, *args: str) -> str:
    """Git in the server's shared repository of device branches."""
    done = subprocess.run(["git", f"--git-dir={server.data_dir / 'repos' / 'fleet-state.git'}",
                           *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def branch(server: FleetServer) -> str:
    [ref] = git(server, "for-each-ref", "--format=%(refname)", "refs/heads/devices").split()
    return ref


def tip(server: FleetServer) -> str:
    return git(server, "rev-parse", branch(server))


def move_branch(server: FleetServer, commit: str) -> None:
    git(server, "update-ref", branch(server), commit)


def new_commits(server: FleetServer, count: int) -> list[str]:
    """`count` new commits on the device branch, each from a changed intent parameter."""
    commits = []
    for _ in range(count):
        before = tip(server)
        server.set_parameter("vision-plant-a", "confidence", f"0.{next(_confidence)}")
        server.wait_for(lambda old=before: tip(server) != old,
                        what="a new commit on the device branch")
        commits.append(tip(server))
    return commits


def rewritten(server: FleetServer, parent: str, message: str) -> str:
    """A commit with the tree of the current tip but another parent: rewritten history."""
    tree = git(server, "rev-parse", f"{tip(server)}^{{tree}}")
    return git(server, "commit-tree", tree, "-p", parent, "-m", message)


def source(server: FleetServer, cache: Path, accept: str | None = None) -> GitSource:
    override = {} if accept is None else {"accept_history_rewrite": accept}
    return GitSource(server.git_url(GPU), cache_dir=cache, username=server.client_id,
                     password=server.token, **override)


def fetched(git_source: GitSource, adopted: Adopted) -> DesiredState:
    state = git_source.fetch(adopted)
    assert state is not None
    return state


def packs(cache: Path) -> int:
    return len(list((cache / "objects" / "pack").glob("*.pack")))


@pytest.fixture
def history(server: FleetServer) -> Iterator[list[str]]:
    """Four consecutive commits on the device branch, newest last; afterwards the branch is
    put back where it was (the next compile would fold it back anyway)."""
    commits = new_commits(server, 4)
    try:
        yield commits
    finally:
        move_branch(server, commits[-1])


def test_a_branch_moved_back_is_refused_and_keeps_being_refused(
        server: FleetServer, history: list[str], tmp_path: Path) -> None:
    first, *_, last = history
    with source(server, tmp_path / "cache") as device:
        adopted = fetched(device, Adopted())
        assert adopted.version == last
        move_branch(server, first)  # three commits back
        for _ in range(2):  # every poll, not just the first
            with pytest.raises(IntegrityError) as raised:
                device.fetch(Adopted(version=last))
            assert raised.value.code == "ROLLBACK"
            assert f"tip {first} does not descend from the adopted commit {last}" in \
                raised.value.message
            assert f"acceptHistoryRewrite: {first}" in raised.value.message
        move_branch(server, last)
        assert device.fetch(Adopted(version=last)) is None  # back where it was: unchanged


def test_rewritten_history_is_refused_even_when_newer(server: FleetServer, history: list[str],
                                                      tmp_path: Path) -> None:
    """Not only an older tip: a new commit whose history does not contain the adopted one
    (a force push onto an older base)."""
    forced = rewritten(server, history[0], "force-pushed")
    with source(server, tmp_path / "cache") as device:
        fetched(device, Adopted())
        move_branch(server, forced)
        with pytest.raises(IntegrityError) as raised:
            device.fetch(Adopted(version=history[-1]))
    assert raised.value.code == "ROLLBACK" and forced in raised.value.message


def test_a_descendant_is_accepted_and_history_is_fetched_only_when_needed(
        server: FleetServer, history: list[str], tmp_path: Path) -> None:
    """The usual case, the adopted commit is the tip's parent: one shallow fetch, as before.
    A device that missed commits (it was off while the server compiled three times) needs
    the history between: deeper fetches, until the adopted commit is found."""
    with source(server, tmp_path / "next") as device:
        state = fetched(device, Adopted(version=history[-2]))
    assert state.version == history[-1] and state.history_rewrite_accepted is None
    assert packs(tmp_path / "next") == 1
    shallow = pygit2.Repository(str(tmp_path / "next"))
    try:
        assert shallow.is_shallow and len(list(shallow.walk(history[-1]))) == 1
    finally:
        shallow.free()

    with source(server, tmp_path / "skipped") as device:
        state = fetched(device, Adopted(version=history[0]))
    assert state.version == history[-1]
    assert packs(tmp_path / "skipped") == 2  # the tip, then its history eight commits deep


def test_the_operator_accepts_a_rewound_branch_once(server: FleetServer, history: list[str],
                                                    tmp_path: Path) -> None:
    first, *_, last = history
    move_branch(server, first)
    with source(server, tmp_path / "cache", accept=first) as device:
        state = fetched(device, Adopted(version=last))
    assert (state.version, state.history_rewrite_accepted) == (first, first)

    # From there on the accepted commit is the reference: the branch moves on from it...
    onwards = rewritten(server, first, "onwards from the accepted commit")
    move_branch(server, onwards)
    with source(server, tmp_path / "cache", accept=first) as device:
        state = fetched(device, Adopted(version=first, history_rewrite_accepted=first))
        assert (state.version, state.history_rewrite_accepted) == (onwards, None)
        # ...and moving it back again is refused although the setting still names `first`:
        # the device's state says that override was used.
        move_branch(server, first)
        with pytest.raises(IntegrityError) as raised:
            device.fetch(Adopted(version=onwards, history_rewrite_accepted=first))
    assert raised.value.code == "ROLLBACK" and "was used once already" in raised.value.message


def test_an_accepted_rewrite_covers_commits_made_on_top_of_it(server: FleetServer,
                                                              history: list[str],
                                                              tmp_path: Path) -> None:
    """The server may have committed again between the rewind and the operator's change."""
    first, *_, last = history
    later = rewritten(server, first, "compiled after the rewind")
    move_branch(server, later)
    with source(server, tmp_path / "cache", accept=first) as device:
        state = fetched(device, Adopted(version=last))
    assert (state.version, state.history_rewrite_accepted) == (later, first)
    with source(server, tmp_path / "other", accept=history[1]) as device, \
            pytest.raises(IntegrityError):
        device.fetch(Adopted(version=last))  # an override naming another line of history


def test_the_override_must_be_a_full_commit_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full commit id"):
        GitSource("http://127.0.0.1:1/x.git", cache_dir=tmp_path, accept_history_rewrite="abc1234")
