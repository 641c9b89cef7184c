"""The rows a published Git pack is kept in: the pack and its index in parts, under the
pack's checksum (`git_pack_parts`), named by the `git_packs` row of the generation that
published it.

Why parts, and why before the publication: one bytea of a 100,000-device compile's 383 MB
pack took 8-14 s to write and 5-7 s to read back (TOAST trying to compress it, the text
protocol doubling it), PostgreSQL keeps no value over 1 GB (a million devices' pack is
about 3.8 GB), and a write that long inside the publication's fenced transaction held every
other durable write back. Parts of `PART_BYTES` go through one binary COPY, in a
transaction of their own before the publication (`stage_pack`, on a connection beside the
writer's: `Database.write_apart`); the publication then only names the staged pack.
MEASURED (383 MB, local PostgreSQL): 1.3-1.7 s to write, 0.7-0.85 s to read back in binary.

A compile's pack can be stored while it is written (`wfm.fleet.trickle`): its parts past
the first under a provisional name as they fill, then the rest and the real name in one
transaction (`stage_pack`'s `trickled`). Every part under a pack's real name is therefore
stored at once; provisional ones nothing names are dropped as unnamed parts are. The named
pack keeps a row saying which provisional name and parts it came from (file `ORIGIN_FILE`):
a replica that read those parts while they were stored (`wfm.fleet.prefetch`) then reads
only the others (`read_packs`' `prefetched`).

Read back, a pack in parts goes into a file (`read_packs`' spool) a few parts at a time,
then mapped into memory: a replica syncing a million devices' compile would otherwise hold
its parts and their join (about 7.6 GB), and libpq the whole result before that.
"""

from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wfm.store.database import Connection

__all__ = ["INDEX_FILE", "ORIGIN_FILE", "PACK_FILE", "PARTED", "PART_BYTES", "PROVISIONAL",
           "PackData", "Prefetched", "ReadPack", "Trickled", "drop_parts", "drop_unnamed_parts",
           "mapped", "name_pack", "newest_provisional", "pack_id", "read_packs",
           "read_provisional", "stage_pack", "store_pack_parts"]

#: A pack's (or an index's) bytes: in memory, or a view of its file mapped into memory
#: (`wfm.fleet.replication.RepoReplica.compiled_pack`: 383 MB at 100,000 devices).
PackData = bytes | memoryview
#: The most bytes of a pack (or its index) one `git_pack_parts` row holds.
PART_BYTES = 8 << 20
#: Parts read per statement when a pack is read back (64 MiB).
PARTS_PER_READ = 8
#: The files of a pack in parts: the pack, its index, and where its parts came from.
PACK_FILE, INDEX_FILE, ORIGIN_FILE = 0, 1, 2
#: How the name of a pack stored while it is written starts.
PROVISIONAL = "provisional-"
#: (generation, pack, index, the spooled pack file or None): one `git_packs` row read back.
ReadPack = tuple[int, PackData, PackData | None, Path | None]
#: What a `git_packs` row holds in place of a pack stored in parts. Not a pack: a replica
#: of a version before the parts, still running while the others are upgraded, fails to
#: index it and keeps serving the generation it has (instead of taking an empty pack for
#: "no objects" and moving its refs to commits it lacks).
PARTED = b"margo: this pack is stored in git_pack_parts (schema 14)\n"
_PART_COLUMNS = ("repo", "pack", "file", "part", "data")
_PART_TYPES = ("text", "text", "int8", "int8", "bytea")


@dataclass(frozen=True, slots=True)
class Trickled:
    """Parts of a pack stored while it was written: its parts 1 to `parts` (never part 0,
    whose object count is set last) under the provisional pack name `name`."""

    name: str
    parts: int


@dataclass(frozen=True, slots=True)
class Prefetched:
    """Parts 1 to `parts` of the provisional pack `name`, read into `path` (each at its
    offset, part number times `PART_BYTES`) while they were stored."""

    name: str
    path: Path
    parts: int


def pack_id(pack: PackData) -> str:
    """A pack's name: the checksum a Git pack ends with (SHA-1 of everything before)."""
    return bytes(pack[-20:]).hex()


