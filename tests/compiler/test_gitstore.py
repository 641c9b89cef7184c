"""The shared fleet-state repository: ref encoding, fast-import writes, reads, lock, clients."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pygit2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compiler.gitformat import device_ids_from_refs
from compiler.gitstore import (
    DEVICE_ID_PATTERN,
    LOCK_FILE_NAME,
    CommitInfo,
    DeviceCommit,
    DeviceStore,
    GitStoreError,
    InvalidCommitError,
    blob_id,
    device_id_from_ref,
    device_ref,
    tree_id_of,
)

TS = 1_760_000_000
MESSAGE = ("Deploy grafana 1.2.0 to gw1\n\nSome body text — ünïcödé.\n\n"
           "Fleet-Source: 0123456789abcdef\nInputs-Digest: sha256:abc\n")

# Atoms that exercise every encoding rule: dots in all positions, '~', '.lock' endings.
_ATOMS = st.sampled_from(["a", "Z", "9", "_", "-", "~", ".", "..", "lock", ".lock", "x.y"])
_SEGMENTS = st.lists(_ATOMS, min_size=1, max_size=6).map("".join)
DEVICE_IDS = st.one_of(
    st.lists(_SEGMENTS, min_size=1, max_size=4).map("/".join),
    st.from_regex(rf"\A{DEVICE_ID_PATTERN}\Z", fullmatch=True),
)


def files(n: int = 3, tag: str = "") -> dict[str, bytes]:
    return {f"app-{i}.yaml": f"kind: ApplicationDeployment\nname: app-{i}{tag}\n".encode()
            for i in range(n)}


def git(*args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return result.stdout


@pytest.fixture
def store(tmp_path: Path) -> DeviceStore:
    return DeviceStore(tmp_path / "repos")


# --- ref encoding --------------------------------------------------------------------------


@given(DEVICE_IDS)
def test_device_ref_round_trips_and_is_a_valid_ref_name(device_id: str) -> None:
    ref = device_ref(device_id)
    assert pygit2.reference_is_valid_name(ref)
    assert ref.count("/") == 3  # one component: gw and gw/child can coexist
    assert device_id_from_ref(ref) == device_id


@given(DEVICE_IDS, DEVICE_IDS)
def test_distinct_device_ids_never_share_a_ref(a: str, b: str) -> None:
    assert (device_ref(a) == device_ref(b)) == (a == b)


@pytest.mark.parametrize(
    ("device_id", "encoded"),
    [("gw1", "gw1"), ("gw1/child", "gw1%2Fchild"), ("a.b", "a.b"), (".a", "%2Ea"),
     ("a.", "a%2E"), ("a..b", "a.%2Eb"), ("...", "%2E%2E%2E"), ("x~1", "x%7E1"),
     ("dev.lock", "dev%2Elock"), ("dev.lock/x", "dev.lock%2Fx"), ("a/.lock", "a%2F%2Elock")],
)
def test_encoding_examples_are_accepted_by_git(device_id: str, encoded: str) -> None:
    ref = device_ref(device_id)
    assert ref == "refs/heads/devices/" + encoded
    git("check-ref-format", ref)


@pytest.mark.parametrize("device_id", ["", "a//b", "/a", "a/", "a b", "ü", "a%b", "a:b"])
def test_device_ref_rejects_ids_outside_the_margo_grammar(device_id: str) -> None:
    with pytest.raises(ValueError, match="not a Margo device id"):
        device_ref(device_id)


@pytest.mark.parametrize(
    "ref",
    ["refs/heads/main", "refs/tags/devices/x", "refs/heads/devices/", "refs/heads/devices/a/b",
     "refs/heads/devices/a%2fb", "refs/heads/devices/%41", "refs/heads/devices/a%2E%2E",
     "refs/heads/devices/%FF", "refs/heads/devices/a%2"],
)
def test_refs_that_are_not_canonical_device_branches_decode_to_none(ref: str) -> None:
    assert device_id_from_ref(ref) is None


@given(st.lists(st.one_of(DEVICE_IDS.map(device_ref), st.sampled_from([
    "refs/heads/main", "refs/heads/devices/", "refs/heads/devices/a%2fb",
    "refs/heads/devices/%41", "refs/heads/devices/a.b", "refs/heads/devices/a\nb",
    "refs/tags/devices/x", "refs/heads/devices/a/b"])), max_size=8))
def test_the_devices_of_many_refs_are_those_of_each(refs: list[str]) -> None:
    """`device_ids_from_refs` (a few scans in C when every branch is a plain id) tells
    what `device_id_from_ref` tells of each ref."""
    expected = {d for d in map(device_id_from_ref, refs) if d is not None}
    assert device_ids_from_refs(refs) == expected
    plain = [device_ref(f"dev-{i}") for i in range(3)]
    assert device_ids_from_refs(plain) == {"dev-0", "dev-1", "dev-2"}


def test_blob_id_is_gits_blob_id() -> None:
    data = b"\x00\xffbinary\n"
    hashed = subprocess.run(["git", "hash-object", "--stdin"], input=data, check=True,
                            capture_output=True).stdout.decode().strip()
    assert blob_id(data) == hashed


# --- creating and configuring ---------------------------------------------------------------


def test_create_makes_a_configured_bare_repository(tmp_path: Path) -> None:
    store = DeviceStore(tmp_path / "repos")
    assert store.path == tmp_path / "repos" / "fleet-state.git"
    repo = pygit2.Repository(str(store.path))
    assert repo.is_bare
    assert repo.config["uploadpack.allowFilter"] == "true"
    assert repo.config["uploadpack.allowAnySHA1InWant"] == "false"
    assert repo.config["receive.denyNonFastForwards"] == "true"
    assert repo.config["core.logAllRefUpdates"] == "false"
    assert repo.config["gc.auto"] == "0"
    assert store.device_ids() == []
    assert DeviceStore(tmp_path / "repos", create=False).path == store.path


def test_open_without_create_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(GitStoreError, match="no fleet-state repository"):
        DeviceStore(tmp_path, create=False)
    (tmp_path / "fleet-state.git").mkdir()
    with pytest.raises(GitStoreError, match="not a Git repository"):
        DeviceStore(tmp_path)


# --- writing and reading ---------------------------------------------------------------------


def test_write_three_devices_and_read_them_back(store: DeviceStore) -> None:
    content = {d: files(3, tag=d) for d in ("dev-a", "dev-b", "dev-c")}
    tips = store.write(DeviceCommit(d, f, f"compile {d}\n", TS) for d, f in content.items())
    assert set(tips) == set(content)
    assert store.device_ids() == ["dev-a", "dev-b", "dev-c"]
    for device_id, expected in content.items():
        assert store.tip(device_id) == tips[device_id]
        assert store.read_files(device_id) == expected
        assert store.tree_ids(device_id) == {n: blob_id(d) for n, d in expected.items()}
        assert store.history(device_id) == [
            CommitInfo(tips[device_id], TS, f"compile {device_id}\n", None)]
        commit = pygit2.Repository(str(store.path))[tips[device_id]]
        assert (commit.author.name, commit.author.email) == DeviceStore.AUTHOR
        assert (commit.committer.name, commit.committer.email) == DeviceStore.AUTHOR
        assert (commit.author.time, commit.author.offset) == (TS, 0)
        assert commit.commit_time == TS


def test_unknown_device_reads_as_absent(store: DeviceStore) -> None:
    assert store.tip("nobody") is None
    assert store.tree_ids("nobody") is None
    assert store.read_files("nobody") is None
    assert store.history("nobody") == []
    assert store.write([]) == {}


def test_second_write_appends_a_linear_commit(store: DeviceStore) -> None:
    first = store.write([DeviceCommit("dev", files(2), "one\n", TS)])["dev"]
    changed = {**files(2), "app-1.yaml": b"changed\n"}
    second = store.write([DeviceCommit("dev", changed, "two\n", TS + 60)])["dev"]
    assert second != first
    assert store.read_files("dev") == changed
    assert store.read_files("dev", first) == files(2)
    assert [(c.id, c.parent, c.message) for c in store.history("dev")] == [
        (second, first, "two\n"), (first, None, "one\n")]
    assert store.history("dev", limit=1) == store.history("dev")[:1]
    assert git(f"--git-dir={store.path}", "rev-list", "--count", device_ref("dev")) == "2\n"


def test_smaller_files_really_remove_a_file(store: DeviceStore) -> None:
    store.write([DeviceCommit("dev", files(3), "three\n", TS)])
    store.write([DeviceCommit("dev", files(1), "one\n", TS)])
    assert store.read_files("dev") == files(1)
    store.write([DeviceCommit("dev", {}, "nothing deployed\n", TS)])
    assert store.read_files("dev") == {}
    assert store.tree_ids("dev") == {}


def test_unchanged_tree_is_still_written_when_asked(store: DeviceStore) -> None:
    first = store.write([DeviceCommit("dev", files(2), "one\n", TS)])["dev"]
    second = store.write([DeviceCommit("dev", files(2), "again\n", TS + 1)])["dev"]
    assert second != first
    assert store.history("dev")[0].parent == first


def test_several_commits_for_one_device_in_one_write_are_chained(store: DeviceStore) -> None:
    tips = store.write([DeviceCommit("dev", files(1), "one\n", TS),
                        DeviceCommit("other", files(1), "other\n", TS),
                        DeviceCommit("dev", files(2), "two\n", TS + 1)])
    assert [c.message for c in store.history("dev")] == ["two\n", "one\n"]
    assert tips["dev"] == store.tip("dev")
    assert store.read_files("dev") == files(2)


def test_gateway_and_child_branches_coexist(store: DeviceStore) -> None:
    ids = ["gw1", "gw1/child", "gw1/child/leaf", ".hidden", "x..y.lock", "t~1."]
    store.write(DeviceCommit(d, {"id.txt": d.encode()}, f"{d}\n", TS) for d in ids)
    assert store.device_ids() == sorted(ids)
    for device_id in ids:
        assert store.read_files(device_id) == {"id.txt": device_id.encode()}


def test_tree_id_is_independent_of_dict_order_and_matches_pygit2(store: DeviceStore,
                                                                  tmp_path: Path) -> None:
    content = {"b.yaml": b"b\n", "a.yaml": b"a\n", "a-b.yaml": b"ab\n", "a": b"x", "Z": b"z",
               '"quoted"': b"q", "sp ace.yaml": b"s"}
    reversed_order = dict(reversed(list(content.items())))
    store.write([DeviceCommit("one", content, "m\n", TS),
                 DeviceCommit("two", reversed_order, "m\n", TS)])
    repo = pygit2.Repository(str(store.path))
    tree_one = repo[store.tip("one")].tree.id
    assert repo[store.tip("two")].tree.id == tree_one
    assert store.tip("one") == store.tip("two")  # same tree, message, time, no parent

    scratch = pygit2.init_repository(str(tmp_path / "scratch.git"), bare=True)
    builder = scratch.TreeBuilder()
    for name, data in content.items():
        builder.insert(name, scratch.create_blob(data), pygit2.GIT_FILEMODE_BLOB)
    assert builder.write() == tree_one
    assert store.read_files("one") == content


def test_binary_content_and_utf8_messages_round_trip_exactly(store: DeviceStore) -> None:
    content = {"blob.bin": bytes(range(256)) * 3, "empty": b"", "crlf.txt": b"a\r\nb\r\n",
               "latin1.txt": "é".encode("latin-1"), "no-newline": b"data 5\nM x"}
    message = MESSAGE + "Trailer-With-Colon: a: b\n\n\n"
    tip = store.write([DeviceCommit("dev", content, message, TS)])["dev"]
    assert store.read_files("dev") == content
    repo = pygit2.Repository(str(store.path))
    assert repo[tip].raw_message == message.encode("utf-8")
    assert store.history("dev")[0].message == message
    assert git(f"--git-dir={store.path}", "log", "-1", "--format=%B", tip) == message + "\n"


def test_read_files_refuses_a_commit_of_another_device(store: DeviceStore) -> None:
    tips = store.write([DeviceCommit("a", files(1), "a\n", TS),
                        DeviceCommit("b", files(2), "b\n", TS)])
    with pytest.raises(GitStoreError, match="not on the branch of device 'a'"):
        store.read_files("a", tips["b"])
    with pytest.raises(GitStoreError, match="not on the branch of device 'a'"):
        store.read_files("a", "0" * 40)
    with pytest.raises(GitStoreError, match="not a full commit id"):
        store.read_files("a", tips["a"][:12])


def test_foreign_refs_are_not_devices(store: DeviceStore) -> None:
    tip = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]
    repo = pygit2.Repository(str(store.path))
    repo.references.create("refs/heads/main", tip)
    repo.references.create("refs/heads/devices/%41", tip)
    assert store.device_ids() == ["dev"]


# --- validation and failures -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reason"),
    [("", "non-empty"), ("a/b", "contains"), ("a\nb", "contains"), ("a\0b", "contains"),
     (".", "cannot be a file name"), ("..", "cannot be a file name"),
     (".GIT", "cannot be a file name"), ("\udcff", "UTF-8")],
)
def test_invalid_file_names_are_rejected_before_anything_is_written(
        store: DeviceStore, name: str, reason: str) -> None:
    batch = [DeviceCommit("first", files(1), "m\n", TS),
             DeviceCommit("second", {**files(1), name: b"x"}, "m\n", TS)]
    with pytest.raises(InvalidCommitError, match=reason):
        store.write(batch)
    assert store.device_ids() == []
    assert git(f"--git-dir={store.path}", "count-objects", "-v").startswith("count: 0\n")
    assert "in-pack: 0\n" in git(f"--git-dir={store.path}", "count-objects", "-v")


@pytest.mark.parametrize(
    ("commit", "reason"),
    [(DeviceCommit("bad id", {}, "m", TS), "not a Margo device id"),
     (DeviceCommit("d", {"a": "text"}, "m", TS), "must be bytes"),  # type: ignore[dict-item]
     (DeviceCommit("d", {}, "m", -1), "negative"),
     (DeviceCommit("d", {}, "m", 1.5), "must be an int"),  # type: ignore[arg-type]
     (DeviceCommit("d", {}, "\udc80", TS), "UTF-8"),
     (DeviceCommit("d", {}, "m", TS, parent="abc", parent_known=True), "full commit id")],
)
def test_malformed_commits_are_rejected(store: DeviceStore, commit: DeviceCommit,
                                        reason: str) -> None:
    with pytest.raises(InvalidCommitError, match=reason):
        store.write([commit])
    assert isinstance(InvalidCommitError("x"), ValueError)


def block_packs(store: DeviceStore) -> Path:
    """Make the repository's pack directory unusable for new packs (a file in its place:
    a real failure of the file system, which root cannot get from permissions)."""
    packs = store.path / "objects" / "pack"
    shutil.rmtree(packs)  # in this repository every pack is written again below
    packs.write_bytes(b"")
    return packs


def test_a_pack_that_cannot_be_written_leaves_tips_unchanged(store: DeviceStore) -> None:
    store.write([DeviceCommit("dev", files(1), "m\n", TS)])
    before = {"dev": store.tip("dev")}
    saved = store.path.parent / "saved-packs"
    shutil.copytree(store.path / "objects" / "pack", saved)
    block_packs(store)
    with pytest.raises(GitStoreError, match=r"cannot write objects .*no device branch"):
        store.write([DeviceCommit("dev", files(2), "m\n", TS),
                     DeviceCommit("new", files(2), "m\n", TS)])
    (store.path / "objects" / "pack").unlink()
    shutil.copytree(saved, store.path / "objects" / "pack")
    assert {"dev": store.tip("dev")} == before
    assert store.tip("new") is None
    assert store.read_files("dev") == files(1)


def test_missing_git_program_is_reported(store: DeviceStore, tmp_path: Path) -> None:
    """Deleting branches runs Git's own transaction (``update-ref``)."""
    store.write([DeviceCommit("dev", files(1), "m\n", TS)])
    store.git_executable = str(tmp_path / "no-such-git")
    with pytest.raises(GitStoreError, match="cannot run"):
        store.delete_branches(["dev"])
    assert store.tip("dev") is not None


