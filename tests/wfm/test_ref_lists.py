"""A publication that moves most refs stores their whole list (`wfm.store.ref_lists`) instead
of a row per ref, and replicas install it as their `packed-refs`.

On SQLite and PostgreSQL: a list is staged, named by the publication, read back whole or
one ref at a time (chunks cut small here, so that refs fall on every side of a cut); rows
published later move refs on top of it, and the questions asked of single refs
(`published_ref`, `deleted_at`) answer as they would from rows. With a real compile lease
holder on PostgreSQL: the compile's list is what a replica built from the database alone
serves, byte for byte, and a deletion published after it removes the branch; a replica
of a version before the lists, reading rows only, refuses the generation instead of
serving it without its refs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kits.replicakit import lease_holder
from test_compiled_pack_publication import applied_elsewhere, compile_into, files

from compiler.gitstore import REPOSITORY_NAME, DeviceStore, device_ref
from compiler.packedrefs import PackedRefsError, move_refs, rendered_refs
from wfm.fleet.replication import RepoReplica
from wfm.store import ref_lists, replica_rows
from wfm.store.database import Database
from wfm.store.pgdb import PostgresDatabase

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator

REFS = {f"refs/heads/devices/d{i:03}": hashlib.sha1(str(i).encode()).hexdigest()
        for i in range(300)}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref_lists, "CHUNK_BYTES", 500)


def publish(db: Database, generation: int, refs: dict[str, str | None],
            listed: str | None = None, *, compact: bool = False) -> None:
    def write(conn: object) -> None:
        replica_rows.publish_rows(conn, "devices", generation, b"", refs,  # type: ignore[arg-type]
                                  compact=compact, listed=listed)
        replica_rows.set_counter(conn, "devices", generation)  # type: ignore[arg-type]
    db.write_sync(write)


def snapshot(db: Database, since: int, spool: Path) -> replica_rows.Snapshot:
    return db.read(lambda c: replica_rows.read_snapshot(c, "devices", since,
                                                        dialect=db.dialect, spool=spool))


@pytest.mark.usefixtures("small_chunks")
def test_a_list_is_named_read_whole_and_found_one_ref_at_a_time(
        store: Database, tmp_path: Path) -> None:
    deleted_first = "refs/heads/devices/d007"
    publish(store, 1, {deleted_first: None})  # (deleted before the list lists it again)
    data = rendered_refs(REFS)
    name = store.write_sync(lambda c: ref_lists.stage_list(c, "devices", data))
    assert store.write_sync(lambda c: ref_lists.stage_list(c, "devices", data)) == name
    assert store.read(lambda c: ref_lists.newest_list(c, "devices")) is None  # (staged)
    chunks = store.read(lambda c: c.execute(
        "SELECT COUNT(*) FROM git_ref_lists WHERE list = ?", (name,)).fetchone()[0])
    assert chunks > 10

    publish(store, 2, {"refs/heads/devices/gone": None, **REFS}, listed=name)
    rows = store.read(lambda c: dict(c.execute(
        "SELECT name, target FROM git_refs WHERE generation = 2").fetchall()))
    assert rows == {"refs/heads/devices/gone": None, replica_rows.LISTED[0]:
                    replica_rows.LISTED[1]}
    assert store.read(lambda c: ref_lists.read_list(c, "devices", name)) == data
    for ref, target in REFS.items():
        assert store.read(lambda c, r=ref: ref_lists.find_ref(c, "devices", name, r)) == target
    for absent in ("refs/heads/a", "refs/heads/devices/d0", "refs/heads/devices/d9999",
                   "refs/heads/devices/d001x", "d001"):
        assert store.read(lambda c, r=absent: ref_lists.find_ref(c, "devices", name, r)) is None

    moved, gone = "refs/heads/devices/d100", "refs/heads/devices/d200"
    publish(store, 3, {moved: "f" * 40, gone: None})
    whole = snapshot(store, -1, tmp_path)
    assert (whole.generation, whole.whole, whole.refs) == (3, data, {moved: "f" * 40,
                                                                     gone: None})
    assert snapshot(store, 1, tmp_path).whole == data
    after = snapshot(store, 2, tmp_path)
    assert (after.whole, after.refs) == (None, {moved: "f" * 40, gone: None})

    def asked(ref: str) -> tuple[object, object]:
        return (store.read(lambda c: replica_rows.published_ref(c, "devices", ref)),
                store.read(lambda c: replica_rows.deleted_at(c, "devices", ref)))
    assert asked(moved) == (("f" * 40, 3), None)
    assert asked(gone) == ((None, 3), 3)
    assert asked("refs/heads/devices/d001") == ((REFS["refs/heads/devices/d001"], 2), None)
    assert asked("refs/heads/devices/gone") == ((None, 2), 2)
    assert asked(deleted_first) == ((REFS[deleted_first], 2), None)  # (listed again)
    assert asked("refs/heads/devices/never") == (None, None)

    other = store.write_sync(lambda c: ref_lists.stage_list(c, "devices", rendered_refs({})))
    publish(store, 4, {}, listed=other)
    assert store.read(lambda c: c.execute(
        "SELECT DISTINCT list FROM git_ref_lists").fetchall()) == [(other,)]
    assert asked(moved) == (None, None)  # (a newer list that does not list it)
    assert asked(gone) == ((None, 3), 3)

    # A list staged for a publication that never happened goes with the next compaction.
    store.write_sync(lambda c: ref_lists.stage_list(c, "devices", data))
    publish(store, 5, {}, compact=True)
    assert store.read(lambda c: c.execute(
        "SELECT DISTINCT list FROM git_ref_lists").fetchall()) == [(other,)]


def test_a_publication_is_listed_only_when_most_refs_move() -> None:
    assert ref_lists.worth_listing(60_000, 100_000)
    assert not ref_lists.worth_listing(40_000, 100_000)  # (too few to be worth it)
    assert not ref_lists.worth_listing(60_000, 1_000_000)  # (most refs stay)
    assert ref_lists.worth_listing(3, 4, start=2)


@pytest.fixture
def holder(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[PostgresDatabase, Coordinator]]:
    monkeypatch.setattr(ref_lists, "LIST_FROM", 3)
    monkeypatch.setattr(ref_lists, "CHUNK_BYTES", 100)
    with lease_holder(pg_url, tmp_path / "data") as held:
        yield held


def test_a_compile_that_moves_most_branches_is_served_from_its_list(
        holder: tuple[PostgresDatabase, Coordinator], tmp_path: Path) -> None:
    from wfm.fleet.deletions import publish_deletion

    db, coordinator = holder
    moved: list[frozenset[str]] = []
    coordinator.on_synced = moved.append
    work = coordinator.prepare()
    assert work is not None
    compile_into(work, [files(d, "v1") for d in ("a", "b", "c", "d")])
    published = coordinator.publish()
    assert published is not None
    listed = db.read(lambda c: ref_lists.newest_list(c, "devices"))
    assert listed is not None and listed[0] == published.generation
    own = RepoReplica("devices", work / REPOSITORY_NAME)
    other = applied_elsewhere(db, tmp_path / "first")
    assert other.refs() == own.refs() == coordinator.serving.refs()
    assert (other.path / "packed-refs").read_bytes() == (own.path / "packed-refs").read_bytes()

    # A replica of a version before the lists reads the rows only, and refuses them.
    rows = db.read(lambda c: dict(c.execute(
        "SELECT name, target FROM git_refs WHERE generation > 0").fetchall()))
    assert rows == {replica_rows.LISTED[0]: replica_rows.LISTED[1]}
    with pytest.raises(PackedRefsError, match="not a full object id"):
        move_refs(tmp_path / "old.git", {n: (None, t) for n, t in rows.items()})

    # Three of four move again: listed again, on top of which a deletion is a row.
    work = coordinator.prepare()
    assert work is not None
    tips = {d: DeviceStore(work).tip(d) for d in ("a", "b", "c")}
    compile_into(work, [files(d, "v2", parent=tips[d], parent_known=True) for d in tips])
    assert coordinator.publish() is not None
    generation = db.write_sync(lambda conn: publish_deletion(conn, ["b"]))
    coordinator.sync()  # (its own loop, started by `lease_holder`, may have synced first)
    assert coordinator.serving.generation == generation
    assert device_ref("b") not in coordinator.serving.refs()
    assert moved[-1] == {"b"}
    assert moved[-2] == {"a", "b", "c"}  # (what the second list moved, not all it lists)
    again = applied_elsewhere(db, tmp_path / "second")
    assert again.refs() == coordinator.serving.refs() == {
        n: t for n, t in own.refs().items() if n != device_ref("b")}
