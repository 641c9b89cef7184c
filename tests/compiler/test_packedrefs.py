"""Moving refs by rewriting packed-refs: what Git and libgit2 read back, compare-and-swap,
Git's lock protocol, and bad files refused with nothing changed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pygit2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.packedrefs import (
    LooseRefsError,
    PackedRefsError,
    RefMovedError,
    move_refs,
    ref_targets,
)

#: Fixed identity and dates: the same commands make the same commits in any repository.
_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_DATE": "1700000000 +0000",
        "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}


def git(repo: Path, *args: str, input: bytes | None = None) -> str:
    return subprocess.run(["git", f"--git-dir={repo}", *args], input=input, check=True,
                          capture_output=True, env=_ENV).stdout.decode()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo.git"
    subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    return path


def commits(repo: Path, count: int) -> list[str]:
    """`count` distinct commits (no ref points at them)."""
    tree = git(repo, "mktree", input=b"").strip()
    return [git(repo, "commit-tree", tree, "-m", f"c{i}").strip() for i in range(count)]


def refs(repo: Path) -> dict[str, str]:
    lines = git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return dict(line.split(" ") for line in lines)


def test_git_and_libgit2_read_the_moved_refs_and_no_loose_file_is_written(repo: Path) -> None:
    a, b = commits(repo, 2)
    move_refs(repo, {"refs/heads/devices/x": (None, a), "refs/heads/devices/y": (None, b)})
    assert refs(repo) == {"refs/heads/devices/x": a, "refs/heads/devices/y": b}
    assert not (repo / "refs" / "heads" / "devices").exists()
    assert not (repo / "packed-refs.lock").exists()
    move_refs(repo, {"refs/heads/devices/x": (a, b)})
    assert str(pygit2.Repository(str(repo)).references["refs/heads/devices/x"].target) == b
    assert git(repo, "rev-parse", "refs/heads/devices/y").strip() == b


def test_the_file_is_what_git_pack_refs_writes_and_other_refs_keep_their_lines(
        repo: Path) -> None:
    """An annotated tag keeps its peel line, and `git pack-refs` finds nothing to change."""
    a, b, c = commits(repo, 3)
    git(repo, "update-ref", "refs/heads/main", a)
    git(repo, "tag", "-a", "-m", "release", "v1", a)
    git(repo, "update-ref", "refs/heads/devices/old", b)
    git(repo, "pack-refs", "--all", "--prune")
    before = (repo / "packed-refs").read_bytes()
    assert b"\n^" + a.encode() in before  # the tag's peeled line
    move_refs(repo, {"refs/heads/devices/old": (b, c), "refs/heads/devices/new": (None, a)})
    written = (repo / "packed-refs").read_bytes()
    git(repo, "pack-refs", "--all", "--prune")
    assert (repo / "packed-refs").read_bytes() == written
    assert b"\n^" + a.encode() in written
    assert refs(repo)["refs/heads/devices/old"] == c
    assert git(repo, "rev-parse", "v1^{commit}").strip() == a


def test_a_file_without_a_header_keeps_claiming_nothing_but_order(repo: Path) -> None:
    (a,) = commits(repo, 1)
    (repo / "packed-refs").write_text(f"{a} refs/heads/z\n")
    move_refs(repo, {"refs/heads/a": (None, a)})
    assert (repo / "packed-refs").read_text() == (
        f"# pack-refs with: sorted \n{a} refs/heads/a\n{a} refs/heads/z\n")
    assert refs(repo) == {"refs/heads/a": a, "refs/heads/z": a}


@pytest.mark.parametrize("case", ["moved", "exists", "missing"])
def test_a_ref_not_where_expected_moves_nothing(repo: Path, case: str) -> None:
    a, b, c = commits(repo, 3)
    move_refs(repo, {"refs/heads/devices/x": (None, a)})
    before = (repo / "packed-refs").read_bytes()
    wrong = {"moved": ("refs/heads/devices/x", b, c), "exists": ("refs/heads/devices/x", None, c),
             "missing": ("refs/heads/devices/z", a, c)}[case]
    with pytest.raises(RefMovedError, match=wrong[0]):
        move_refs(repo, {"refs/heads/devices/new": (None, b), wrong[0]: wrong[1:]})
    assert (repo / "packed-refs").read_bytes() == before
    assert not (repo / "packed-refs.lock").exists()


def test_loose_refs_to_move_are_reported_and_others_ignored(repo: Path) -> None:
    a, b = commits(repo, 2)
    git(repo, "update-ref", "refs/heads/devices/loose", a)
    git(repo, "update-ref", "refs/heads/devices/other", a)
    with pytest.raises(LooseRefsError) as failure:
        move_refs(repo, {"refs/heads/devices/loose": (a, b), "refs/heads/devices/new": (None, b)})
    assert failure.value.names == ["refs/heads/devices/loose"]
    assert not (repo / "packed-refs").exists()
    move_refs(repo, {"refs/heads/devices/new": (None, b)})  # a loose neighbour is no matter
    assert refs(repo) == {"refs/heads/devices/loose": a, "refs/heads/devices/new": b,
                          "refs/heads/devices/other": a}


def test_a_held_lock_is_waited_for_then_refused(repo: Path) -> None:
    (a,) = commits(repo, 1)
    (repo / "packed-refs.lock").write_text("")
    with pytest.raises(PackedRefsError, match=r"packed-refs\.lock exists"):
        move_refs(repo, {"refs/heads/x": (None, a)}, timeout=0.05)
    assert (repo / "packed-refs.lock").exists()  # not ours to remove
    assert refs(repo) == {}


def test_a_damaged_file_is_refused_with_its_line(repo: Path) -> None:
    (a,) = commits(repo, 1)
    damaged = f"# pack-refs with: peeled fully-peeled sorted \n{a} refs/heads/ok\nnot a ref\n"
    (repo / "packed-refs").write_text(damaged)
    with pytest.raises(PackedRefsError, match=r"packed-refs:3: not a packed ref line"):
        move_refs(repo, {"refs/heads/x": (None, a)})
    assert (repo / "packed-refs").read_text() == damaged
    assert not (repo / "packed-refs.lock").exists()


@pytest.mark.parametrize(("name", "old", "new"), [
    ("heads/x", None, "a" * 40), ("refs/heads/a b", None, "a" * 40),
    ("refs/heads/x", None, "A" * 40), ("refs/heads/x", "abc", "a" * 40),
    ("refs/heads/x", None, "a" * 20 + "\n" + "a" * 19), ("refs/heads/x", None, "é" * 40),
    ("refs/heads/x", None, "a" * 39 + " "), ("refs/heads/x", "a" * 40, "g" * 40),
])
def test_bad_updates_are_refused_before_anything_is_read(repo: Path, name: str,
                                                         old: str | None, new: str) -> None:
    with pytest.raises(PackedRefsError):
        move_refs(repo, {name: (old, new)})
    assert not (repo / "packed-refs").exists()


_NAMES = st.sampled_from([f"refs/heads/devices/d{i}" for i in range(6)]
                         + ["refs/heads/main", "refs/tags/t"])


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=st.lists(st.dictionaries(_NAMES, st.integers(0, 3), min_size=1), max_size=4))
def test_the_refs_are_what_git_update_ref_gives(tmp_path_factory: pytest.TempPathFactory,
                                                rounds: list[dict[str, int]]) -> None:
    """Several rounds of moves leave the same refs as Git's own transactions would."""
    root = tmp_path_factory.mktemp("twins")
    ours, theirs = root / "ours.git", root / "theirs.git"
    for path in (ours, theirs):
        subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    ids = commits(ours, 4)
    assert commits(theirs, 4) == ids  # same trees, messages and (no) dates: same ids
    current: dict[str, str] = {}
    for moves in rounds:
        updates = {name: (current.get(name), ids[i]) for name, i in moves.items()}
        move_refs(ours, updates)
        script = "".join(f"update {name} {new} {old or '0' * 40}\n"
                         for name, (old, new) in updates.items())
        git(theirs, "update-ref", "--stdin", input=script.encode())
        current.update({name: ids[i] for name, i in moves.items()})
        assert refs(ours) == refs(theirs) == current


