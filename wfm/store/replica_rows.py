"""The rows replicas share a repository through: Git packs and refs per generation, each
repository's generation counter, compile requests, and the compile lease (its epoch, and
the PostgreSQL advisory locks the lease and the source's turns are held with).

`wfm.fleet.replication` makes the packs and applies them to a local repository, and
`wfm.fleet.coordination` fences each publication; the SQL that stores and reads the rows is
here. Functions run inside the database's reader or writer threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wfm.store import pack_rows, ref_lists
from wfm.store.database import Connection
from wfm.store.fleet_rows import value_rows

__all__ = ["COUNTERS", "LISTED", "NEWS_CHANNEL", "PublishedPack", "Snapshot", "announce",
           "compile_state", "deleted_at", "lease_alive", "listen", "lock_counter",
           "lock_device_generation", "publish_rows", "published_generation", "published_ref",
           "read_snapshot", "request_compile", "set_counter", "take_lease",
           "try_advisory_lock", "wait_advisory_lock"]


@dataclass(frozen=True, slots=True)
class PublishedPack:
    """One generation's pack, and its index when the publisher stored it (None: index it);
    `path`: the file the pack was read into (`pack_rows.read_packs`), its index beside it."""

    generation: int
    pack: pack_rows.PackData
    index: pack_rows.PackData | None = None
    path: Path | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the database holds for one repository up to one generation."""

    generation: int
    packs: list[PublishedPack]  # newer than the replica's (but those it said it has)
    refs: dict[str, str | None]  # name -> target (None: deleted) that moved since then
    #: The whole `packed-refs` file of a published list (`wfm.store.ref_lists`) newer than
    #: the replica's generation, which `refs` moved on from (None: `refs` moved from the
    #: replica's own refs).
    whole: bytes | None = None


#: Refs written per statement by a publication: a full compile moves every device's branch,
#: and a statement per ref was a round trip to PostgreSQL each (10,000 refs: 1.5-2 s of the
#: publication, every replica's new state waiting behind it).
_REFS_PER_STATEMENT = 500
_REF_COLUMNS = ("repo", "name", "target", "generation")
_REFS_UPSERT = (" ON CONFLICT (repo, name) DO UPDATE SET target = excluded.target, "
                "generation = excluded.generation")
#: The `fleet_state` column counting each repository's generations.
COUNTERS = {"devices": "generation", "source": "source_generation"}
#: The `git_refs` row each publication of a whole list (`wfm.store.ref_lists`) writes, at
#: its generation: a replica of a version before the lists, still running while the others
#: are upgraded, takes it for a ref to move, refuses its target (not an object id) and keeps
#: serving the generation it has, instead of moving to a generation whose refs it lacks.
#: Newer replicas never read it: the list stands for every row of its generation.
LISTED = ("refs/margo/listed", "margo: these refs are listed in git_ref_lists (schema 15)")
#: The PostgreSQL channel replicas are told on that a generation was published or a compile
#: requested (`wfm.fleet.news`).
NEWS_CHANNEL = "margo_fleet_news"


def read_snapshot(conn: Any, repo: str, since: int, *, dialect: str, spool: Path,
                  have: frozenset[int] = frozenset(),
                  prefetched: pack_rows.Prefetched | None = None) -> Snapshot:
    """Everything of `repo` newer than generation `since`, from one consistent snapshot
    (the refs of a generation are rewritten by later ones, so the reads must not straddle a
    publication), but the packs of the generations in `have` (objects the replica has from
    elsewhere: 383 MB for a full compile of 100,000 devices). Starts over from the newest
    compacted pack when `since` is older. Packs stored in parts are read into files in
    `spool` (`RepoReplica.spooling`), which must outlive the snapshot's use; one whose parts
    were read while they were stored starts from the `prefetched` file."""
    if dialect == "postgresql":
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    else:
        conn.execute("BEGIN")
    try:
        generation = int(conn.execute(
            f"SELECT {COUNTERS[repo]} FROM fleet_state WHERE id = 1").fetchone()[0])
        oldest = conn.execute("SELECT MIN(generation) FROM git_packs WHERE repo = ?",
                              (repo,)).fetchone()[0]
        if oldest is not None and since < int(oldest) - 1:
            since = -1  # what we have predates the oldest pack kept: start from it
        wanted = [g for g, in conn.execute(
            "SELECT generation FROM git_packs WHERE repo = ? AND generation > ? AND "
            "generation <= ? ORDER BY generation", (repo, since, generation))
            if int(g) not in have]
        packs = _read_packs(conn, repo, wanted, spool, prefetched) if wanted else []
        listed = ref_lists.newest_list(conn, repo, generation)
        whole = None
        if listed is not None and listed[0] > since:
            whole, since = ref_lists.read_list(conn, repo, listed[1]), listed[0]
        # (text columns: names and targets come as they are, a million in one C call)
        refs: dict[str, str | None] = dict(conn.execute(
            "SELECT name, target FROM git_refs WHERE repo = ? AND generation > ? AND "
            "generation <= ?", (repo, since, generation)).fetchall())
    finally:
        conn.execute("COMMIT")
    return Snapshot(generation, packs, refs, whole)


