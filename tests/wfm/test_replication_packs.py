"""`wfm.fleet.replication.RepoReplica`: a publication carries the pack's index as
`git pack-objects` wrote it, and a replica stores both files as they are (no index-pack),
but indexes a pack whose index does not belong to it, or one published without an index.
The compiling replica's served copy takes the objects it is about to publish from its work
repository by hard links, so its sync of that generation reads and indexes nothing. Real
Git repositories (`git fast-import` writes the work repository's objects, as a compile
does)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pygit2
import pytest

from compiler.packedrefs import move_refs
from wfm.fleet import replication
from wfm.fleet.replication import RepoReplica
from wfm.store.replica_rows import PublishedPack, Snapshot

NOT_A_PACK = b"PACK but not really"


def fast_import(repository: Path, content: str, *, pack: bool = False) -> str:
    """One commit on refs/heads/main holding a file with `content`; its id. Three objects:
    loose, unless `pack` (Git's fast-import writes fewer than `fastimport.unpackLimit`
    objects loose)."""
    stream = (f"blob\nmark :1\ndata {len(content)}\n{content}\n"
              "commit refs/heads/main\nmark :2\ncommitter a <a@b> 0 +0000\ndata 3\nnew\n"
              "M 100644 :1 file\n\n").encode()
    limit = ["-c", "fastimport.unpackLimit=0"] if pack else []
    subprocess.run(["git", *limit, "--git-dir", str(repository), "fast-import", "--quiet",
                    "--force"],
                   input=stream, check=True)
    return str(pygit2.Repository(str(repository)).references["refs/heads/main"].target)


def test_linked_objects_are_there_and_their_generation_skips_index_pack(
        tmp_path: Path) -> None:
    work = RepoReplica("devices", tmp_path / "work.git")
    serving = RepoReplica("devices", tmp_path / "serving.git")
    commit = fast_import(work.path, "hello", pack=True)
    assert commit not in pygit2.Repository(str(serving.path))
    assert serving.link_objects_from(work)
    assert commit in pygit2.Repository(str(serving.path))
    def files(repository: RepoReplica) -> list[str]:
        objects = repository.path / "objects"
        return sorted(str(p.relative_to(objects)) for p in objects.rglob("*") if p.is_file()
                      and p.parent.name != "info")
    assert files(serving) == files(work) != []
    assert serving.link_objects_from(work)  # again: nothing new, nothing fails

    serving.has_objects_of(7)
    serving.add_objects(Snapshot(7, [PublishedPack(7, NOT_A_PACK)], {}))  # linked already
    assert serving.linked_generations() == {7}
    with pytest.raises(RuntimeError, match="index-pack"):
        serving.add_objects(Snapshot(8, [PublishedPack(7, NOT_A_PACK),
                                         PublishedPack(8, NOT_A_PACK)], {}))


def test_loose_objects_are_linked_too(tmp_path: Path) -> None:
    """A small import leaves loose objects (fast-import's unpackLimit): linked as well."""
    work = RepoReplica("devices", tmp_path / "work.git")
    serving = RepoReplica("devices", tmp_path / "serving.git")
    commit = fast_import(work.path, "small")
    blob = str(pygit2.Repository(str(work.path)).create_blob(b"loose"))
    assert serving.link_objects_from(work)
    repository = pygit2.Repository(str(serving.path))
    assert commit in repository and blob in repository


def published(work: RepoReplica, old: tuple[str, ...] = ()) -> tuple[bytes, bytes | None]:
    pack, index = work.pack(work.refs(), old)  # (both mapped)
    return bytes(pack), None if index is None else bytes(index)


def test_a_pack_published_with_its_index_is_stored_as_it_is(tmp_path: Path) -> None:
    work = RepoReplica("devices", tmp_path / "work.git")
    first = fast_import(work.path, "one")
    second = fast_import(work.path, "two")  # (a root commit: the branch is forced)
    pack, index = published(work)
    assert index is not None and pack.startswith(b"PACK")
    other = RepoReplica("devices", tmp_path / "other.git")
    other.add_objects(Snapshot(1, [PublishedPack(1, pack, index)], {}))
    stored = sorted(p.name for p in (other.path / "objects" / "pack").iterdir())
    assert stored == [f"pack-{pack[-20:].hex()}.{s}" for s in ("idx", "pack")]  # as they were
    repository = pygit2.Repository(str(other.path))
    assert second in repository and first not in repository  # what the refs reach
    subprocess.run(["git", "--git-dir", str(other.path), "fsck", "--strict", "--no-dangling"],
                   check=True, capture_output=True)


@pytest.mark.parametrize("with_index", [True, False])
def test_a_pack_read_into_a_file_moves_into_the_store(tmp_path: Path, with_index: bool) -> None:
    """A pack read from the database into a file (`spooling`) is renamed into the object
    store with its index, not written again; without an index, Git indexes the file."""
    work = RepoReplica("devices", tmp_path / "work.git")
    commit = fast_import(work.path, "one")
    pack, index = published(work)
    other = RepoReplica("devices", tmp_path / "other.git")
    with other.spooling() as spool:
        assert spool.parent == other.path
        spooled = spool / f"pack-{pack[-20:].hex()}.pack"
        spooled.write_bytes(pack)
        if with_index:
            spooled.with_suffix(".idx").write_bytes(index or b"")
        other.add_objects(Snapshot(1, [PublishedPack(1, pack, index if with_index else None,
                                                     spooled)], {}))
        assert spooled.exists() is not with_index  # moved, or left for the folder's removal
    assert not spool.exists()
    assert commit in pygit2.Repository(str(other.path))
    subprocess.run(["git", "--git-dir", str(other.path), "fsck", "--strict", "--no-dangling"],
                   check=True, capture_output=True)


@pytest.mark.parametrize("damage", ["another pack's index", "not an index", "none"])
def test_a_pack_whose_index_does_not_belong_is_indexed_again(tmp_path: Path,
                                                             damage: str) -> None:
    work = RepoReplica("devices", tmp_path / "work.git")
    commit = fast_import(work.path, "one")
    pack, _ = published(work)
    fast_import(work.path, "two")
    _, wrong = published(work)
    index = {"another pack's index": wrong, "not an index": b"\377tOc" + bytes(60),
             "none": None}[damage]
    other = RepoReplica("devices", tmp_path / "other.git")
    other.add_objects(Snapshot(1, [PublishedPack(1, pack, index)], {}))
    assert commit in pygit2.Repository(str(other.path))
    subprocess.run(["git", "--git-dir", str(other.path), "fsck", "--strict", "--no-dangling"],
                   check=True, capture_output=True)


def test_objects_added_later_are_linked_later(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Folders listed before are listed again only when their time moved; one too recent
    to tell is listed every time (a file added in the same clock tick leaves it)."""
    work = RepoReplica("devices", tmp_path / "work.git")
    serving = RepoReplica("devices", tmp_path / "serving.git")
    repository = pygit2.Repository(str(work.path))
    first = str(repository.create_blob(b"first"))
    assert serving.link_objects_from(work)
    folder = work.path / "objects" / first[:2]
    same_folder = next(b for b in (f"blob {n}".encode() for n in range(100_000))
                       if str(pygit2.hash(b))[:2] == first[:2])
    second = str(repository.create_blob(same_folder))  # at once: within the same tick
    assert serving.link_objects_from(work)
    assert second in pygit2.Repository(str(serving.path))
    monkeypatch.setattr(replication, "_SETTLED_NS", 0)  # every time is settled now
    assert serving.link_objects_from(work)
    listed = []
    monkeypatch.setattr(Path, "iterdir", lambda self, real=Path.iterdir: (
        listed.append(self.name), real(self))[1])
    assert serving.link_objects_from(work)
    assert folder.name not in listed  # unchanged since: not listed again
    third = str(repository.create_blob(b"third"))
    assert serving.link_objects_from(work)
    assert third in pygit2.Repository(str(serving.path))


def test_the_refs_listing_follows_every_change_of_the_refs(tmp_path: Path) -> None:
    """`refs()` is remembered under the identity of `packed-refs`: a rewrite of the file
    (here by Git, and by `move_refs`) or a loose ref shows at the next listing."""
    repo = RepoReplica("devices", tmp_path / "repo.git")
    first = fast_import(repo.path, "one")
    git = ["git", "--git-dir", str(repo.path)]
    subprocess.run([*git, "pack-refs", "--all"], check=True)
    assert repo.refs() == {"refs/heads/main": first}
    assert repo.refs() == {"refs/heads/main": first}  # (remembered: the same listing)
    subprocess.run([*git, "update-ref", "refs/heads/loose", first], check=True)
    assert repo.refs() == {"refs/heads/main": first, "refs/heads/loose": first}
    subprocess.run([*git, "pack-refs", "--all"], check=True)
    second = fast_import(repo.path, "two")  # (a loose ref again, over the packed one)
    assert repo.refs() == {"refs/heads/main": second, "refs/heads/loose": first}
    subprocess.run([*git, "pack-refs", "--all"], check=True)
    listed = repo.refs()
    listed["refs/heads/main"] = "0" * 40  # (a copy: the caller's to change)
    move_refs(repo.path, {"refs/heads/loose": (first, None)})
    assert repo.refs() == {"refs/heads/main": second}


def test_moving_to_a_generation_rewrites_the_refs_it_listed_or_moves_each(
        tmp_path: Path) -> None:
    """`move_to` writes the whole `packed-refs` from the refs it listed (deleted refs
    left out) and remembers them; a loose ref (which would shadow its entry) or a file
    rewritten since the listing makes it move each ref in the file as it is instead."""
    repo = RepoReplica("devices", tmp_path / "repo.git")
    first = fast_import(repo.path, "one")
    second = fast_import(repo.path, "two")
    git = ["git", "--git-dir", str(repo.path)]
    subprocess.run([*git, "update-ref", "refs/heads/devices/a", first], check=True)
    subprocess.run([*git, "pack-refs", "--all", "--prune"], check=True)
    assert repo.refs()["refs/heads/devices/a"] == first  # (listed: remembered)
    repo.move_to(Snapshot(1, [], {"refs/heads/devices/a": second,
                                  "refs/heads/devices/b": first, "refs/heads/gone": None}))
    moved = {"refs/heads/main": second, "refs/heads/devices/a": second,
             "refs/heads/devices/b": first}
    assert repo.refs() == moved and repo.generation == 1
    for name, target in moved.items():
        assert str(pygit2.Repository(str(repo.path)).references[name].target) == target
    assert not [p for p in (repo.path / "refs").rglob("*") if p.is_file()]  # (none loose)

    subprocess.run([*git, "update-ref", "refs/heads/devices/a", first], check=True)  # loose
    repo.move_to(Snapshot(2, [], {"refs/heads/devices/b": None}))
    assert repo.refs() == {"refs/heads/main": second, "refs/heads/devices/a": first}
    move_refs(repo.path, {"refs/heads/devices/c": (None, first)})  # (another writer)
    repo.move_to(Snapshot(3, [], {"refs/heads/devices/a": second}))
    assert repo.refs() == {"refs/heads/main": second, "refs/heads/devices/a": second,
                           "refs/heads/devices/c": first}


def test_the_refs_after_a_move_of_this_process_are_known_without_reading_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile moves the work repository's branches (`move_refs`) after its refs were
    listed: the next listing is that one with the moves applied, the file not read again
    (a million refs: 2-3 s beside the compile's end); a rewrite by anyone else, or a move
    from a file this listing did not come from, is read."""
    repo = RepoReplica("devices", tmp_path / "repo.git")
    first = fast_import(repo.path, "one")
    second = fast_import(repo.path, "two")
    git = ["git", "--git-dir", str(repo.path)]
    subprocess.run([*git, "pack-refs", "--all", "--prune"], check=True)
    assert repo.refs() == {"refs/heads/main": second}
    reads: list[Path] = []
    listing = replication.ref_targets
    monkeypatch.setattr(replication, "ref_targets",
                        lambda path: reads.append(Path(path)) or listing(path))
    move_refs(repo.path, {"refs/heads/devices/a": (None, first),
                          "refs/heads/main": (second, first)})
    assert repo.refs() == {"refs/heads/main": first, "refs/heads/devices/a": first}
    move_refs(repo.path, {"refs/heads/devices/a": (first, None)})
    assert repo.refs() == {"refs/heads/main": first} and reads == []

    subprocess.run([*git, "update-ref", "refs/heads/devices/b", second], check=True)
    subprocess.run([*git, "pack-refs", "--all", "--prune"], check=True)  # (Git's rewrite)
    assert repo.refs() == {"refs/heads/main": first, "refs/heads/devices/b": second}
    assert reads == [repo.path]
    other = RepoReplica("devices", tmp_path / "other.git")
    move_refs(other.path, {"refs/heads/devices/c": (None, first)})  # (not listed before)
    assert other.refs() == {"refs/heads/devices/c": first} and reads[-1] == other.path
    empty = RepoReplica("devices", tmp_path / "empty.git")  # (a first compile's repository)
    assert empty.refs() == {} and reads[-1] == empty.path
    move_refs(empty.path, {"refs/heads/devices/d": (None, second)})
    assert empty.refs() == {"refs/heads/devices/d": second} and len(reads) == 3


def test_the_served_copy_takes_the_work_repository_refs_file_when_it_was_where_they_were(
        tmp_path: Path) -> None:
    """`move_like`: the compiling replica's served copy, at the refs its work repository had
    before a compile, takes the work repository's `packed-refs` as it is (the same bytes),
    and remembers them; when its refs were others (a ref the work repository never had),
    it moves to the snapshot as `move_to` does, keeping what only it had."""
    work = RepoReplica("devices", tmp_path / "work.git")
    serving = RepoReplica("devices", tmp_path / "serving.git")
    first = fast_import(work.path, "one", pack=True)
    second = fast_import(work.path, "two", pack=True)
    subprocess.run(["git", "--git-dir", str(work.path), "update-ref", "-d", "refs/heads/main"],
                   check=True)
    assert serving.link_objects_from(work)
    move_refs(work.path, {"refs/heads/devices/a": (None, first)})
    move_refs(serving.path, {"refs/heads/devices/a": (None, first)})
    before = work.refs()
    move_refs(work.path, {"refs/heads/devices/a": (first, second),
                          "refs/heads/devices/b": (None, first)})
    after = work.refs()
    moved: dict[str, str | None] = {"refs/heads/devices/a": second,
                                    "refs/heads/devices/b": first}

    assert serving.move_like(work, before, after, Snapshot(1, [], moved))
    assert (serving.path / "packed-refs").read_bytes() == (work.path / "packed-refs").read_bytes()
    assert serving.refs() == after and serving.generation == 1
    assert not serving.move_like(work, before, after, Snapshot(1, [], moved))  # (there)

    move_refs(serving.path, {"refs/heads/devices/only-here": (None, second)})
    later = {**after, "refs/heads/devices/b": second}
    move_refs(work.path, {"refs/heads/devices/b": (first, second)})
    assert serving.move_like(work, after, later,
                             Snapshot(2, [], {"refs/heads/devices/b": second}))
    assert serving.refs() == {**later, "refs/heads/devices/only-here": second}
    for name, target in serving.refs().items():
        assert str(pygit2.Repository(str(serving.path)).references[name].target) == target


def test_the_refs_file_published_is_the_repositorys_own_when_it_holds_those_refs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`refs_file`: the repository's `packed-refs` as it is when its listing is the refs
    asked for (a million refs are not written out again for a published list); written
    from the refs when they are others, or when the file is Git's own (peeled lines)."""
    repo = RepoReplica("devices", tmp_path / "repo.git")
    first = fast_import(repo.path, "one")
    subprocess.run(["git", "--git-dir", str(repo.path), "update-ref", "-d", "refs/heads/main"],
                   check=True)
    move_refs(repo.path, {"refs/heads/devices/a": (None, first)})
    own = (repo.path / "packed-refs").read_bytes()
    rendering = replication.rendered_refs
    rendered: list[int] = []
    monkeypatch.setattr(replication, "rendered_refs",
                        lambda refs: rendered.append(len(refs)) or rendering(refs))
    assert repo.refs_file({"refs/heads/devices/a": first}) == own and rendered == [0]
    other = {"refs/heads/devices/b": first}
    assert repo.refs_file(other) == rendering(other) and rendered[-1] == 1
    subprocess.run(["git", "--git-dir", str(repo.path), "tag", "-a", "-m", "t", "t", first],
                   check=True)
    subprocess.run(["git", "--git-dir", str(repo.path), "pack-refs", "--all", "--prune"],
                   check=True)
    listed = repo.refs()
    assert b"^" in (repo.path / "packed-refs").read_bytes()
    assert repo.refs_file(listed) == rendering(listed)
