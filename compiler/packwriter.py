"""Write Git objects straight into one new pack of a repository (`PackWriter`), with its
index, published only when the caller says so.

Why our own writer instead of ``git fast-import``: a compile already knows every object it
writes whole (its files, its flat trees, its commits), so all Git added was deflating each
one and finding deltas between them, on one core, in a second process holding an entry per
object (7.7 GB at a million devices). MEASURED (100,000 devices, 743,773 objects):
fast-import spent 18 s of CPU on them; the compile's workers now make and deflate a
commit's objects in about 30-40 us (`PackedObjects`; 70-90 at level 1), 3-4 s in all,
spread over their cores, and this writer only copies them. The pack is undeltified and
lightly compressed (385 MB where fast-import's was 176 MB: `_LEVEL` says why); a later
``git gc`` (or ``git repack -d``) deltifies it like any other pack.

The formats are Git's documented ones (``gitformat-pack``): a version 2 pack (``PACK``,
version, object count, then per object a type-and-size header and its zlib-deflated
content, then the SHA-1 of everything before it) and a version 2 index (fan-out table,
sorted object ids, CRC-32 of each entry, offsets, 64-bit offsets past 2 GiB, the pack's
and its own SHA-1). Git and libgit2 read them as any pack (`tests/compiler/
test_packwriter.py` holds them to ``git verify-pack``, ``git fsck`` and pygit2).

All or nothing: objects go to a temporary file of the pack directory, which no reader
looks at (``tmp_pack_margo_*``: `compiler.stalelocks` removes one a killed writer left);
`PackWriter.publish` renames the pack and then its index into place, so a reader finds
a pack only when both are whole on disk.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import os
import struct
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from isal import isal_zlib

__all__ = ["BLOB", "COMMIT", "TEMP_PREFIX", "TREE", "PackWriter", "PackedObjects",
           "object_id"]

COMMIT, TREE, BLOB = 1, 2, 3
_KIND_NAMES = {COMMIT: b"commit", TREE: b"tree", BLOB: b"blob"}
#: What a pack this module is still writing is called in ``objects/pack``.
TEMP_PREFIX = "tmp_pack_margo_"
# Intel's ISA-L at level 0: 1.75 us per object where its level 1 takes 7 and zlib's level 1
# takes 14 (a compile's objects are small, about 800 bytes, and a stream's set-up dominates),
# for 0.63 of the objects' bytes where level 1 gives 0.44 (measured on a 100,000-device
# fleet's objects: 4 s less of the workers' CPU for a pack of 385 MB instead of 278). The
# stream is plain zlib, which Git inflates as any other; a later repack compresses again.
_LEVEL = 0
_RECORD = struct.Struct(">20sII")  # id, CRC-32 of the entry, entry length
_HASH_CHUNK = 1 << 20
_LARGE_OFFSET = 0x80000000
_READ_ONLY = 0o444  # as Git leaves its packs: nothing rewrites one in place


@dataclass(frozen=True, slots=True)
class PackedObjects:
    """Objects already deflated into pack entries, where they were made (a compile's worker
    process, on another core than the one writing the pack), as two strings: per object
    its id, CRC-32 and entry length (`_RECORD`), and the entries one after another. Two
    objects instead of three per Git object, since they cross to the writer in a pickle."""

    records: bytes
    entries: bytes

    @classmethod
    def of(cls, objects: Iterable[tuple[int, bytes, bytes | None]]) -> PackedObjects:
        """(kind, content, binary id or None to compute it) for each object."""
        records, entries = [], []
        for kind, data, known in objects:
            oid = known if known is not None else object_id(kind, data)
            entry = _entry_header(kind, len(data)) + _deflate(data)
            records.append(_RECORD.pack(oid, zlib.crc32(entry), len(entry)))
            entries.append(entry)
        return cls(b"".join(records), b"".join(entries))

    @property
    def last_id(self) -> bytes:
        """The id of the last object."""
        return self.records[-_RECORD.size:][:20]


def _deflate(data: bytes) -> bytes:
    return isal_zlib.compress(data, _LEVEL)


def object_id(kind: int, data: bytes) -> bytes:
    """The binary SHA-1 Git names an object of this kind and content by."""
    digest = hashlib.sha1(b"%s %d\0" % (_KIND_NAMES[kind], len(data)), usedforsecurity=False)
    digest.update(data)
    return digest.digest()


class PackWriter:
    """One pack being written into ``<objects_dir>/pack``: `add` each object (an object
    already added is not written again), then `publish` (or `discard`).

    An object an older pack of the repository holds is written again all the same: asking
    libgit2 costs a rescan of the pack directory for every object it does not find (20% of
    a compile's writing, measured), and Git reads an object from whichever pack has it.
    """

    def __init__(self, objects_dir: Path, *, expected: int = 0) -> None:
        """`expected` (a number of objects) sizes the table of written ids up front."""
        self._pack_dir = objects_dir / "pack"
        self._pack_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".pack", dir=self._pack_dir)
        self._path = Path(name)
        self._file = os.fdopen(fd, "w+b", buffering=_HASH_CHUNK)
        self._file.write(b"PACK" + struct.pack(">II", 2, 0))  # the count is set at the end
        self._offset = 12
        self._table = _ObjectTable(expected)
        self._closed = False

    @property
    def count(self) -> int:
        """How many objects the pack holds so far."""
        return self._table.count

    def holds(self, oid: bytes) -> bool:
        """Whether the pack holds the object of this binary id."""
        return self._table.has(oid)

    def add(self, kind: int, data: bytes) -> bytes:
        """Write one object (unless the pack holds it already); its binary id."""
        oid = object_id(kind, data)
        if self._table.has(oid):
            return oid
        entry = _entry_header(kind, len(data)) + _deflate(data)
        self._table.add(oid, self._offset, zlib.crc32(entry))
        self._file.write(entry)
        self._offset += len(entry)
        return oid

    def add_packed(self, packed: PackedObjects) -> None:
        """Write objects deflated elsewhere (those the pack holds already are not)."""
        view, start, table = memoryview(packed.entries), 0, self._table
        for oid, crc, length in _RECORD.iter_unpack(packed.records):
            end = start + length
            if table.add(oid, self._offset, crc):
                self._file.write(view[start:end])
                self._offset += length
            start = end

    def publish(self) -> str | None:
        """Finish the pack and its index and move both into place; the pack's name
        (``pack-<id>``), or None when nothing was added (no pack is left behind)."""
        self._closed = True
        try:
            if self._table.count == 0:
                self._file.close()
                self._path.unlink()
                return None
            return self._finish()
        except BaseException:
            self._remove()
            raise

    def publish_while(self, meanwhile: Callable[[], object] | None) -> str | None:
        """`publish` on another thread while `meanwhile` runs on this one (reading the pack
        back to hash it and syncing it to disk leave the interpreter to it); the first
        exception of either is raised once both are done."""
        if meanwhile is None:
            return self.publish()
        published: list[str | None] = []
        failed: list[BaseException] = []

        def publish() -> None:
            try:
                published.append(self.publish())
            except BaseException as exc:  # re-raised on the caller's thread
                failed.append(exc)

        publishing = threading.Thread(target=publish, name="margo-pack-publish")
        publishing.start()
        try:
            meanwhile()
        finally:
            publishing.join()
        if failed:
            raise failed[0]
        return published[0]

    def discard(self) -> None:
        """Drop the pack: nothing was published."""
        if not self._closed:
            self._closed = True
            self._remove()

    def _remove(self) -> None:
        self._file.close()
        for path in (self._path, self._path.with_suffix(".idx")):
            path.unlink(missing_ok=True)

    def _finish(self) -> str:
        """Set the count, hash the pack, write it and its index durably, rename both."""
        self._file.flush()
        os.pwrite(self._file.fileno(), struct.pack(">I", self._table.count), 8)
        index_path = self._path.with_suffix(".idx")
        # The pack is hashed (in C, the interpreter left) while its index is written.
        with ThreadPoolExecutor(1, thread_name_prefix="margo-pack-hash") as hashing:
            hashed = hashing.submit(_hash_file, self._file)
            _write_index(self._table, index_path, hashed.result,
                         large_offsets=self._offset >= _LARGE_OFFSET)
            pack_id = hashed.result()
        self._file.seek(0, os.SEEK_END)
        self._file.write(pack_id)
        self._file.flush()
        os.fchmod(self._file.fileno(), _READ_ONLY)
        os.fsync(self._file.fileno())
        self._file.close()
        name = f"pack-{pack_id.hex()}"
        os.rename(self._path, self._pack_dir / f"{name}.pack")
        os.rename(index_path, self._pack_dir / f"{name}.idx")  # readers look for the index
        _sync_directory(self._pack_dir)
        return name


def _entry_header(kind: int, size: int) -> bytes:
    """A pack entry's header: the type and the low 4 bits of the size, then 7 bits of the
    size per byte, each byte but the last with its high bit set."""
    out = bytearray()
    byte = (kind << 4) | (size & 0x0F)
    size >>= 4
    while size:
        out.append(byte | 0x80)
        byte, size = size & 0x7F, size >> 7
    out.append(byte)
    return bytes(out)


def _hash_file(file: object) -> bytes:
    """SHA-1 of a whole file, read through its own descriptor (positioned reads)."""
    fd = file.fileno()  # type: ignore[attr-defined]
    digest = hashlib.sha1(usedforsecurity=False)
    offset = 0
    while chunk := os.pread(fd, _HASH_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.digest()


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ObjectTable:
    """The ids, offsets and CRC-32s of a pack's objects as 32-byte records (id, offset,
    CRC), in buckets by the id's leading bits: one bytearray each, searched in C.

    Why this shape: a million-device compile writes about 7.4 million objects. A dict of
    them costs about 200 bytes each in this process (1.5 GB); these records cost about 36
    with the buckets' own. Asking whether an object is held is one `bytearray.find` over a
    bucket of a few hundred bytes, 1.5 us an added object, where an open-addressing table
    of the same records took 4.8 (each probe a random access into tens of megabytes,
    measured with 740,000 ids). The buckets are in id order, so the index is written one
    sorted bucket after another.
    """

    _SIZE = 32
    _MIN_BITS = 8  # so that the ids of a bucket share their first byte (the fan-out's)
    _MAX_BITS = 20
    _GROW_AT = 64  # records a bucket holds on average before the buckets double

    def __init__(self, expected: int) -> None:
        bits = (max(expected, 0) // 16).bit_length()  # about 16 records a bucket
        self._bits = min(self._MAX_BITS, max(self._MIN_BITS, bits))
        self._buckets = [bytearray() for _ in range(1 << self._bits)]
        self.count = 0

    def _bucket(self, oid: bytes) -> bytearray:
        return self._buckets[int.from_bytes(oid[:3], "big") >> (24 - self._bits)]

    @classmethod
    def _holds(cls, bucket: bytearray, oid: bytes) -> bool:
        """Whether a record of `bucket` has this id (a match that straddles two records
        is not one)."""
        at = bucket.find(oid)
        while at >= 0:
            if at % cls._SIZE == 0:
                return True
            at = bucket.find(oid, at + 1)
        return False

    def has(self, oid: bytes) -> bool:
        return self._holds(self._bucket(oid), oid)

    def add(self, oid: bytes, offset: int, crc: int) -> bool:
        """Record an object unless the table holds it already; whether it was new (one
        search: `PackWriter.add_packed` asks this of every object a compile writes)."""
        bucket = self._bucket(oid)
        if self._holds(bucket, oid):
            return False
        bucket += oid
        bucket += _TAIL.pack(offset, crc)
        self.count += 1
        if self.count > self._GROW_AT << self._bits and self._bits < self._MAX_BITS:
            self._split()
        return True

    def _split(self) -> None:
        """Twice the buckets, each record moved to the one its id now falls in."""
        bits, size = self._bits + 1, self._SIZE
        buckets = [bytearray() for _ in range(1 << bits)]
        for bucket in self._buckets:
            for at in range(0, len(bucket), size):
                buckets[int.from_bytes(bucket[at:at + 3], "big") >> (24 - bits)] += \
                    bucket[at:at + size]
        self._buckets, self._bits = buckets, bits

    def sorted_runs(self) -> Iterator[list[bytes]]:
        """Every object's 32 bytes (id, offset, CRC) ordered by id: one sorted list per
        bucket that holds any, the ids of each sharing their first byte."""
        size = self._SIZE
        for bucket in self._buckets:
            if bucket:
                yield sorted(bytes(bucket[at:at + size]) for at in range(0, len(bucket), size))


_TAIL = struct.Struct(">QI")  # a record's offset and CRC


def _write_index(table: _ObjectTable, path: Path, pack_id: Callable[[], bytes], *,
                 large_offsets: bool = True) -> None:
    """A version 2 pack index of the table's objects, durably; `pack_id` is asked for the
    pack's id once everything before it is written. The ids stream to the file in order;
    the CRCs and offsets (8 bytes an object) wait in memory until they follow. Without
    `large_offsets` (a pack under 2 GiB) every offset is the low half of its record's,
    copied as it is."""
    fanout = [0] * 256
    crcs, offsets, large = bytearray(), array.array("I"), array.array("Q")
    short = bytearray()
    with open(path, "w+b", buffering=_HASH_CHUNK) as out:
        out.write(b"\xfftOc" + struct.pack(">I", 2) + bytes(1024))
        for run in table.sorted_runs():
            out.write(b"".join([entry[:20] for entry in run]))
            fanout[run[0][0]] += len(run)
            crcs += b"".join([entry[28:32] for entry in run])
            if not large_offsets:
                short += b"".join([entry[24:28] for entry in run])
                continue
            for entry in run:
                offset = int.from_bytes(entry[20:28], "big")
                if offset < _LARGE_OFFSET:
                    offsets.append(offset)
                else:
                    offsets.append(_LARGE_OFFSET | len(large))
                    large.append(offset)
        for values in (offsets, large):
            if sys.byteorder == "little":
                values.byteswap()
        out.write(crcs)
        out.write(short or offsets.tobytes())
        out.write(large.tobytes())
        out.write(pack_id())
        out.flush()
        os.pwrite(out.fileno(), struct.pack(">256I", *itertools.accumulate(fanout)), 8)
        out.write(_hash_file(out))
        out.flush()
        os.fchmod(out.fileno(), _READ_ONLY)
        os.fsync(out.fileno())