def _read_packs(conn: Any, repo: str, generations: list[int], spool: Path,
                prefetched: pack_rows.Prefetched | None) -> list[PublishedPack]:
    """The packs of `generations` (`wfm.store.pack_rows`), those in parts read into
    `spool`."""
    rows = conn.execute("SELECT generation, pack, idx, parts FROM git_packs WHERE repo = ? "
                        "AND generation IN (" + ", ".join("?" for _ in generations) + ") "
                        "ORDER BY generation", (repo, *generations)).fetchall()
    return [PublishedPack(*read)
            for read in pack_rows.read_packs(conn, rows, repo, spool, prefetched)]


def publish_rows(conn: Connection, repo: str, generation: int, pack: pack_rows.PackData,
                 refs: Mapping[str, str | None], *, compact: bool,
                 index: pack_rows.PackData | None = None, discarded: bool = False,
                 listed: str | None = None) -> None:
    """The rows of one publication (the caller's transaction holds the fence): the pack
    and its index (in parts, `wfm.store.pack_rows`, staged before or now), the refs that
    moved. A compaction, and a publication that drops what was staged for it
    (`discarded`: packed again without a deleted device), delete the parts and lists no
    generation names. `listed`: the staged list (`wfm.store.ref_lists`) of every ref after
    it, which stands for the moved ones (only the deleted ones are written, for
    `deleted_at`)."""
    if pack:
        pack_rows.name_pack(conn, repo, generation, pack, index)
    if compact:
        conn.execute("DELETE FROM git_packs WHERE repo = ? AND generation < ?",
                     (repo, generation))
    if compact or discarded:
        pack_rows.drop_unnamed_parts(conn, repo)
    if listed is not None:
        ref_lists.name_list(conn, repo, listed, generation)
        refs = {**{n: t for n, t in refs.items() if t is None}, LISTED[0]: LISTED[1]}
    elif compact or discarded:
        ref_lists.drop_unnamed_lists(conn, repo)
    rows = [(repo, name, target, generation) for name, target in sorted(refs.items())]
    copy = getattr(conn, "copy_rows", None)
    if copy is not None and len(rows) > _REFS_PER_STATEMENT:
        _copy_refs(conn, copy, rows)
        return
    for values, parameters in value_rows(rows, _REFS_PER_STATEMENT):
        conn.execute("INSERT INTO git_refs (repo, name, target, generation) VALUES "
                     + values + _REFS_UPSERT, parameters)