def test_a_parent_the_repository_lacks_leaves_tips_unchanged(
        store: DeviceStore, monkeypatch: pytest.MonkeyPatch) -> None:
    before = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]
    monkeypatch.setattr(store, "tip", lambda device_id: "1" * 40)  # a parent that does not exist
    with pytest.raises(GitStoreError, match="no such object") as failure:
        store.write([DeviceCommit("dev", files(2), "m\n", TS)])
    assert "1" * 40 in str(failure.value)
    monkeypatch.undo()
    assert store.tip("dev") == before
    assert not list((store.path / "objects" / "pack").glob("tmp_*"))  # nothing left behind


def test_a_branch_moved_behind_our_back_aborts_the_whole_write(
        store: DeviceStore, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    current = store.write([DeviceCommit("dev", files(2), "two\n", TS)])["dev"]
    real_tip = DeviceStore.tip
    monkeypatch.setattr(store, "tip",
                        lambda d: stale if d == "dev" else real_tip(store, d))
    with pytest.raises(GitStoreError, match=r"no device branch was changed: .* expected"):
        store.write([DeviceCommit("new", files(1), "m\n", TS),
                     DeviceCommit("dev", files(3), "three\n", TS)])
    monkeypatch.undo()
    assert store.tip("dev") == current
    assert store.tip("new") is None  # all or nothing


def test_a_commit_builds_on_the_tip_its_caller_read(store: DeviceStore) -> None:
    first = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    read = store.tree("dev")
    assert read is not None and read.commit == first
    second = store.write([DeviceCommit("dev", files(2), "two\n", TS, parent=read.commit,
                                       parent_known=True),
                          DeviceCommit("new", files(1), "m\n", TS, parent=None,
                                       parent_known=True)])
    assert store.history("dev")[0].parent == first and second["dev"] == store.tip("dev")
    assert store.history("new")[0].parent is None


@pytest.mark.parametrize("claimed", ["stale", None])
def test_a_tip_read_before_the_branch_moved_aborts_the_whole_write(
        store: DeviceStore, claimed: str | None) -> None:
    """The caller computed its tree from a tip (or from no branch) that is no longer there:
    nothing moves, the newer commit stays."""
    stale = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    current = store.write([DeviceCommit("dev", files(2), "two\n", TS)])["dev"]
    with pytest.raises(GitStoreError, match=r"no device branch was changed: .* expected"):
        store.write([DeviceCommit("new", files(1), "m\n", TS),
                     DeviceCommit("dev", files(3), "three\n", TS,
                                  parent=stale if claimed else None, parent_known=True)])
    assert store.tip("dev") == current
    assert store.tip("new") is None


# --- the compile lock ------------------------------------------------------------------------


def test_lock_is_exclusive_and_released(store: DeviceStore, tmp_path: Path) -> None:
    other = DeviceStore(tmp_path / "repos")
    with store.lock():
        with pytest.raises(GitStoreError, match=rf"locked by process {os.getpid()}"), \
                other.lock():
            pass
        started = time.monotonic()
        with pytest.raises(GitStoreError, match="another compiler"), other.lock(timeout=0.2):
            pass
        assert time.monotonic() - started >= 0.2
        store.write([DeviceCommit("dev", files(1), "m\n", TS)])
    with other.lock():
        assert (other.path / LOCK_FILE_NAME).exists()


def test_lock_is_held_against_another_process(store: DeviceStore) -> None:
    with subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(store.path / LOCK_FILE_NAME)],
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "locked\n"
            with pytest.raises(GitStoreError, match="another compiler"), store.lock():
                pass
        finally:
            holder.kill()
    with store.lock():
        pass


