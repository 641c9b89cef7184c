"""The compile's pack stored while it is written (`wfm.fleet.trickle`), on a real
PostgreSQL database and the compiler's own pack writer: the parts stored ahead are the
file's bytes, named with the rest in one transaction, and dropped when the pack published
is not the file they came from."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.replicakit import lease_holder

from compiler.gitformat import DeviceCommit
from compiler.gitstore import REPOSITORY_NAME, DeviceStore
from compiler.packwriter import BLOB, PackWriter
from compiler.report import CompileReport
from tools.polling import poll_until
from wfm.fleet.prefetch import Prefetch
from wfm.fleet.trickle import PackTrickle
from wfm.store import pack_rows, replica_rows
from wfm.store.database import Database
from wfm.store.opening import open_database

PART = 512


@pytest.fixture
def db(pg_url: str) -> Iterator[Database]:
    store = open_database(pg_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 512 bytes; the pack writer's buffer (1 MiB, which a compile's pack fills
    many times over) as small, so that the file grows as objects are added."""
    monkeypatch.setattr(pack_rows, "PART_BYTES", PART)
    monkeypatch.setattr("compiler.packwriter._HASH_CHUNK", 256)
    monkeypatch.setattr("wfm.fleet.prefetch.LOOK_EVERY", 0.0)  # (a look at every call)


def parts_named(db: Database, name: str) -> list[int]:
    return [int(n) for n, in db.read(lambda c: c.execute(
        "SELECT part FROM git_pack_parts WHERE pack = ? AND file = ? ORDER BY part",
        (name, pack_rows.PACK_FILE)).fetchall())]


def write_slowly(db: Database, trickle: PackTrickle, objects: Path) -> Path:
    """A pack written in two halves, the trickle given time to store parts of the first;
    the published pack file."""
    writer = PackWriter(objects)
    for number in range(40):
        writer.add(BLOB, os.urandom(100) + str(number).encode())
    poll_until("parts stored while the pack is written",
               lambda: len(parts_named(db, trickle.name)) >= 3, timeout=10)
    for number in range(40, 80):
        writer.add(BLOB, os.urandom(100) + str(number).encode())
    name = writer.publish()
    assert name is not None
    return objects / "pack" / f"{name}.pack"


def followed_pack(db: Database, tmp_path: Path) -> tuple[PackTrickle, Path, Path]:
    """A trickle following a pack written slowly into a new object store: the trickle,
    the store's `objects` folder and the pack file published."""
    objects = tmp_path / "repo.git" / "objects"
    (objects / "pack").mkdir(parents=True)
    trickle = PackTrickle(db, "devices", objects / "pack", every=0.01)
    return trickle, objects, write_slowly(db, trickle, objects)


def other_replica(db: Database, tmp_path: Path) -> tuple[Prefetch, Path]:
    """Another replica's prefetch and its folder."""
    (folder := tmp_path / "other").mkdir()
    return Prefetch(db, "devices", folder), folder