def _copy_refs(conn: Connection, copy: Any, rows: list[tuple[str, str, str | None, int]]
               ) -> None:
    """PostgreSQL: the refs through a binary `COPY` into a session's scratch table, then
    one upsert from it. MEASURED (a full compile's 100,000 refs): 1.8-2.4 s as statements
    of 500 refs, every replica's new state waiting behind them."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS git_refs_in (LIKE git_refs) "
                 "ON COMMIT DELETE ROWS")
    conn.execute("DELETE FROM git_refs_in")  # (a write earlier in the same transaction)
    copy("git_refs_in", _REF_COLUMNS, rows, types=("text", "text", "text", "int8"))
    conn.execute(f"INSERT INTO git_refs ({', '.join(_REF_COLUMNS)}) SELECT "
                 f"{', '.join(_REF_COLUMNS)} FROM git_refs_in" + _REFS_UPSERT)


def lock_device_generation(conn: Connection) -> int:
    """The devices' repository's published generation, its row locked for this transaction
    (a deletion's publication takes the next one)."""
    row = conn.execute("SELECT generation FROM fleet_state WHERE id = 1 FOR UPDATE").fetchone()
    return int(row[0])


def lock_counter(conn: Connection, repo: str) -> tuple[int, int]:
    """(generation of `repo`, lease epoch), the row locked for this transaction: the fence
    of one publication."""
    row = conn.execute(f"SELECT {COUNTERS[repo]}, lease_epoch FROM fleet_state WHERE id = 1 "
                       "FOR UPDATE").fetchone()
    return int(row[0]), int(row[1])


def set_counter(conn: Connection, repo: str, generation: int) -> None:
    conn.execute(f"UPDATE fleet_state SET {COUNTERS[repo]} = ? WHERE id = 1", (generation,))


def published_generation(conn: Connection, repo: str) -> int:
    return int(conn.execute(f"SELECT {COUNTERS[repo]} FROM fleet_state WHERE id = 1")
               .fetchone()[0])


def deleted_at(conn: Connection, repo: str, name: str) -> int | None:
    """The generation that published the ref `name` as deleted (None: it was not, or a
    newer list, `wfm.store.ref_lists`, lists it again)."""
    if conn.execute("SELECT 1 FROM git_refs WHERE repo = ? AND name = ? AND target IS NULL",
                    (repo, name)).fetchone() is None:
        return None  # (every registration asks: no list is read for an id never deleted)
    found = published_ref(conn, repo, name)
    return found[1] if found is not None and found[0] is None else None


def published_ref(conn: Connection, repo: str, name: str) -> tuple[str | None, int] | None:
    """(target, generation) of a published ref (target None: published as deleted): its
    row, unless the newest published list (`wfm.store.ref_lists`) is newer, which then
    says (a ref it does not list is published as deleted only if its row says so)."""
    row = conn.execute("SELECT target, generation FROM git_refs WHERE repo = ? AND name = ?",
                       (repo, name)).fetchone()
    found = None if row is None else (None if row[0] is None else str(row[0]), int(row[1]))
    listed = ref_lists.newest_list(conn, repo)
    if listed is None or (found is not None and found[1] > listed[0]):
        return found
    target = ref_lists.find_ref(conn, repo, listed[1], name)
    if target is not None:
        return target, listed[0]
    return found if found is not None and found[0] is None else None


def compile_state(conn: Connection) -> tuple[int, int, int]:
    """(published generation, compile requests counted so far, and of those the ones for a
    compile at once)."""
    row = conn.execute("SELECT generation, compile_requests, urgent_requests FROM fleet_state "
                       "WHERE id = 1").fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def request_compile(conn: Connection, *, at_once: bool = False) -> None:
    """Count a compile request (`at_once`: for a compile without the debounce, counted
    apart too)."""
    urgent = ", urgent_requests = urgent_requests + 1" if at_once else ""
    conn.execute(f"UPDATE fleet_state SET compile_requests = compile_requests + 1{urgent} "
                 "WHERE id = 1")


def lease_alive(conn: Connection) -> None:
    """A round trip on the lease's own session: raises when the session is gone."""
    conn.execute("SELECT 1").fetchone()


def try_advisory_lock(conn: Connection, key: int) -> bool:
    """PostgreSQL's session advisory lock `key`, if free (never waits)."""
    return bool(conn.execute("SELECT pg_try_advisory_lock(?)", (key,)).fetchone()[0])


def take_lease(conn: Connection, holder: str, since: float) -> int:
    """Record the new lease holder; the lease's new epoch (what fences publications)."""
    return int(conn.execute(
        "UPDATE fleet_state SET lease_epoch = lease_epoch + 1, lease_holder = ?, "
        "lease_since = ? WHERE id = 1 RETURNING lease_epoch", (holder, since)).fetchone()[0])


def wait_advisory_lock(conn: Connection, key: int, *, timeout_ms: int) -> None:
    """PostgreSQL's session advisory lock `key`, waiting at most `timeout_ms`."""
    conn.execute(f"SET statement_timeout = {timeout_ms}")
    conn.execute("SELECT pg_advisory_lock(?)", (key,))


def announce(conn: Connection, what: str) -> None:
    """Tell every replica's `listen`ing session `what` happened (PostgreSQL NOTIFY: sent
    when the caller's transaction commits, not at all if it rolls back)."""
    conn.execute("SELECT pg_notify(?, ?)", (NEWS_CHANNEL, what))


def listen(conn: Connection) -> None:
    """This session hears every `announce` from now on (PostgreSQL LISTEN)."""
    conn.execute(f"LISTEN {NEWS_CHANNEL}")