_HOLD_LOCK = """
import fcntl, sys, time
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(60)
"""


# --- ordinary clients and scale ----------------------------------------------------------


def test_a_device_branch_clones_with_the_git_cli(store: DeviceStore, tmp_path: Path) -> None:
    content = {"grafana.yaml": b"kind: ApplicationDeployment\n", "bin": b"\x00\x01"}
    store.write([DeviceCommit("gw1/child.x", content, MESSAGE, TS),
                 DeviceCommit("gw1", files(2), "gw\n", TS)])
    branch = device_ref("gw1/child.x").removeprefix("refs/heads/")
    clone = tmp_path / "clone"
    git("clone", "--quiet", "--single-branch", "--branch", branch, f"file://{store.path}",
        str(clone))
    assert {p.name: p.read_bytes() for p in clone.iterdir() if p.name != ".git"} == content
    assert git("branch", "--remotes", cwd=clone).split() == [f"origin/{branch}"]
    assert git("log", "--format=%B", cwd=clone) == MESSAGE + "\n"


def test_two_thousand_devices_in_one_write(store: DeviceStore) -> None:
    batch = [DeviceCommit(f"site-{i // 100}/dev-{i:04d}", files(6, tag=str(i)), f"d{i}\n", TS)
             for i in range(2000)]
    started = time.perf_counter()
    tips = store.write(batch)
    written = time.perf_counter() - started
    started = time.perf_counter()
    trees = {d: store.tree_ids(d) for d in store.device_ids()}
    read = time.perf_counter() - started
    print(f"\n2,000 devices x 6 files: write {written:.2f} s, tree_ids for all {read:.3f} s")
    assert len(tips) == len(trees) == 2000
    assert trees["site-7/dev-0777"] == {n: blob_id(d) for n, d in files(6, tag="777").items()}


