"""Replicas publish a compile's own pack as it is, stored in parts.

`wfm.fleet.coordination.Coordinator.publish` hands the database the one pack a compile
wrote (`wfm.fleet.replication.RepoReplica.compiled_pack`) instead of packing the new
objects again with `git pack-objects`, and falls back to packing whenever the compile's
pack might not hold everything the new tips reach that the old ones do not (a restored
lost branch) or holds what must not travel (a device deleted while it compiled:
`test_deletion_publication`). `wfm.store.replica_rows` stores every pack and index in
parts and joins them again, on SQLite and on PostgreSQL, and still reads packs stored
whole by earlier servers. Real Git repositories, the compiler's own writer
(`compiler.gitstore.DeviceStore.write`), a real PostgreSQL database, and a second,
empty repository that applies what was published, as another replica does."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pygit2
import pytest
from kits.replicakit import lease_holder

from compiler.gitformat import DeviceCommit
from compiler.gitstore import REPOSITORY_NAME, DeviceStore, device_ref
from compiler.report import CompileReport
from tools.polling import poll_until
from wfm.fleet.replication import RepoReplica
from wfm.store import pack_rows, replica_rows
from wfm.store.database import Database
from wfm.store.pgdb import PostgresDatabase

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator


@pytest.fixture
def holder(pg_url: str, tmp_path: Path) -> Iterator[tuple[PostgresDatabase, Coordinator]]:
    with lease_holder(pg_url, tmp_path / "data") as held:
        yield held


def compile_into(work: Path, commits: list[DeviceCommit]) -> Path:
    """What a compile does to the work repository: one pack, then every branch moves.
    The pack it wrote."""
    folder = work / REPOSITORY_NAME / "objects" / "pack"
    before = set(folder.glob("pack-*.pack")) if folder.exists() else set()
    DeviceStore(work).write(commits)
    (written,) = set(folder.glob("pack-*.pack")) - before
    return written


def files(device: str, text: str, **options: object) -> DeviceCommit:
    return DeviceCommit(device, {"deployment.yaml": f"{device}: {text}\n".encode(),
                                 "shared.yaml": b"the same for every device\n"},
                        f"{device}: {text}", 1_700_000_000, **options)  # type: ignore[arg-type]


def newest_pack(db: Database, spool: Path) -> replica_rows.PublishedPack:
    snapshot = db.read(lambda c: replica_rows.read_snapshot(
        c, "devices", replica_rows.published_generation(c, "devices") - 1,
        dialect=db.dialect, spool=spool))
    return snapshot.packs[-1]


def applied_elsewhere(db: Database, tmp_path: Path) -> RepoReplica:
    """A new replica's repository, brought to the published state from the database alone;
    every object its refs reach is there (`git fsck --connectivity-only`)."""
    other = RepoReplica("devices", tmp_path / "other.git")
    with other.spooling() as spool:
        assert other.apply(db.read(lambda c: replica_rows.read_snapshot(
            c, "devices", -1, dialect=db.dialect, spool=spool)))
    subprocess.run(["git", f"--git-dir={other.path}", "fsck", "--connectivity-only",
                    "--no-dangling"], check=True, capture_output=True)
    return other


def test_a_compiles_own_pack_is_what_is_published(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path) -> None:
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    first = compile_into(work, [files(d, "v1") for d in ("a", "b", "c")])
    assert coordinator.publish() is not None
    published = newest_pack(db, tmp_path)
    assert published.pack == first.read_bytes()
    assert published.index == first.with_suffix(".idx").read_bytes()

    # The next compile changes one device, on its tip, and keeps the shared file.
    work = coordinator.prepare()
    assert work is not None
    tip = DeviceStore(work).tip("b")
    second = compile_into(work, [files("b", "v2", parent=tip, parent_known=True)])
    assert coordinator.publish() is not None
    assert newest_pack(db, tmp_path).pack == second.read_bytes()
    other = applied_elsewhere(db, tmp_path)
    assert other.refs() == RepoReplica("devices", work / REPOSITORY_NAME).refs()
    assert other.refs()[device_ref("b")] == DeviceStore(work).tip("b") != tip


def test_the_publisher_serves_its_work_repositorys_refs_file_as_it_is(
        holder: tuple[PostgresDatabase, Coordinator], monkeypatch: pytest.MonkeyPatch) -> None:
    """After each publication the compiling replica's served copy holds the work
    repository's `packed-refs`, copied (`RepoReplica.move_like`), never rendered from its
    refs again (a million refs: 2.7-3 s beside the other replica's sync)."""
    from wfm.fleet import replication

    _db, coordinator = holder
    copied: list[Path] = []
    copying = replication.copy_refs
    monkeypatch.setattr(replication, "copy_refs",
                        lambda *a, **k: copied.append(Path(a[2])) or copying(*a, **k))
    monkeypatch.setattr(replication, "replace_refs", lambda *a, **k: pytest.fail("rendered"))
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b", "c")])
    assert coordinator.publish() is not None
    work = coordinator.prepare()
    assert work is not None
    tip = DeviceStore(work).tip("b")
    compile_into(work, [files("b", "v2", parent=tip, parent_known=True),
                        files("d", "v1")])
    assert coordinator.publish() is not None
    assert copied == [coordinator.serving.path] * 2
    served = coordinator.serving.path / "packed-refs"
    assert served.read_bytes() == (work / REPOSITORY_NAME / "packed-refs").read_bytes()
    assert coordinator.serving.refs() == RepoReplica("devices", work / REPOSITORY_NAME).refs()
    assert coordinator.serving.refs()[device_ref("d")] == DeviceStore(work).tip("d")


def test_a_restored_lost_branch_is_packed_from_its_refs(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path) -> None:
    """The restored branch's first commit continues the commit it was last left at, which
    no old tip reaches and the compile's pack does not hold."""
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b")])
    assert coordinator.publish() is not None
    store = DeviceStore(work)
    lost = store.tip("b")
    assert lost is not None
    subprocess.run(["git", f"--git-dir={work / REPOSITORY_NAME}", "update-ref", "-d",
                    device_ref("b")], check=True)

    work = coordinator.prepare()
    assert work is not None
    own = compile_into(work, [files("b", "restored", parent=lost, parent_known=True,
                                    branch_lost=True)])
    assert coordinator.publish() is not None
    published = newest_pack(db, tmp_path)
    assert published.pack != own.read_bytes()
    unpacked = tmp_path / "unpacked.git"
    pygit2.init_repository(str(unpacked), bare=True)
    subprocess.run(["git", f"--git-dir={unpacked}", "index-pack", "--stdin"],
                   input=published.pack, check=True, capture_output=True)
    assert lost in pygit2.Repository(str(unpacked))
    assert applied_elsewhere(db, tmp_path).refs()[device_ref("b")] == store.tip("b")


def test_objects_from_elsewhere_are_packed_from_the_refs(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path) -> None:
    """Loose objects beside the compile's pack: not a compile's single write."""
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    own = compile_into(work, [files("a", "v1")])
    subprocess.run(["git", f"--git-dir={work / REPOSITORY_NAME}", "hash-object", "-w",
                    "--stdin"], input=b"loose", check=True, capture_output=True)
    assert coordinator.publish() is not None
    assert newest_pack(db, tmp_path).pack != own.read_bytes()


def test_packs_are_stored_in_parts_and_read_whole(store: Database, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack of several parts, read back a few parts at a time into a file (six parts in
    reads of three: the last read finds none; the index's two in one), one stored whole as
    servers before parts did, and a compaction that deletes the older generations' parts
    too."""
    monkeypatch.setattr(pack_rows, "PART_BYTES", 1000)
    monkeypatch.setattr(pack_rows, "PARTS_PER_READ", 3)
    index = b"index" * 300

    def pack_of(generation: int) -> bytes:  # (a pack ends with its own checksum)
        body = b"PACK" + bytes(range(256)) * 20 + bytes([generation])
        return body + hashlib.sha1(body).digest()

    assert len(pack_of(1)) > 5 * pack_rows.PART_BYTES

    def publish(generation: int, *, compact: bool = False) -> None:
        def write(conn: object) -> None:
            replica_rows.publish_rows(conn, "devices", generation, pack_of(generation),  # type: ignore[arg-type]
                                      {f"refs/heads/{generation}": "0" * 40},
                                      compact=compact, index=index)
            replica_rows.set_counter(conn, "devices", generation)  # type: ignore[arg-type]
        store.write_sync(write)

    publish(1)
    store.write_sync(lambda conn: conn.execute(
        "INSERT INTO git_packs (repo, generation, pack, idx) VALUES (?, ?, ?, ?)",
        ("devices", 2, b"PACK stored whole", None)))
    publish(3)

    def packs() -> list[tuple[int, bytes, bytes | None]]:
        spool = Path(tempfile.mkdtemp(dir=tmp_path))
        snapshot = store.read(lambda c: replica_rows.read_snapshot(
            c, "devices", -1, dialect=store.dialect, spool=spool))
        for p in snapshot.packs:  # in parts: spooled, the index beside the pack
            assert p.path is None if p.generation == 2 else (
                p.path.parent == spool and p.path.read_bytes() == p.pack
                and p.path.with_suffix(".idx").read_bytes() == p.index)
        return [(p.generation, bytes(p.pack), None if p.index is None else bytes(p.index))
                for p in snapshot.packs]

    assert packs() == [(1, pack_of(1), index), (2, b"PACK stored whole", None),
                       (3, pack_of(3), index)]
    publish(4, compact=True)
    assert packs() == [(4, pack_of(4), index)]
    assert stored_parts(store) == {pack_rows.pack_id(pack_of(4))}


def stored_parts(db: Database) -> set[str]:
    return {str(p) for p, in db.read(lambda c: c.execute(
        "SELECT DISTINCT pack FROM git_pack_parts").fetchall())}


def test_a_pack_stored_as_the_branches_move_is_the_one_published(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path) -> None:
    """`Coordinator.stage` (the compile's `on_moved`) stores the pack and publishes it
    as the branches move, before the compile's end (its state's commit): the served copy
    has it by then, and `publish` then only marks the state as the generation's."""
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    own = compile_into(work, [files(d, "v1") for d in ("a", "b")])
    assert coordinator.serving.generation < 1
    coordinator.stage(CompileReport(revision="r"))
    name = pack_rows.pack_id(own.read_bytes())
    poll_until("the pack published", lambda: db.read(lambda c: c.execute(
        "SELECT parts FROM git_packs").fetchall()) == [(name,)], timeout=10)
    poll_until("the served copy moved", lambda: coordinator.serving.generation == 1,
               timeout=10)
    assert not (work / "compiler-state.generation").exists()
    published = coordinator.publish(restored=0)
    assert published is not None and published.generation == 1
    assert (work / "compiler-state.generation").read_text().split()[0] == "1"
    assert stored_parts(db) == {name}
    assert newest_pack(db, tmp_path).pack == own.read_bytes()


def test_a_compile_that_fails_after_its_branches_moved_is_published_once(
        holder: tuple[PostgresDatabase, Coordinator]) -> None:
    """The compile's state could not be committed (`publish` never called): its early
    publication ends before the next compile starts, which publishes only its own moves
    on top of it."""
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b")])
    coordinator.stage(CompileReport(revision="r"))
    work = coordinator.prepare()  # (the failed compile's publication settled here)
    assert work is not None
    assert db.read(lambda c: replica_rows.published_generation(c, "devices")) == 1
    tips = {d: DeviceStore(work).tip(d) for d in ("a", "b")}
    compile_into(work, [files("a", "v2", parent=tips["a"], parent_known=True)])
    coordinator.stage(CompileReport(revision="r"))
    published = coordinator.publish(restored=0)
    assert published is not None and (published.generation, published.refs) == (2, 1)


def test_a_pack_stored_ahead_but_not_published_is_dropped(
        holder: tuple[PostgresDatabase, Coordinator]) -> None:
    """A device deleted while the compile ran: its publication packs again without it,
    and the stored pack (which holds the deleted device's objects) goes."""
    from wfm.fleet.deletions import publish_deletion

    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b")])
    assert coordinator.publish() is not None
    work = coordinator.prepare()
    assert work is not None
    tips = {d: DeviceStore(work).tip(d) for d in ("a", "b")}
    own = compile_into(work, [files(d, "v2", parent=tips[d], parent_known=True)
                              for d in ("a", "b")])
    db.write_sync(lambda conn: publish_deletion(conn, ["b"]))  # (before the branches move)
    coordinator.stage(CompileReport(revision="r"))
    assert coordinator.publish(restored=0) is not None
    assert pack_rows.pack_id(own.read_bytes()) not in stored_parts(db)
    named = {str(p) for p, in db.read(lambda c: c.execute(
        "SELECT parts FROM git_packs WHERE parts IS NOT NULL").fetchall())}
    assert stored_parts(db) == named


def test_the_news_of_its_own_publication_reads_no_pack_back(
        holder: tuple[PostgresDatabase, Coordinator], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync asked for in the instant between the publication's commit and the publisher
    saying its objects are linked in (what the news of it wakes the replica's loop to do:
    the seam starts that thread there) waits for the publisher, which moves its served
    copy to what it published; that sync then finds nothing to do, and no pack of the
    generation is read back."""
    _db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b")])
    read: list[int] = []
    reading = replica_rows.read_snapshot

    def spy(*args: object, **options: object) -> replica_rows.Snapshot:
        snapshot = reading(*args, **options)  # type: ignore[arg-type]
        read.extend(p.generation for p in snapshot.packs)
        return snapshot

    monkeypatch.setattr(replica_rows, "read_snapshot", spy)
    told = coordinator.serving.has_objects_of
    synced: list[bool] = []
    news = threading.Thread(target=lambda: synced.append(coordinator.sync()))

    def news_first(generation: int) -> None:
        news.start()
        news.join(0.3)
        assert news.is_alive()  # held back until the publisher has moved its copy
        told(generation)

    monkeypatch.setattr(coordinator.serving, "has_objects_of", news_first)
    published = coordinator.publish()
    news.join(10)
    assert published is not None
    assert synced == [False]
    assert published.generation not in read
    assert coordinator.serving.generation == published.generation
    assert coordinator.serving.refs() == RepoReplica("devices", work / REPOSITORY_NAME).refs()


def test_a_replica_from_before_the_parts_refuses_a_parted_pack(store: Database,
                                                               tmp_path: Path) -> None:
    """While replicas are upgraded one at a time, one still on the previous version reads
    the `git_packs` row alone, as a pack without its index, which it indexes: that fails,
    so it keeps the generation it serves rather than move its refs to objects it lacks."""
    store.write_sync(lambda conn: replica_rows.publish_rows(
        conn, "devices", 1, b"PACK" + bytes(100), {}, compact=False, index=b"idx"))
    pack, index = store.read(lambda c: c.execute(
        "SELECT pack, idx FROM git_packs WHERE generation = 1").fetchone())
    assert bytes(pack) == pack_rows.PARTED and index is None
    older = RepoReplica("devices", tmp_path / "older.git")
    with pytest.raises(RuntimeError, match="index-pack"):
        older.add_objects(replica_rows.Snapshot(1, [replica_rows.PublishedPack(
            1, bytes(pack), index)], {}))


def test_a_pack_that_could_not_be_stored_ahead_is_stored_by_the_publication(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Storing the pack beside the publication's transaction fails (a fault PostgreSQL
    cannot be asked for at that moment: the connection beside the writer's is made to
    raise, a test double): the transaction stores and names the compile's pack itself,
    and drops what the staging left."""
    db, coordinator = holder
    work = coordinator.prepare()
    assert work is not None
    own = compile_into(work, [files(d, "v1") for d in ("a", "b")])

    def failing(*args: object, **options: object) -> None:
        raise RuntimeError("staging failed")

    monkeypatch.setattr(coordinator.db, "write_apart", failing)
    coordinator.stage(CompileReport(revision="r"))
    published = coordinator.publish(restored=0)
    assert published is not None and published.generation == 1
    name = pack_rows.pack_id(own.read_bytes())
    assert db.read(lambda c: c.execute("SELECT parts FROM git_packs").fetchall()) == [(name,)]
    assert stored_parts(db) == {name}
    assert newest_pack(db, tmp_path).pack == own.read_bytes()
    assert coordinator.serving.generation == 1