def test_the_parts_stored_ahead_are_named_with_the_rest(db: Database, tmp_path: Path) -> None:
    trickle, _, pack_file = followed_pack(db, tmp_path)
    trickled = trickle.finish(pack_file)
    assert trickled is not None and trickled.parts >= 3
    assert parts_named(db, trickle.name) == list(range(1, trickled.parts + 1))  # never 0
    pack, index = pack_file.read_bytes(), pack_file.with_suffix(".idx").read_bytes()
    name = db.write_sync(lambda c: pack_rows.stage_pack(c, "devices", pack, index,
                                                        trickled=trickled))
    assert parts_named(db, trickle.name) == []
    assert parts_named(db, name) == list(range(-(-len(pack) // PART)))
    read = db.read(lambda c: pack_rows.read_packs(
        c, [(1, pack_rows.PARTED, None, name)], "devices", tmp_path))
    assert [(bytes(p), bytes(i or b"")) for _, p, i, _ in read] == [(pack, index)]


def test_parts_of_another_file_are_dropped(db: Database, tmp_path: Path) -> None:
    trickle, objects, followed = followed_pack(db, tmp_path)
    other = PackWriter(objects)
    other.add(BLOB, b"another pack")
    published = objects / "pack" / f"{other.publish()}.pack"
    assert trickle.finish(published) is None
    assert parts_named(db, trickle.name) == []
    assert trickle.finish(followed) is None  # (once)


def test_a_compile_publishes_the_parts_it_stored_while_writing(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the coordinator: `prepare` follows the compile's pack, `stage` stores only
    what was not stored while it was written, and the publication names the whole pack."""
    stored: list[tuple[str, list[int]]] = []
    store_parts = pack_rows.store_pack_parts

    def spy(conn: object, repo: str, name: str,
            parts: list[tuple[int, int, pack_rows.PackData]]) -> None:
        stored.append((name, [n for f, n, _ in parts if f == pack_rows.PACK_FILE]))
        store_parts(conn, repo, name, parts)  # type: ignore[arg-type]

    monkeypatch.setattr(pack_rows, "store_pack_parts", spy)
    monkeypatch.setattr("wfm.fleet.trickle.LOOK_EVERY", 0.01)
    finish = PackWriter._finish

    def slow_finish(writer: PackWriter) -> str:  # the trickle catches up before the end
        poll_until("parts stored ahead", lambda: any(
            n.startswith("provisional-") for n, _ in stored), timeout=10)
        return finish(writer)

    monkeypatch.setattr(PackWriter, "_finish", slow_finish)
    with lease_holder(pg_url, tmp_path / "data") as (db, coordinator):
        work = coordinator.prepare()
        assert work is not None
        DeviceStore(work).write([DeviceCommit(
            f"d{i}", {"deployment.yaml": os.urandom(300).hex().encode()}, "v1",
            1_700_000_000) for i in range(30)])
        coordinator.stage(CompileReport(revision="r", restored_branches=0))
        assert coordinator.publish(restored=0) is not None
        snapshot = db.read(lambda c: replica_rows.read_snapshot(
            c, "devices", -1, dialect=db.dialect, spool=tmp_path))
        provisional = db.read(lambda c: c.execute(
            "SELECT COUNT(*) FROM git_pack_parts WHERE pack LIKE 'provisional-%'"
        ).fetchone()[0])
    ahead = [n for name, numbers in stored if name.startswith("provisional-")
             for n in numbers]
    (pack_name, rest), = [(name, numbers) for name, numbers in stored  # (and its origin)
                          if not name.startswith("provisional-") and numbers]
    assert ahead and not set(ahead) & set(rest) and 0 in rest
    pack_file = next((work / REPOSITORY_NAME / "objects" / "pack").glob("pack-*.pack"))
    assert sorted(ahead + rest) == list(range(-(-pack_file.stat().st_size // PART)))
    assert pack_name == pack_file.stem.removeprefix("pack-")
    assert bytes(snapshot.packs[-1].pack) == pack_file.read_bytes() and provisional == 0


def test_a_replica_reads_the_parts_while_they_are_stored(db: Database,
                                                         tmp_path: Path) -> None:
    """Another replica's copy of the provisional parts (`Prefetch`) is the start of the
    pack it reads once the pack is named: the same file (moved), the rest read into it."""
    prefetch, elsewhere = other_replica(db, tmp_path)
    trickle, _, pack_file = followed_pack(db, tmp_path)
    trickled = trickle.finish(pack_file)
    assert trickled is not None
    prefetch.look()
    with prefetch.claim() as held:
        assert held is not None and held.parts == trickled.parts
        inode = held.path.stat().st_ino
    pack, index = pack_file.read_bytes(), pack_file.with_suffix(".idx").read_bytes()
    name = db.write_sync(lambda c: pack_rows.stage_pack(c, "devices", pack, index,
                                                        trickled=trickled))
    spool = elsewhere / "spool"
    spool.mkdir()
    with prefetch.claim() as held:
        (read,) = db.read(lambda c: pack_rows.read_packs(
            c, [(1, pack_rows.PARTED, None, name)], "devices", spool, held))
    assert bytes(read[1]) == pack and bytes(read[2] or b"") == index
    assert read[3] is not None and read[3].stat().st_ino == inode  # the prefetched file
    assert prefetch.held() is None and list(elsewhere.glob("margo-prefetch-*")) == []


def test_a_prefetched_file_of_another_pack_is_not_used(db: Database, tmp_path: Path) -> None:
    prefetch, _ = other_replica(db, tmp_path)
    trickle, _, pack_file = followed_pack(db, tmp_path)
    prefetch.look()
    assert trickle.finish(None) is None  # (the pack published was packed anew)
    pack, index = pack_file.read_bytes(), pack_file.with_suffix(".idx").read_bytes()
    name = db.write_sync(lambda c: pack_rows.stage_pack(c, "devices", pack, index))
    with prefetch.claim() as held:
        assert held is not None
        (read,) = db.read(lambda c: pack_rows.read_packs(
            c, [(1, pack_rows.PARTED, None, name)], "devices", tmp_path, held))
        assert held.path.exists()  # not taken
    assert bytes(read[1]) == pack and bytes(read[2] or b"") == index
    prefetch.look()  # the provisional parts are gone: the file stays for a later sync
    held = prefetch.held()
    assert held is not None
    prefetch.clear()  # (until this replica compiles itself)
    assert prefetch.held() is None and not held.path.exists()


def test_the_other_replica_syncs_from_what_it_read_during_the_compile(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two coordinators on one database: while the holder's compile writes its pack, the
    other reads the stored parts; its sync of the publication takes that file (none is
    left) and serves every device's branch."""
    from wfm.fleet.coordination import Coordinator

    monkeypatch.setattr("wfm.fleet.trickle.LOOK_EVERY", 0.01)
    read: list[int] = []
    read_provisional = pack_rows.read_provisional

    def spy(conn: object, repo: str, name: str, first: int, last: int
            ) -> list[tuple[int, bytes]]:
        parts = read_provisional(conn, repo, name, first, last)
        read.extend(n for n, _ in parts)
        return parts

    monkeypatch.setattr(pack_rows, "read_provisional", spy)
    finish = PackWriter._finish

    def slow_finish(writer: PackWriter) -> str:  # the other replica reads some parts first
        poll_until("parts read by the other replica", lambda: len(read) >= 2, timeout=10)
        return finish(writer)

    monkeypatch.setattr(PackWriter, "_finish", slow_finish)
    with lease_holder(pg_url, tmp_path / "data") as (db, holder):
        other = Coordinator(db, tmp_path / "other", poll=0.05, name="other")
        other.start()
        try:
            work = holder.prepare()
            assert work is not None
            commits = [DeviceCommit(f"d{i}", {"deployment.yaml": os.urandom(300).hex().encode()},
                                    "v1", 1_700_000_000) for i in range(30)]
            DeviceStore(work).write(commits)
            holder.stage(CompileReport(revision="r", restored_branches=0))
            published = holder.publish(restored=0)
            assert published is not None
            poll_until("the other replica serves it",
                       lambda: other.generation == published.generation, timeout=10)
            assert list(other.serving.path.glob("margo-prefetch-*")) == []  # taken
            assert other.serving.refs() == holder.serving.refs()
            assert DeviceStore(tmp_path / "other" / "repos").tip("d7") is not None
        finally:
            other.stop()