# --- streaming writes, kept blobs, tree ids ----------------------------------------------------


def _our_git_processes() -> list[str]:
    """Command lines of the git processes this test process has running (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and cmdline and cmdline[0].endswith(b"git"):
            found.append(b" ".join(cmdline).decode(errors="replace"))
    return found


def test_a_generator_is_written_while_it_produces(store: DeviceStore) -> None:
    """The pack is being written (unfinished, under its temporary name) when the second
    commit is being produced, and each device's old tip is read when its first commit
    arrives (so a branch created meanwhile counts)."""
    seen: list[str] = []

    def commits():
        yield DeviceCommit("first", files(1), "one\n", TS)
        seen.extend(p.name for p in (store.path / "objects" / "pack").iterdir())
        yield DeviceCommit("second", files(2), "two\n", TS)
        yield DeviceCommit("first", files(3), "three\n", TS + 1)

    tips = store.write(commits())
    assert [name.startswith("tmp_pack_margo_") for name in seen] == [True]
    assert store.read_files("first") == files(3)
    assert [c.message for c in store.history("first")] == ["three\n", "one\n"]
    assert tips == {"first": store.tip("first"), "second": store.tip("second")}
    assert _our_git_processes() == []


def test_an_invalid_commit_late_in_a_stream_moves_no_branch(store: DeviceStore) -> None:
    before = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]

    def commits():
        yield DeviceCommit("dev", files(2), "m\n", TS)
        yield DeviceCommit("new", files(1), "m\n", TS)
        yield DeviceCommit("bad", {"a/b": b"x"}, "m\n", TS)

    with pytest.raises(InvalidCommitError, match="contains"):
        store.write(commits())
    assert store.tip("dev") == before
    assert store.device_ids() == ["dev"]
    assert _our_git_processes() == []


def test_an_exception_from_the_producer_aborts_the_write(store: DeviceStore) -> None:
    def commits():
        yield DeviceCommit("dev", files(1), "m\n", TS)
        raise RuntimeError("rendering failed")

    with pytest.raises(RuntimeError, match="rendering failed"):
        store.write(commits())
    assert store.device_ids() == []
    assert _our_git_processes() == []


def test_an_invalid_first_commit_never_starts_git(store: DeviceStore) -> None:
    store.git_executable = "/nonexistent/git"  # starting it would be a GitStoreError
    with pytest.raises(InvalidCommitError, match="negative"):
        store.write(iter([DeviceCommit("dev", {}, "m\n", -1)]))
    assert store.write(iter([])) == {}


def test_kept_files_are_referenced_by_blob_id(store: DeviceStore) -> None:
    store.write([DeviceCommit("dev", files(3), "one\n", TS)])
    stored = store.tree("dev")
    assert stored is not None and stored.ids == store.tree_ids("dev")
    assert stored.tree == store.tree_id("dev")
    assert stored.read("app-1.yaml") == files(3)["app-1.yaml"]
    kept = {n: i for n, i in stored.ids.items() if n != "app-2.yaml"}
    store.write([DeviceCommit("dev", {"new.yaml": b"new\n"}, "two\n", TS, kept=kept)])
    assert store.read_files("dev") == {**{n: files(3)[n] for n in kept}, "new.yaml": b"new\n"}
    with pytest.raises(KeyError):
        stored.read("missing.yaml")


@pytest.mark.parametrize(
    ("kept", "reason"),
    [({"a": "abc"}, "full blob id"), ({"a": "A" * 40}, "full blob id"), ({"a": 7}, "blob id"),
     ({"a/b": "0" * 40}, "contains"), ({"app-0.yaml": "0" * 40}, "both written and kept")],
)
def test_malformed_kept_files_are_rejected(store: DeviceStore, kept: dict[str, object],
                                           reason: str) -> None:
    with pytest.raises(InvalidCommitError, match=reason):
        store.write([DeviceCommit("dev", files(1), "m\n", TS, kept=kept)])  # type: ignore[arg-type]
    assert store.device_ids() == []


def test_keeping_a_blob_the_repository_lacks_moves_no_branch(store: DeviceStore) -> None:
    before = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]
    tree_id = str(pygit2.Repository(str(store.path))[before].tree_id)
    for oid, held in (("1" * 40, "no such object"), (tree_id, "a tree")):  # not a blob
        with pytest.raises(GitStoreError, match=f"kept file 'x.yaml' names {oid}.*{held}"):
            store.write([DeviceCommit("dev", {}, "m\n", TS, kept={"x.yaml": oid})])
        assert store.tip("dev") == before


def test_tree_id_of_is_the_id_git_gives_the_tree(store: DeviceStore) -> None:
    # Names whose order differs between bytes and naive orderings, quoting and non-ASCII.
    content = {"a": b"1", "a-b": b"2", "a.b": b"3", "a0": b"4", "Z": b"5", "é.yaml": b"6",
               '"q"': b"7", "sp ace": b"8", "a_b": b"9", "ab": b""}
    store.write([DeviceCommit("dev", content, "m\n", TS), DeviceCommit("empty", {}, "m\n", TS)])
    assert tree_id_of({n: blob_id(d) for n, d in content.items()}) == store.tree_id("dev")
    assert tree_id_of({}) == store.tree_id("empty") == "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


_INHERITED: list[Any] = []  # what a forked child inherits (as compile workers do)


def _read_in_child(name: str) -> bytes:
    return _INHERITED[0].read(name)


def test_stored_trees_can_be_read_in_forked_workers(store: DeviceStore) -> None:
    store.write([DeviceCommit("dev", files(2), "m\n", TS)])
    stored = store.tree("dev")
    assert stored is not None
    _INHERITED[:] = [stored]
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_read_in_child, ("app-1.yaml",)) == files(2)["app-1.yaml"]
    finally:
        _INHERITED.clear()
    assert stored.read("app-0.yaml") == files(2)["app-0.yaml"]  # the parent's handle still works


def _tree_in_child(device_id: str) -> tuple[str | None, dict[str, str]]:
    store = _INHERITED[0]
    assert isinstance(store, DeviceStore)
    found = store.tree(device_id)
    assert found is not None and store._pid == os.getpid()  # its own handle, not the parent's
    return found.commit, found.ids


def test_branches_are_read_in_forked_workers_with_their_own_handle(store: DeviceStore) -> None:
    tip = store.write([DeviceCommit("dev", files(2), "m\n", TS)])["dev"]
    _INHERITED[:] = [store]
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_tree_in_child, ("dev",)) == (tip, store.tree_ids("dev"))
    finally:
        _INHERITED.clear()


def test_written_objects_move_no_branch_until_the_branches_are_moved(
        store: DeviceStore) -> None:
    """Between the two steps the new tips are known and no branch points to them yet."""
    pending = store.write_objects([DeviceCommit("dev", files(1), "m\n", TS)])
    assert store.device_ids() == [] and set(pending.new_tips) == {"dev"}
    assert pending.old_tips == {"dev": None}
    store.move_branches(pending)
    assert store.tip("dev") == pending.new_tips["dev"]
    nothing = store.write_objects([])
    assert nothing.new_tips == {}
    store.move_branches(nothing)  # nothing to move


def test_what_runs_while_git_finishes_sees_every_commit_made(store: DeviceStore) -> None:
    """`meanwhile` runs once, after the last commit was taken from the stream and before
    the write returns, given every new tip; what it raises is raised, with Git waited for
    and no branch moved."""
    taken: list[str] = []
    seen: list[tuple[list[str], dict[str, str]]] = []

    def commits() -> Iterator[DeviceCommit]:
        for device_id in ("a", "b"):
            taken.append(device_id)
            yield DeviceCommit(device_id, files(1), "m\n", TS)

    pending = store.write_objects(
        commits(), meanwhile=lambda tips: seen.append((list(taken), dict(tips))))
    assert seen == [(["a", "b"], pending.new_tips)] and set(pending.new_tips) == {"a", "b"}

    def fail(tips: object) -> None:
        raise RuntimeError("staging failed")

    with pytest.raises(RuntimeError, match="staging failed"):
        store.write_objects([DeviceCommit("c", files(2), "m\n", TS)], meanwhile=fail)
    assert store.device_ids() == [] and _our_git_processes() == []


def test_moving_branches_that_moved_meanwhile_moves_none_of_them(
        store: DeviceStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The objects are written against the tips read then; a branch that moved since makes
    the move fail, and every branch stays where it was."""
    stale = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    current = store.write([DeviceCommit("dev", files(2), "two\n", TS)])["dev"]
    real_tip = DeviceStore.tip
    monkeypatch.setattr(store, "tip", lambda d: stale if d == "dev" else real_tip(store, d))
    pending = store.write_objects([DeviceCommit("dev", files(3), "m\n", TS),
                                   DeviceCommit("other", files(1), "m\n", TS)])
    monkeypatch.undo()
    with pytest.raises(GitStoreError, match=r"is at .*, expected"):
        store.move_branches(pending)
    assert store.tip("dev") == current and store.tip("other") is None
    assert _our_git_processes() == []


