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
stored at once; provisional ones nothing names are dropped as unnamed parts are.

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

__all__ = ["INDEX_FILE", "PACK_FILE", "PARTED", "PART_BYTES", "PackData", "ReadPack",
           "Trickled", "drop_parts", "drop_unnamed_parts", "mapped", "name_pack", "pack_id",
           "read_packs", "stage_pack", "store_pack_parts"]

#: A pack's (or an index's) bytes: in memory, or a view of its file mapped into memory
#: (`wfm.fleet.replication.RepoReplica.compiled_pack`: 383 MB at 100,000 devices).
PackData = bytes | memoryview
#: The most bytes of a pack (or its index) one `git_pack_parts` row holds.
PART_BYTES = 8 << 20
#: Parts read per statement when a pack is read back (64 MiB).
PARTS_PER_READ = 8
PACK_FILE, INDEX_FILE = 0, 1
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


def read_packs(conn: Any, rows: list[tuple[Any, Any, Any, Any]], repo: str, spool: Path
               ) -> list[ReadPack]:
    """Each `git_packs` row (generation, pack, idx, parts) read back: a pack stored whole
    as it is, one in parts written to `spool` (`pack-<name>.pack`, its index beside it as
    `.idx`), mapped, and named as the fourth element (the caller may move the files
    instead of writing the bytes again)."""
    spooled: dict[str, tuple[PackData, PackData | None, Path]] = {}
    out: list[ReadPack] = []
    for generation, pack, index, parts in rows:
        if parts is None:
            out.append((int(generation), bytes(pack), None if index is None else bytes(index),
                        None))
            continue
        name = str(parts)
        if name not in spooled:
            spooled[name] = _spool_pack(conn, repo, name, spool)
        out.append((int(generation), *spooled[name]))
    return out


def _spool_pack(conn: Any, repo: str, name: str, spool: Path
                ) -> tuple[PackData, PackData | None, Path]:
    base = spool / f"pack-{name}"
    pack_file, index_file = base.with_suffix(".pack"), base.with_suffix(".idx")
    _spool_file(conn, repo, name, PACK_FILE, pack_file)
    has_index = _spool_file(conn, repo, name, INDEX_FILE, index_file)
    return mapped(pack_file), mapped(index_file) if has_index else None, pack_file


def _spool_file(conn: Any, repo: str, name: str, file: int, target: Path) -> bool:
    """The parts of one file into `target`, `PARTS_PER_READ` per statement, in binary where
    the connection can (`execute_binary`: as text every byte came as two hex digits); whether
    there was any part. Flushed to disk: a replica installs the file as it is."""
    execute = getattr(conn, "execute_binary", conn.execute)
    found = False
    with target.open("wb") as out:
        for first in itertools.count(0, PARTS_PER_READ):
            chunk = execute("SELECT data FROM git_pack_parts WHERE repo = ? AND pack = ? AND "
                            "file = ? AND part >= ? AND part < ? ORDER BY part",
                            (repo, name, file, first, first + PARTS_PER_READ)).fetchall()
            for (data,) in chunk:
                out.write(data)
            found = found or bool(chunk)
            if len(chunk) < PARTS_PER_READ:
                break
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
