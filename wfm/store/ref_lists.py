"""The rows a published ref list is kept in: the whole `packed-refs` file of a repository's
published refs, for a publication that moved most of them (`git_ref_lists`).

Why: a full compile moves every device's branch, and a million `git_refs` rows (an upsert
through two indexes) took 3.4-6.8 s inside the publication's fenced transaction, every
replica's new state waiting behind it, and as long again for each replica to read them
back and write its `packed-refs` from them. The file is stored instead, in chunks of whole
lines (`CHUNK_BYTES`), before the publication (`stage_list`, generation NULL, on a
connection beside the writer's), which then only names it (`name_list`): a replica installs
the file as it is (`compiler.packedrefs.install_refs`). A list stands for every ref of its
generation: refs published later are `git_refs` rows of a newer generation, on top of it
(`wfm.store.replica_rows.read_snapshot`), and a row of its generation or older says
nothing of a ref it lists (`replica_rows.published_ref`). Only the newest named list is
kept.

Each chunk records the first ref name it holds (as bytes: compared in Git's byte order by
both databases, whatever PostgreSQL's collation), so one ref is found by reading the one
chunk that would hold it (`find_ref`: 64 KiB, through an index), not the list: a server
asks for each device that has no branch where it is (`wfm.fleet.desired`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from wfm.store.database import Connection

__all__ = ["CHUNK_BYTES", "LIST_FROM", "drop_unnamed_lists", "find_ref", "name_list",
           "newest_list", "read_list", "stage_list", "worth_listing"]

#: The most bytes of a list one row holds, past the line that crosses it (a million refs:
#: about 1,200 rows).
CHUNK_BYTES = 64 << 10
#: Refs written from which a publication stores its whole list instead of rows, if they
#: are also most of the repository's: 50,000 rows took about 0.2 s.
LIST_FROM = 50_000
_COLUMNS = ("repo", "list", "chunk", "first", "data")
_TYPES = ("text", "text", "int8", "bytea", "bytea")


def worth_listing(written: int, total: int, *, start: int | None = None) -> bool:
    """Whether a publication writing `written` refs of a repository that then has `total`
    stores its whole list instead (`start`: `LIST_FROM` unless given)."""
    return written >= (LIST_FROM if start is None else start) and 2 * written > total


def stage_list(conn: Connection, repo: str, data: bytes) -> str:
    """Store the whole `packed-refs` file `data` in chunks, unnamed, unless it is stored
    already; its name (the SHA-1 of the file)."""
    name = hashlib.sha1(data).hexdigest()
    if conn.execute("SELECT 1 FROM git_ref_lists WHERE repo = ? AND list = ? AND chunk = 0",
                    (repo, name)).fetchone():
        return name
    rows = [(repo, name, number, first, chunk)
            for number, (first, chunk) in enumerate(_chunks(data))]
    copy = getattr(conn, "copy_rows", None)
    if copy is not None:
        copy("git_ref_lists", _COLUMNS, rows, types=_TYPES)
    else:
        for row in rows:
            conn.execute("INSERT INTO git_ref_lists (" + ", ".join(_COLUMNS) + ") VALUES "
                         "(?, ?, ?, ?, ?)", row)
    return name


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """`data` cut after the line break that ends each `CHUNK_BYTES`, each chunk with the
    name on its first ref line (the header's chunk: its first after the header)."""
    chunks, start = [], 0
    while start < len(data):
        end = data.find(b"\n", min(start + CHUNK_BYTES, len(data)) - 1) + 1 or len(data)
        chunk = data[start:end]
        line = chunk if start else chunk.partition(b"\n")[2]
        chunks.append((line[41:line.find(b"\n")], chunk))
        start = end
    return chunks


def name_list(conn: Connection, repo: str, name: str, generation: int) -> None:
    """The staged list `name` is `repo`'s refs at `generation` (the publication's
    transaction); every other list of `repo` goes. RuntimeError when it is not staged."""
    if conn.execute("UPDATE git_ref_lists SET generation = ? WHERE repo = ? AND list = ?",
                    (generation, repo, name)).rowcount < 1:
        raise RuntimeError(f"the ref list {name} staged for generation {generation} is gone")
    conn.execute("DELETE FROM git_ref_lists WHERE repo = ? AND list <> ?", (repo, name))


def drop_unnamed_lists(conn: Connection, repo: str) -> None:
    """Delete the lists no publication named (staged for one that did not happen)."""
    conn.execute("DELETE FROM git_ref_lists WHERE repo = ? AND generation IS NULL", (repo,))


def newest_list(conn: Any, repo: str, upto: int | None = None) -> tuple[int, str] | None:
    """(generation, name) of `repo`'s newest named list (of `upto` or older); None: none."""
    row = conn.execute(
        "SELECT generation, list FROM git_ref_lists WHERE repo = ? AND chunk = 0 AND "
        "generation IS NOT NULL AND generation <= ? ORDER BY generation DESC LIMIT 1",
        (repo, (1 << 62) if upto is None else upto)).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


def read_list(conn: Any, repo: str, name: str) -> bytes:
    """The whole file of list `name`, in binary where the connection can."""
    execute = getattr(conn, "execute_binary", conn.execute)
    return b"".join(bytes(d) for d, in execute(
        "SELECT data FROM git_ref_lists WHERE repo = ? AND list = ? ORDER BY chunk",
        (repo, name)))


def find_ref(conn: Any, repo: str, name: str, ref: str) -> str | None:
    """The object id list `name` gives `ref` (None: it lists no such ref), from the one
    chunk that would hold it: the last whose first name is not after it."""
    wanted = ref.encode()
    execute = getattr(conn, "execute_binary", conn.execute)
    row = execute("SELECT data FROM git_ref_lists WHERE repo = ? AND list = ? AND first <= ? "
                  "ORDER BY first DESC LIMIT 1", (repo, name, wanted)).fetchone()
    if row is None:
        return None
    chunk = b"\n" + bytes(row[0])
    found = chunk.find(b" " + wanted + b"\n")  # (names hold no space: only a line's own)
    if found < 41 or chunk[found - 41:found - 40] != b"\n":
        return None
    return chunk[found - 40:found].decode()