def test_a_ref_named_like_an_object_id_does_not_change_what_a_write_builds_on(
        store: DeviceStore) -> None:
    """Object ids are passed in full; a branch spelled like one is not what they mean."""
    first = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    other = store.write([DeviceCommit("other", files(2), "x\n", TS)])["other"]
    repo = pygit2.Repository(str(store.path))
    repo.references.create(f"refs/heads/{first}", other)
    second = store.write([DeviceCommit("dev", files(3), "two\n", TS)])["dev"]
    assert store.history("dev")[0].parent == first
    assert second == store.tip("dev")


def test_stored_trees_read_the_raw_format_as_pygit2_does(store: DeviceStore) -> None:
    """Plain files by name and blob id, and anything else (subtree, executable, link) only
    marks the tree foreign — what iterating pygit2's Tree gives."""
    store.write([DeviceCommit("dev", {"a.yaml": b"1", "é ü.yaml": b"2", "sp ace": b""},
                              "m\n", TS)])
    repo = pygit2.Repository(str(store.path))
    blob, tip = repo.create_blob(b"x"), repo[store.tip("dev")]
    for mode, foreign in [(pygit2.GIT_FILEMODE_BLOB, False),
                          (pygit2.GIT_FILEMODE_BLOB_EXECUTABLE, True),
                          (pygit2.GIT_FILEMODE_LINK, True)]:
        builder = repo.TreeBuilder(tip.tree)
        builder.insert("extra", blob, mode)
        if foreign:
            builder.insert("sub", tip.tree.id, pygit2.GIT_FILEMODE_TREE)
        commit = repo.create_commit(device_ref("dev"), tip.author, tip.committer, "m\n",
                                    builder.write(), [tip.id])
        stored = store.tree("dev")
        assert stored is not None and stored.commit == str(commit)
        tree = repo[commit].tree
        assert stored.ids == {e.name: str(e.id) for e in tree
                              if e.filemode == pygit2.GIT_FILEMODE_BLOB}
        assert stored.foreign is foreign and stored.tree == str(tree.id)
        tip = repo[commit]