def stage_pack(conn: Connection, repo: str, pack: PackData, index: PackData | None, *,
               trickled: Trickled | None = None) -> str:
    """Store `pack` (file 0) and `index` (file 1) in parts, unless a pack of that name is
    stored already (parts are named in one transaction: one part means all); its name.
    `trickled`: the pack's parts stored already under a provisional name, renamed here;
    only the others are written."""
    name = pack_id(pack)
    if conn.execute("SELECT 1 FROM git_pack_parts WHERE repo = ? AND pack = ? AND file = ? "
                    "AND part = 0", (repo, name, PACK_FILE)).fetchone():
        if trickled is not None:
            drop_parts(conn, repo, trickled.name)
        return name
    sent = range(1, trickled.parts + 1) if trickled is not None else range(0)
    store_pack_parts(conn, repo, name, [
        (file, number, view[start:start + PART_BYTES])
        for file, data in ((PACK_FILE, pack), (INDEX_FILE, index)) if data is not None
        for view in (memoryview(data),)
        for number, start in enumerate(range(0, len(data), PART_BYTES))
        if not (file == PACK_FILE and number in sent)])
    if trickled is not None:
        renamed = conn.execute("UPDATE git_pack_parts SET pack = ? WHERE repo = ? AND pack = ?",
                               (name, repo, trickled.name)).rowcount
        if renamed != trickled.parts:  # (dropped meanwhile: a compaction by a new holder)
            raise RuntimeError(f"{renamed} of the {trickled.parts} parts stored ahead of pack "
                               f"{name} are left")
        store_pack_parts(conn, repo, name, [
            (ORIGIN_FILE, 0, f"{trickled.name} {trickled.parts}".encode())])
    return name


def store_pack_parts(conn: Connection, repo: str, name: str,
                     parts: list[tuple[int, int, PackData]]) -> None:
    """Parts (file, part number, bytes) of the pack `name`: through one binary COPY where
    the connection has it (`copy_rows`), else a statement per part."""
    rows = [(repo, name, file, number, data) for file, number, data in parts]
    copy = getattr(conn, "copy_rows", None)
    if copy is not None:
        copy("git_pack_parts", _PART_COLUMNS, rows, types=_PART_TYPES)
        return
    for row in rows:
        conn.execute("INSERT INTO git_pack_parts (" + ", ".join(_PART_COLUMNS) + ") "
                     "VALUES (?, ?, ?, ?, ?)", row)


def drop_parts(conn: Connection, repo: str, name: str) -> None:
    """Delete the parts of the pack `name` (provisional parts not used after all)."""
    conn.execute("DELETE FROM git_pack_parts WHERE repo = ? AND pack = ?", (repo, name))