def test_a_ref_is_deleted_in_the_same_rewrite_only_where_it_was_expected(repo: Path) -> None:
    """new None deletes (a device branch deleted on purpose, `wfm.fleet.replication`): with the
    other moves, all or nothing, and only if the ref is still where the caller read it."""
    a, b, c = commits(repo, 3)
    move_refs(repo, {"refs/heads/devices/x": (None, a), "refs/heads/devices/y": (None, b)})
    with pytest.raises(RefMovedError):
        move_refs(repo, {"refs/heads/devices/x": (b, None), "refs/heads/devices/y": (b, c)})
    assert refs(repo) == {"refs/heads/devices/x": a, "refs/heads/devices/y": b}
    move_refs(repo, {"refs/heads/devices/x": (a, None), "refs/heads/devices/y": (b, c)})
    assert refs(repo) == {"refs/heads/devices/y": c}
    assert git(repo, "pack-refs", "--all") == "" and refs(repo) == {"refs/heads/devices/y": c}


def test_ref_targets_are_what_git_lists(repo: Path) -> None:
    """Packed refs (one with a peel line), a loose ref over its packed entry, a loose ref
    of its own, and a symbolic ref left out, as `git for-each-ref` has them."""
    a, b, c = commits(repo, 3)
    git(repo, "tag", "-a", "-m", "t", "v1", a)
    move_refs(repo, {"refs/heads/x": (None, a), "refs/heads/y": (None, a)})
    git(repo, "pack-refs", "--all")
    assert "^" in (repo / "packed-refs").read_text()
    git(repo, "update-ref", "refs/heads/y", b)  # loose now, over its packed line
    git(repo, "update-ref", "refs/heads/z", c)
    git(repo, "symbolic-ref", "refs/heads/alias", "refs/heads/x")
    expected = refs(repo)
    del expected["refs/heads/alias"]
    assert ref_targets(repo) == expected
    assert ref_targets(repo)["refs/heads/y"] == b