@pytest.mark.parametrize("raw", [b"100644 a", b"100644 a\0" + b"\1" * 5, b"100644a\0" + b"\1" * 20])
def test_a_malformed_tree_object_is_an_error(raw: bytes) -> None:
    from compiler.gitformat import plain_files

    with pytest.raises(GitStoreError, match="malformed tree"):
        plain_files(raw, 20)
    assert plain_files(b"100644 a\0" + b"\1" * 20, 20) == ({"a": "01" * 20}, False)


def test_a_commit_on_the_parents_tree_writes_only_the_difference(store: DeviceStore) -> None:
    tip = store.write([DeviceCommit("dev", files(3), "one\n", TS)])["dev"]
    before = store.tree_ids("dev")
    assert before is not None
    changed = {"app-1.yaml": b"changed\n", "new.yaml": b"new\n"}
    second = store.write([DeviceCommit("dev", changed, "two\n", TS, parent=tip,
                                       parent_known=True, on_parent=True,
                                       removed=["app-2.yaml"])])["dev"]
    expected = {"app-0.yaml": files(3)["app-0.yaml"], **changed}
    assert store.read_files("dev") == expected
    stored = store.tree("dev")
    assert stored is not None and stored.ids["app-0.yaml"] == before["app-0.yaml"]
    assert stored.tree == tree_id_of({n: blob_id(c) for n, c in expected.items()})
    assert store.history("dev")[0].parent == tip and stored.commit == second


