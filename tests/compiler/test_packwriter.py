"""Our pack writer against Git itself: ``git verify-pack``, ``git fsck --full --strict``,
``git cat-file`` and pygit2 read every pack it writes; its index is parsed back by the
format's documentation (version 2, 64-bit offsets included)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import struct
import subprocess
from pathlib import Path

import pygit2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.gitformat import (
    DeviceCommit,
    InvalidCommitError,
    flat_tree_of,
    packed_commit,
    tree_id_of,
)
from compiler.gitstore import DeviceStore, blob_id
from compiler.packwriter import (
    BLOB,
    COMMIT,
    TREE,
    PackedObjects,
    PackWriter,
    _ObjectTable,
    _write_index,
    object_id,
)

TS = 1_700_000_000


def bare(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    return path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), *args], check=True,
                          capture_output=True, text=True).stdout


def sample_objects(seed: int) -> list[tuple[int, bytes]]:
    """Blobs of sizes whose headers take 1 to 4 bytes (the empty one too), a tree of some
    of them and a commit of that tree."""
    rng = random.Random(seed)
    blobs = [b"", b"x", bytes(15), bytes(16), rng.randbytes(2047), rng.randbytes(2048),
             b"abc" * 100_000]
    blobs += [rng.randbytes(rng.randrange(1, 3000)) for _ in range(200)]
    entries = sorted((f"f{i}".encode(), object_id(BLOB, data)) for i, data in enumerate(blobs))
    tree = b"".join(b"100644 %s\0%s" % (name, oid) for name, oid in entries)
    commit = (b"tree %s\nauthor a <a@example.invalid> 1 +0000\n"
              b"committer a <a@example.invalid> 1 +0000\n\nmessage\n"
              % object_id(TREE, tree).hex().encode())
    return [*((BLOB, data) for data in blobs), (TREE, tree), (COMMIT, commit)]


def test_git_reads_every_object_of_a_pack_it_did_not_write(tmp_path: Path) -> None:
    repo = bare(tmp_path / "r.git")
    objects = sample_objects(1)
    writer = PackWriter(repo / "objects")
    ids = [writer.add(kind, data) for kind, data in objects]
    assert [writer.add(kind, data) for kind, data in objects] == ids  # not written again
    assert writer.count == len(set(ids))
    name = writer.publish()
    assert name is not None
    pack = repo / "objects" / "pack" / f"{name}.pack"
    assert git(repo, "verify-pack", "-v", str(pack.with_suffix(".idx"))).rstrip().endswith(
        f"{pack}: ok")
    git(repo, "update-ref", "refs/heads/main", ids[-1].hex())
    git(repo, "fsck", "--full", "--strict", "--no-dangling")
    odb = pygit2.Repository(str(repo)).odb
    for (kind, data), oid in zip(objects, ids, strict=True):
        assert odb.read(pygit2.Oid(raw=oid)) == (kind, data)
    assert git(repo, "cat-file", "-p", f"{ids[-1].hex()}^{{tree}}").count("\n") == 207
    assert list((repo / "objects" / "pack").glob("tmp_*")) == []
    assert oct(pack.stat().st_mode & 0o777) == oct(0o444)


def test_the_same_objects_make_the_same_pack_byte_for_byte(tmp_path: Path) -> None:
    packs = []
    for n in range(2):
        repo = bare(tmp_path / f"{n}.git")
        writer = PackWriter(repo / "objects", expected=1)  # grows: the same bytes anyway
        for kind, data in sample_objects(2):
            writer.add(kind, data)
        name = writer.publish()
        packs.append([(repo / "objects" / "pack" / f"{name}{suffix}").read_bytes()
                      for suffix in (".pack", ".idx")])
    assert packs[0] == packs[1]


def test_objects_deflated_elsewhere_make_the_same_pack(tmp_path: Path) -> None:
    objects = sample_objects(3)
    names = []
    for n, packed in enumerate((False, True)):
        repo = bare(tmp_path / f"{n}.git")
        writer = PackWriter(repo / "objects")
        if packed:
            writer.add_packed(PackedObjects.of([(k, d, None) for k, d in objects[:100]]))
            writer.add_packed(PackedObjects.of([(k, d, object_id(k, d)) for k, d in objects]))
        else:
            for kind, data in objects:
                writer.add(kind, data)
        names.append(writer.publish())
    assert names[0] == names[1]  # the pack's name is the id of its bytes


def test_a_discarded_or_empty_pack_leaves_nothing(tmp_path: Path) -> None:
    repo = bare(tmp_path / "r.git")
    writer = PackWriter(repo / "objects")
    writer.add(BLOB, b"gone")
    writer.discard()
    assert PackWriter(repo / "objects").publish() is None
    assert list((repo / "objects" / "pack").iterdir()) == []


def parse_index(index: bytes) -> dict[bytes, tuple[int, int]]:
    """id -> (offset, CRC-32) from a version 2 pack index (gitformat-pack), checking its
    fan-out, order and own checksum."""
    assert index[:8] == b"\xfftOc\x00\x00\x00\x02"
    fanout = struct.unpack(">256I", index[8:1032])
    count = fanout[-1]
    ids_at, crcs_at = 1032, 1032 + 20 * count
    offsets_at = crcs_at + 4 * count
    large_at = offsets_at + 4 * count
    ids = [index[ids_at + 20 * i:ids_at + 20 * i + 20] for i in range(count)]
    assert ids == sorted(ids) and len(set(ids)) == count
    assert all(fanout[b] == sum(1 for i in ids if i[0] <= b) for b in range(256))
    out = {}
    large_count = 0
    for i, oid in enumerate(ids):
        (crc,) = struct.unpack_from(">I", index, crcs_at + 4 * i)
        (offset,) = struct.unpack_from(">I", index, offsets_at + 4 * i)
        if offset & 0x80000000:
            (offset,) = struct.unpack_from(">Q", index, large_at + 8 * (offset & 0x7FFFFFFF))
            large_count += 1
        out[oid] = (offset, crc)
    end = large_at + 8 * large_count
    assert len(index) == end + 40
    assert hashlib.sha1(index[:-20]).digest() == index[-20:]
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=20, max_size=20),
                          st.integers(0, 1 << 40), st.integers(0, 0xFFFFFFFF)),
                min_size=0, max_size=300, unique_by=lambda e: e[0]),
       st.integers(0, 400))
def test_the_index_lists_every_object_in_order_past_2_gib_too(
        tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[bytes, int, int]],
        expected: int) -> None:
    """Ids of any bits (clustered, all-zero, sharing long prefixes), offsets on both sides
    of 2 GiB, and a table sized for fewer or more objects than it gets."""
    table = _ObjectTable(expected)
    for oid, offset, crc in entries:
        assert not table.has(oid)
        assert table.add(oid, offset, crc)
        assert table.has(oid)
        assert not table.add(oid, offset + 1, crc)  # held already: kept as it was
    want = {o: (off, crc) for o, off, crc in entries}
    path = tmp_path_factory.mktemp("index") / "x.idx"
    _write_index(table, path, lambda: bytes(20))
    assert parse_index(path.read_bytes()) == want
    if all(off < 0x80000000 for _, off, _ in entries):  # a pack under 2 GiB: copied
        short = path.with_name("short.idx")
        _write_index(table, short, lambda: bytes(20), large_offsets=False)
        assert short.read_bytes() == path.read_bytes()


def test_ids_sharing_their_leading_bits_are_told_apart() -> None:
    table = _ObjectTable(4)
    same = [bytes(8) + bytes([i]) * 12 for i in range(1, 40)] + [bytes(20)]
    for n, oid in enumerate(same):
        assert table.add(oid, n, n)
    assert all(table.has(oid) for oid in same)
    assert not table.has(bytes(8) + b"\xff" * 12)
    assert [e[:20] for run in table.sorted_runs() for e in run] == sorted(same)


def test_an_id_spelled_across_two_records_is_not_held() -> None:
    """A bucket is searched as one string: the bytes of one record's offset and CRC and
    the next one's id may spell an id that is not there."""
    table = _ObjectTable(0)
    first, second = bytes(3) + b"\x01" * 17, bytes(3) + b"\x02" * 17
    assert table.add(first, 0x0000_0000_0000_00AB, 0x0000_00CD)
    assert table.add(second, 1, 1)
    straddling = (0xAB).to_bytes(8, "big") + (0xCD).to_bytes(4, "big") + second[:8]
    assert not table.has(straddling)
    assert table.add(straddling, 2, 2)
    assert table.has(straddling) and table.count == 3