def test_ref_targets_refuse_a_damaged_file_with_its_line(repo: Path) -> None:
    (a,) = commits(repo, 1)
    (repo / "packed-refs").write_text(f"{a} refs/heads/ok\nnot a ref\n")
    with pytest.raises(PackedRefsError, match=r"packed-refs:2: not a packed ref line"):
        ref_targets(repo)


# --- replacing the whole file (`replace_refs`) -----------------------------------------


def test_the_whole_file_replaced_reads_back_as_move_refs_would_write_it(repo: Path,
                                                                       tmp_path: Path) -> None:
    """The same refs given whole (`replace_refs`) or moved one by one (`move_refs`) give
    byte-identical files, which Git reads back, and the file replaced must be the one the
    caller listed."""
    from compiler.packedrefs import packed_refs_identity, replace_refs

    a, b, c = commits(repo, 3)
    other = tmp_path / "other.git"
    subprocess.run(["git", "init", "-q", "--bare", str(other)], check=True)
    wanted = {"refs/heads/devices/x": a, "refs/heads/devices/é": b, "refs/heads/devices/Z": c}
    move_refs(other, {name: (None, oid) for name, oid in wanted.items()})
    written = replace_refs(repo, None, wanted)
    assert written == packed_refs_identity(repo)
    assert (repo / "packed-refs").read_bytes() == (other / "packed-refs").read_bytes()
    assert refs(repo) == wanted and ref_targets(repo) == wanted

    with pytest.raises(RefMovedError, match="rewritten by someone else"):
        replace_refs(repo, None, {"refs/heads/devices/x": b})  # (it listed no file)
    git(repo, "update-ref", "refs/heads/devices/x", b)  # a loose file, shadowing its entry
    with pytest.raises(LooseRefsError):
        replace_refs(repo, packed_refs_identity(repo), {"refs/heads/devices/x": c})
    with pytest.raises(PackedRefsError, match="not a full object id"):
        replace_refs(repo, packed_refs_identity(repo), {"refs/heads/devices/x": "abc"})
    assert ref_targets(repo)["refs/heads/devices/x"] == b and not (
        repo / "packed-refs.lock").exists()