@pytest.mark.parametrize(("commit", "reason"), [
    (DeviceCommit("d", {}, "m", TS, on_parent=True), "needs a known parent"),
    (DeviceCommit("d", {}, "m", TS, parent=None, parent_known=True, on_parent=True),
     "needs a known parent"),
    (DeviceCommit("d", {}, "m", TS, removed=["a"]), "need on_parent"),
    (DeviceCommit("d", {"a": b""}, "m", TS, parent="1" * 40, parent_known=True,
                  on_parent=True, removed=["a"]), "both removed and written"),
    (DeviceCommit("d", {}, "m", TS, parent="1" * 40, parent_known=True, on_parent=True,
                  removed="abc"), "collection of file names"),
    (DeviceCommit("d", {}, "m", TS, parent="1" * 40, parent_known=True, on_parent=True,
                  removed=["a/b"]), "contains"),
])
def test_malformed_changes_on_a_parent_are_rejected(store: DeviceStore, commit: DeviceCommit,
                                                     reason: str) -> None:
    with pytest.raises(InvalidCommitError, match=reason):
        store.write([commit])


def test_a_change_on_the_parent_must_be_the_devices_first_commit_of_a_write(
        store: DeviceStore) -> None:
    tip = store.write([DeviceCommit("dev", files(1), "one\n", TS)])["dev"]
    with pytest.raises(InvalidCommitError, match="first commit of a write"):
        store.write([DeviceCommit("dev", files(2), "two\n", TS),
                     DeviceCommit("dev", {}, "three\n", TS, parent=tip, parent_known=True,
                                  on_parent=True, removed=["app-0.yaml"])])
    assert store.tip("dev") == tip