def newest_provisional(conn: Any, repo: str) -> tuple[str, int] | None:
    """The newest provisional pack (names sort by the time they were made) and its highest
    part stored; None when there is none."""
    row = conn.execute("SELECT pack, MAX(part) FROM git_pack_parts WHERE repo = ? AND "
                       "pack LIKE ? AND file = ? GROUP BY pack ORDER BY pack DESC LIMIT 1",
                       (repo, PROVISIONAL + "%", PACK_FILE)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def read_provisional(conn: Any, repo: str, name: str, first: int, last: int
                     ) -> list[tuple[int, bytes]]:
    """Parts `first` to `last` of a provisional pack that are stored, by number."""
    return [(n, bytes(d)) for n, d in _parts(conn, repo, name, PACK_FILE, first, last + 1)]


def _parts(conn: Any, repo: str, name: str, file: int, first: int, stop: int
           ) -> list[tuple[int, Any]]:
    """(number, bytes) of the stored parts `first` to `stop - 1` of one file of a pack, in
    binary where the connection can (`execute_binary`: as text every byte came as two hex
    digits)."""
    execute = getattr(conn, "execute_binary", conn.execute)
    return [(int(n), d) for n, d in execute(
        "SELECT part, data FROM git_pack_parts WHERE repo = ? AND pack = ? AND file = ? AND "
        "part >= ? AND part < ? ORDER BY part", (repo, name, file, first, stop))]


def name_pack(conn: Connection, repo: str, generation: int, pack: PackData,
              index: PackData | None) -> None:
    """The `git_packs` row of `generation`, naming its pack in parts (staged now if it was
    not before)."""
    name = stage_pack(conn, repo, pack, index)
    conn.execute("INSERT INTO git_packs (repo, generation, pack, idx, parts) "
                 "VALUES (?, ?, ?, ?, ?)", (repo, generation, PARTED, None, name))


def drop_unnamed_parts(conn: Connection, repo: str) -> None:
    """Delete the parts no `git_packs` row names (a compaction's dropped generations, a
    pack staged for a publication that did not happen)."""
    conn.execute("DELETE FROM git_pack_parts WHERE repo = ? AND pack NOT IN (SELECT parts "
                 "FROM git_packs WHERE repo = ? AND parts IS NOT NULL)", (repo, repo))


def read_packs(conn: Any, rows: list[tuple[Any, Any, Any, Any]], repo: str, spool: Path,
               prefetched: Prefetched | None = None) -> list[ReadPack]:
    """Each `git_packs` row (generation, pack, idx, parts) read back: a pack stored whole
    as it is, one in parts written to `spool` (`pack-<name>.pack`, its index beside it as
    `.idx`), mapped, and named as the fourth element (the caller may move the files
    instead of writing the bytes again). A pack whose parts came from the `prefetched`
    ones starts from that file (moved into `spool`); only its other parts are read."""
    spooled: dict[str, tuple[PackData, PackData | None, Path]] = {}
    out: list[ReadPack] = []
    for generation, pack, index, parts in rows:
        if parts is None:
            out.append((int(generation), bytes(pack), None if index is None else bytes(index),
                        None))
            continue
        name = str(parts)
        if name not in spooled:
            spooled[name] = _spool_pack(conn, repo, name, spool, prefetched)
        out.append((int(generation), *spooled[name]))
    return out


def _spool_pack(conn: Any, repo: str, name: str, spool: Path, prefetched: Prefetched | None
                ) -> tuple[PackData, PackData | None, Path]:
    base = spool / f"pack-{name}"
    pack_file, index_file = base.with_suffix(".pack"), base.with_suffix(".idx")
    have = _take_prefetched(conn, repo, name, prefetched, pack_file)
    _spool_file(conn, repo, name, PACK_FILE, pack_file, have=have)
    has_index = _spool_file(conn, repo, name, INDEX_FILE, index_file)
    return mapped(pack_file), mapped(index_file) if has_index else None, pack_file


def _take_prefetched(conn: Any, repo: str, name: str, prefetched: Prefetched | None,
                     target: Path) -> int:
    """How many parts past the first `target` holds already: the prefetched file, moved
    there, when this pack was named from its provisional parts (its `ORIGIN_FILE` row)."""
    if prefetched is None:
        return 0
    row = conn.execute("SELECT data FROM git_pack_parts WHERE repo = ? AND pack = ? AND "
                       "file = ? AND part = 0", (repo, name, ORIGIN_FILE)).fetchone()
    origin = bytes(row[0]).decode(errors="replace").split() if row is not None else []
    if len(origin) != 2 or origin[0] != prefetched.name or not origin[1].isdigit():
        return 0
    try:
        os.replace(prefetched.path, target)
    except OSError:
        return 0
    return min(prefetched.parts, int(origin[1]))


def _spool_file(conn: Any, repo: str, name: str, file: int, target: Path, *,
                have: int = 0) -> bool:
    """The parts of one file into `target`, `PARTS_PER_READ` per statement (`_parts`);
    whether there was any part. With `have`, parts 1 to `have` are in `target` already
    (prefetched): the first part is written before them, the rest after. Flushed to disk:
    a replica installs the file as it is."""
    found = have > 0
    with target.open("r+b" if have else "wb") as out:
        if have:
            for _, data in _parts(conn, repo, name, file, 0, 1):
                out.write(data)
            out.seek((have + 1) * PART_BYTES)
        for first in itertools.count(have + 1 if have else 0, PARTS_PER_READ):
            chunk = _parts(conn, repo, name, file, first, first + PARTS_PER_READ)
            for _, data in chunk:
                out.write(data)
            found = found or bool(chunk)
            if len(chunk) < PARTS_PER_READ:
                break
        out.truncate()
        out.flush()
        os.fsync(out.fileno())
    return found


def mapped(path: Path) -> PackData:
    """A file's bytes, mapped read-only into memory (b"" when it is empty): a pack goes to
    the database, or into a repository, without being read into this process first (0.24 s
    and 383 MB at 100,000 devices, about 3.8 GB at a million). Packs are never rewritten
    in place; one deleted meanwhile stays readable through the mapping."""
    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