def test_a_file_copied_from_another_repository_is_that_file_and_only_that_one(
        repo: Path, tmp_path: Path) -> None:
    """`copy_refs` makes another repository's ``packed-refs`` this one's, byte for byte,
    which Git reads back; it refuses, changing nothing, when either file is not the one the
    caller listed or a ref of either is a loose file."""
    from compiler.packedrefs import copy_refs, packed_refs_identity

    a, b, c = commits(repo, 3)
    source = tmp_path / "source.git"
    subprocess.run(["git", "init", "-q", "--bare", str(source)], check=True)
    git(source, "fetch", "-q", str(repo), *(f"{oid}:refs/tmp/{i}" for i, oid in
                                            enumerate((a, b, c))))
    for i in range(3):  # (the objects stay)
        git(source, "update-ref", "-d", f"refs/tmp/{i}")
    wanted = {f"refs/heads/devices/{i:03}": (a, b, c)[i % 3] for i in range(300)}
    move_refs(source, {name: (None, oid) for name, oid in wanted.items()})
    move_refs(repo, {"refs/heads/devices/old": (None, a)})
    listed = packed_refs_identity(source)
    assert listed is not None

    with pytest.raises(RefMovedError, match="rewritten by someone else"):
        copy_refs(source, listed, repo, None)  # (the target listed no file: it has one)
    target = packed_refs_identity(repo)
    with pytest.raises(RefMovedError, match="rewritten meanwhile"):
        copy_refs(source, (*listed[:2], listed[2] + 1, *listed[3:]), repo, target)
    assert refs(repo) == {"refs/heads/devices/old": a}

    written = copy_refs(source, listed, repo, target)
    assert written == packed_refs_identity(repo) and written != listed
    assert (repo / "packed-refs").read_bytes() == (source / "packed-refs").read_bytes()
    assert refs(repo) == wanted and ref_targets(repo) == wanted
    assert not (repo / "packed-refs.lock").exists()

    git(source, "update-ref", "refs/heads/devices/loose", b)  # shadows nothing, yet loose
    with pytest.raises(LooseRefsError):
        copy_refs(source, listed, repo, written)
    assert refs(repo) == wanted and not (repo / "packed-refs.lock").exists()


def test_a_published_list_is_installed_only_in_the_form_this_module_writes(
        repo: Path) -> None:
    """`canonical_refs` accepts exactly what `rendered_refs` writes (header, sorted names
    once each, full ids, a final line break) and names the first bad line otherwise;
    `install_refs` writes such a file as it is, which Git reads back, if the file it
    replaces is the one the caller listed."""
    from compiler.packedrefs import (
        canonical_refs,
        install_refs,
        packed_refs_identity,
        rendered_refs,
    )

    a, b = commits(repo, 2)
    wanted = {"refs/heads/devices/x": a, "refs/heads/devices/é": b, "refs/heads/devices/Z": a}
    data = rendered_refs(wanted)
    assert canonical_refs(data) == wanted
    header, _, body = data.partition(b"\n")
    lines = body.splitlines(keepends=True)
    bad = {
        "unsorted": header + b"\n" + b"".join(reversed(lines)),
        "twice": header + b"\n" + body + lines[-1],
        "header": body,
        "short id": data.replace(a.encode(), a[:39].encode()),
        "peeled": data + f"^{a}\n".encode(),
        "no line break": data[:-1],
        "no space": data.replace(f"{a} ".encode(), f"{a}\t".encode(), 1),
        "not UTF-8": data.replace("é".encode(), b"\xff"),
    }
    for why, wrong in bad.items():
        with pytest.raises(PackedRefsError):
            canonical_refs(wrong)
            pytest.fail(why)
    assert canonical_refs(rendered_refs({})) == {}

    with pytest.raises(RefMovedError):
        install_refs(repo, packed_refs_identity(repo) or (0, 0, 0, 0, 0), data)
    written = install_refs(repo, None, data)
    assert written == packed_refs_identity(repo)
    assert (repo / "packed-refs").read_bytes() == data and refs(repo) == wanted
    git(repo, "update-ref", "refs/heads/devices/loose", b)
    with pytest.raises(LooseRefsError):
        install_refs(repo, written, rendered_refs({}))
    assert (repo / "packed-refs").read_bytes() == data
