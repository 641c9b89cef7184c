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
"""

from __future__ import annotations

from typing import Any

from wfm.store.database import Connection

__all__ = ["PARTED", "PART_BYTES", "PackData", "drop_unnamed_parts", "name_pack", "pack_id",
           "read_packs", "stage_pack"]

#: A pack's (or an index's) bytes: in memory, or a view of its file mapped into memory
#: (`wfm.fleet.replication.RepoReplica.compiled_pack`: 383 MB at 100,000 devices).
PackData = bytes | memoryview
#: The most bytes of a pack (or its index) one `git_pack_parts` row holds.
PART_BYTES = 8 << 20
_PACK_FILE, _INDEX_FILE = 0, 1
#: What a `git_packs` row holds in place of a pack stored in parts. Not a pack: a replica
#: of a version before the parts, still running while the others are upgraded, fails to
#: index it and keeps serving the generation it has (instead of taking an empty pack for
#: "no objects" and moving its refs to commits it lacks).
PARTED = b"margo: this pack is stored in git_pack_parts (schema 14)\n"
_PART_COLUMNS = ("repo", "pack", "file", "part", "data")


def pack_id(pack: PackData) -> str:
    """A pack's name: the checksum a Git pack ends with (SHA-1 of everything before)."""
    return bytes(pack[-20:]).hex()


def stage_pack(conn: Connection, repo: str, pack: PackData, index: PackData | None) -> str:
    """Store `pack` (file 0) and `index` (file 1) in parts, unless a pack of that name is
    stored already (parts are written in one transaction: one part means all); its name.
    Through one binary COPY where the connection has it (`copy_rows`), else a statement
    per part."""
    name = pack_id(pack)
    if conn.execute("SELECT 1 FROM git_pack_parts WHERE repo = ? AND pack = ? AND file = ? "
                    "AND part = 0", (repo, name, _PACK_FILE)).fetchone():
        return name
    rows = [(repo, name, file, number, view[start:start + PART_BYTES])
            for file, data in ((_PACK_FILE, pack), (_INDEX_FILE, index)) if data is not None
            for view in (memoryview(data),)
            for number, start in enumerate(range(0, len(data), PART_BYTES))]
    copy = getattr(conn, "copy_rows", None)
    if copy is not None:
        copy("git_pack_parts", _PART_COLUMNS, rows,
             types=("text", "text", "int8", "int8", "bytea"))
        return name
    for row in rows:
        conn.execute("INSERT INTO git_pack_parts (" + ", ".join(_PART_COLUMNS) + ") "
                     "VALUES (?, ?, ?, ?, ?)", row)
    return name


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


def read_packs(conn: Any, rows: list[tuple[Any, Any, Any, Any]], repo: str
               ) -> list[tuple[int, bytes, bytes | None]]:
    """(generation, pack, index) of each `git_packs` row (generation, pack, idx, parts),
    a pack in parts joined from them. Read in binary where the connection can
    (`execute_binary`): as text every byte came as two hex digits."""
    names = sorted({str(parts) for _, _, _, parts in rows if parts is not None})
    files: dict[tuple[str, int], list[bytes]] = {}
    if names:
        execute = getattr(conn, "execute_binary", conn.execute)
        for name, file, data in execute(
                "SELECT pack, file, data FROM git_pack_parts WHERE repo = ? AND pack IN ("
                + ", ".join("?" for _ in names) + ") ORDER BY pack, file, part",
                (repo, *names)):
            files.setdefault((str(name), int(file)), []).append(bytes(data))
    out = []
    for generation, pack, index, parts in rows:
        if parts is None:
            out.append((int(generation), bytes(pack), None if index is None else bytes(index)))
            continue
        idx = files.get((str(parts), _INDEX_FILE))
        out.append((int(generation), b"".join(files.get((str(parts), _PACK_FILE), ())),
                    None if idx is None else b"".join(idx)))
    return out