def test_branch_target_reads_the_ref_alone(store: DeviceStore) -> None:
    """What a branch points at, without reading an object: the tip for a branch, None
    without one, and None for a symbolic ref (whose target is a name, not an object)."""
    assert store.branch_target("dev") is None
    tip = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]
    assert store.branch_target("dev") == tip == store.tip("dev")
    store._repo.references.create(device_ref("sym"), device_ref("dev"))
    assert store.tip("sym") == tip and store.branch_target("sym") is None


def test_branches_written_as_loose_files_are_packed_then_moved(store: DeviceStore) -> None:
    """A repository whose branches Git wrote one file each (an older compiler, an operator's
    `git update-ref`): the next write packs them, keeping every value, and moves its own."""
    tips = store.write([DeviceCommit("a", files(1), "a\n", TS),
                        DeviceCommit("b", files(2), "b\n", TS)])
    git(f"--git-dir={store.path}", "update-ref", device_ref("a"), tips["b"])  # now loose
    git(f"--git-dir={store.path}", "update-ref", "refs/heads/main", tips["a"])
    new = store.write([DeviceCommit("a", files(3), "a2\n", TS)])["a"]
    assert store.history("a")[0].parent == tips["b"]
    assert not (store.path / device_ref("a")).exists()
    refs = git(f"--git-dir={store.path}", "for-each-ref", "--format=%(refname) %(objectname)")
    assert refs.splitlines() == [f"refs/heads/devices/a {new}", f"refs/heads/devices/b {tips['b']}",
                                 f"refs/heads/main {tips['a']}"]


def test_a_symbolic_device_branch_is_refused_with_nothing_moved(store: DeviceStore) -> None:
    """Git cannot pack a symbolic ref, and moving it would move the branch it names."""
    tip = store.write([DeviceCommit("dev", files(1), "m\n", TS)])["dev"]
    store._repo.references.create(device_ref("sym"), device_ref("dev"))
    with pytest.raises(GitStoreError, match=r"loose files, not packed: refs/heads/devices/sym"):
        store.write([DeviceCommit("new", files(1), "n\n", TS),
                     DeviceCommit("sym", files(2), "s\n", TS)])
    assert store.tip("dev") == tip and store.tip("new") is None


def test_a_change_on_a_tree_with_subtrees_keeps_them_in_gits_order(
        store: DeviceStore) -> None:
    """A subtree sorts as if its name ended in ``/`` (``sub`` after ``sub.yaml``, before
    ``sub0``), as Git's own tree builder orders it; entries no compile writes stay."""
    store.write([DeviceCommit("dev", {"sub.yaml": b"1", "sub0": b"2", "a": b"3"}, "m\n", TS)])
    repo = pygit2.Repository(str(store.path))
    tip = repo[store.tip("dev")]
    builder = repo.TreeBuilder(tip.tree)
    builder.insert("sub", tip.tree.id, pygit2.GIT_FILEMODE_TREE)
    builder.insert("run", repo.create_blob(b"#!"), pygit2.GIT_FILEMODE_BLOB_EXECUTABLE)
    moved = repo.create_commit(device_ref("dev"), tip.author, tip.committer, "m\n",
                               builder.write(), [tip.id])
    store.write([DeviceCommit("dev", {"sub.yaml": b"changed", "b": b"4"}, "two\n", TS,
                              parent=str(moved), parent_known=True, on_parent=True,
                              removed=["a"])])
    expected = repo.TreeBuilder(repo[moved].tree)
    expected.insert("sub.yaml", repo.create_blob(b"changed"), pygit2.GIT_FILEMODE_BLOB)
    expected.insert("b", repo.create_blob(b"4"), pygit2.GIT_FILEMODE_BLOB)
    expected.remove("a")
    assert store.tree_id("dev") == str(expected.write())