def test_a_table_sized_for_none_grows_and_keeps_every_object() -> None:
    rng = random.Random(7)
    ids = [rng.randbytes(20) for _ in range(40_000)]  # past two doublings of the buckets
    table = _ObjectTable(0)
    for n, oid in enumerate(ids):
        assert table.add(oid, n, n ^ 0xFFFF)
    assert table.count == len(ids) and all(table.has(oid) for oid in ids[::97])
    entries = [entry for run in table.sorted_runs() for entry in run]
    assert [e[:20] for e in entries] == sorted(ids)
    assert {e[:20]: struct.unpack(">QI", e[20:]) for e in entries} == {
        oid: (n, n ^ 0xFFFF) for n, oid in enumerate(ids)}


def packed(commit: DeviceCommit, ids: dict[str, str]) -> DeviceCommit:
    """`commit` as a compile's worker sends it: its objects made and deflated, no files,
    the tree worked out once beforehand (`flat_tree_of`), as the compile does; packing
    without it gives the same commit, whose tree is the one `tree_id_of` names."""
    args = (commit.device_id, commit.files, ids, commit.parent, commit.message,
            commit.timestamp, DeviceStore.AUTHOR)
    flat = flat_tree_of(ids)
    made = packed_commit(*args, tree=flat)
    assert made.commit == packed_commit(*args).commit
    assert flat[1].hex() == tree_id_of(ids)
    return dataclasses.replace(commit, files={}, packed=made)


def test_a_packed_commit_is_the_commit_written_from_its_files(tmp_path: Path) -> None:
    """What a compile's worker packs is byte for byte what the store writes itself."""
    files = {"a.yaml": b"a: 1\n", "b.yaml": b"b: 2\n"}
    ids = {name: blob_id(data) for name, data in files.items()}
    commit = DeviceCommit("dev", files, "Compile dev\n", TS, parent=None, parent_known=True)
    plain = DeviceStore(tmp_path / "plain").write([commit])
    store = DeviceStore(tmp_path / "packed")
    assert store.write([packed(commit, ids)]) == plain
    assert store.read_files("dev") == files
    second = DeviceCommit("dev", {"a.yaml": b"a: 2\n"}, "Again\n", TS + 1,
                          kept={"b.yaml": ids["b.yaml"]}, parent=plain["dev"],
                          parent_known=True)
    again = packed(second, {"a.yaml": blob_id(b"a: 2\n"), "b.yaml": ids["b.yaml"]})
    with pytest.raises(InvalidCommitError, match="first commit of a write"):
        store.write([DeviceCommit("dev", {"c": b"c"}, "m\n", TS), again])
    assert store.write([again])["dev"] == again.packed.commit  # type: ignore[union-attr]
    assert store.read_files("dev") == {"a.yaml": b"a: 2\n", "b.yaml": b"b: 2\n"}
    unknown_parent = dataclasses.replace(packed(commit, ids), parent_known=False)
    with pytest.raises(InvalidCommitError, match="known parent"):
        store.write([unknown_parent])
    with pytest.raises(InvalidCommitError, match="contains"):
        packed_commit("dev", {}, {"a/b": ids["a.yaml"]}, None, "m\n", TS, DeviceStore.AUTHOR)
