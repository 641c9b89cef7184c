"""Fleet server replicas on one PostgreSQL database: who compiles, and what each serves.

Every replica answers every device request; exactly one compiles at a time (docs/
operations.md has the whole design):

* **The compile lease** is a PostgreSQL session advisory lock, held on a connection of its
  own. A replica that gets it bumps `fleet_state.lease_epoch` and compiles; when its process
  dies (even by SIGKILL) or loses the database, PostgreSQL ends the session and releases the
  lock, and another replica takes it within a poll interval. Publishing is fenced by the
  epoch, so a holder that lost the lease without noticing cannot publish over its successor.
* **Compile requests** from any replica (a capability change, a source push) increment
  `fleet_state.compile_requests`; the holder compiles when the count moves.
* **Generations**: the holder compiles into a work repository of its own, then publishes the
  new Git objects and refs under the next generation (`wfm.fleet.replication`). Every replica,
  the holder too, syncs the repository it serves to the newest generation, under a lock that
  the manifest handler also takes, so what it computes a client's state from and the
  generation it says it served always agree.
* **News**: a publication and a compile request are announced on a PostgreSQL channel in
  their own transaction; each replica's loop listens (`wfm.fleet.news`) and acts as soon as
  they commit, instead of at its next look at the database (which stays, every `poll`
  seconds). After a sync, `on_synced` is told which devices' branches moved (the server
  wakes their waiting polls: `wfm.fleet.waiters`).

The compiler's own state (`compiler.state`) is a cache per replica: valid only while this
replica was the last to publish (a sidecar records the generation it compiled and the lease
epoch it held), else dropped, which costs one full compile that commits nothing.

**Deleting a device** (`publish_deletion`) is a publication of its own: the replica that
answers the DELETE writes the branch's ref as deleted (a `git_refs` row without a target)
under the next generation, in the same transaction as the device's rows, so every replica
removes the branch when it syncs, a repair or a replica built from scratch never brings it
back, and the compiling replica drops the branch and what its state remembers of the device
before it compiles again (`prepare`), or before it publishes a compile that raced the
deletion (`publish`), so a re-registered id starts from an empty history everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from compiler.gitformat import device_ids_from_refs
from compiler.gitstore import REPOSITORY_NAME, device_id_from_ref, device_ref
from compiler.report import CompileReport
from compiler.state import CompilerState
from wfm.fleet.deletions import REPO, deletion_generation, publish_deletion
from wfm.fleet.news import News
from wfm.fleet.prefetch import Prefetch
from wfm.fleet.replication import COMPACT_AFTER, Published, RepoReplica, ref_moves
from wfm.fleet.sourceturns import SourceUpdate
from wfm.fleet.staging import Background
from wfm.fleet.statemark import STATE_FILE, state_mark, write_state_mark
from wfm.fleet.trickle import PackTrickle
from wfm.store import pack_rows, records, ref_lists, replica_rows
from wfm.store.database import DatabaseUnavailable
from wfm.store.pack_rows import PackData
from wfm.store.pgdb import PgConnection, PostgresDatabase
from wfm.telemetry.metrics import GIT_SECONDS

__all__ = ["Coordinator", "LeaseLost", "SourceUpdate"]

log = logging.getLogger("margo.wfm.replicas")

#: The advisory lock key of the compile lease ("compile" in ASCII, as a bigint).
LEASE_KEY = 0x636F6D70696C65
#: Seconds between two repairs of the served repository (`request_repair`).
REPAIR_EVERY = 5.0
#: How often a compile's publication starts over after devices were deleted meanwhile.
_PUBLISH_ATTEMPTS = 5
_ERRORS = (DatabaseUnavailable, OSError, RuntimeError)
#: How long after the coordination loop last read the database a replica still counts as
#: reaching it (`database_reached`): eight looks at the default `poll`.
REACHED_FOR = 2.0


class _Moves(NamedTuple):
    """A publication's refs before and after, and what moved between them (None: deleted)."""

    before: dict[str, str]
    after: dict[str, str]
    moved: dict[str, str | None]


class LeaseLost(RuntimeError):
    """Another replica took the compile lease: this one's compile is not published."""


class _DeletedMeanwhile(RuntimeError):
    """Devices were deleted (`publish_deletion`) after the compile's `prepare`: the work
    repository must drop their branches before anything of this compile is published."""


class CompileDue(Protocol):
    """What the holder calls to compile (`wfm.fleet.compiles.CompileService.compile_soon`)."""

    def __call__(self, *, settle: bool = True) -> None: ...


class Coordinator:
    def __init__(self, db: PostgresDatabase, data: Path, *, poll: float = 0.25,
                 name: str | None = None, source_repo: Path | None = None) -> None:
        """`source_repo`: the hosted or mirrored fleet source, replicated too (a source
        directory given with --source is each replica's own)."""
        self.db, self.poll = db, poll
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.serving = RepoReplica(REPO, Path(data) / "repos" / REPOSITORY_NAME)
        self.compile_dir = Path(data) / "compile"
        self.working = RepoReplica(REPO, self.compile_dir / REPOSITORY_NAME)
        self.source = None if source_repo is None else RepoReplica("source", source_repo)
        #: The compiling replica's pack, read while it is stored (when not holding).
        self._prefetch = Prefetch(db, REPO, self.serving.path)
        self._source_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        #: The generation this replica is publishing a compile under whose objects its
        #: served copy linked in (`_publish`; None: none), which syncs do not read (`_sync`).
        self._linking: int | None = None
        self._repair = threading.Event()
        self._repaired = -REPAIR_EVERY
        #: Held while the served repository moves (and by readers that must not see it move).
        self.lock = threading.RLock()
        #: Told, as each sync moves the served repository (under `lock`: it must not block),
        #: which devices' branches moved (after a repair: all of them, or those that
        #: differed from a published list, `wfm.store.ref_lists`).
        self.on_synced: Callable[[frozenset[str]], None] = lambda devices: None
        #: Told of compile requests to answer (`settle=False`: one asked for a compile at
        #: once, `request_compile`).
        self.on_compile_due: CompileDue = lambda *, settle=True: None
        self._lease: PgConnection | None = None
        #: The lease is not taken again before this (monotonic clock): after a compile that
        #: failed here, another replica gets its turn (`give_up_lease`).
        self._lease_cooldown = 0.0
        self.epoch: int | None = None
        #: The compile requests counted at the last look (None: the lease was just taken)
        #: and, of all requests, those for a compile at once (read at every look, holding
        #: the lease or not: one answered by another holder is not answered again here).
        self._requests_seen: int | None = None
        self._urgent_seen: int | None = None
        self._before: dict[str, str] = {}
        #: The work repository's packs before the compile (`RepoReplica.compiled_pack`);
        #: None: publish with `git pack-objects`.
        self._packs_before: frozenset[str] | None = None
        #: The compile's publication, started as its branches moved (`stage`): what it
        #: published and the work repository's refs then.
        self._early: Background[tuple[Published | None, dict[str, str]]] | None = None
        #: The compile's pack, stored while it is written (`prepare` to `stage`).
        self._trickle: PackTrickle | None = None
        self._stopping = threading.Event()
        self._news = News(db)
        #: When the loop last read the database (monotonic clock; -inf after a failed look).
        self._reached = float("-inf")
        self._thread = threading.Thread(target=self._loop, name="margo-replica", daemon=True)

    def start(self) -> None:
        with contextlib.suppress(*_ERRORS):
            self.sync()  # serve what is published before answering anyone
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)
        self._news.close()
        self._end_trickle()
        self._release()

    @property
    def holding(self) -> bool:
        return self._lease is not None

    @property
    def database_reached(self) -> bool:
        """Whether the coordination loop read the database within `REACHED_FOR` seconds and
        has not failed to since. A replica that does not reach it must not tell a device
        "unchanged" from memory: it hears no news (another replica may have published), and
        it must answer 503 so that the device turns to another replica. While it does, a
        manifest poll needs no read of its own (`wfm.http.manifests`)."""
        return time.monotonic() - self._reached < REACHED_FOR

    @property
    def generation(self) -> int:
        """The generation this replica serves."""
        return max(self.serving.generation, 0)

    # --- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._news.wait(self.poll, self._stopping)  # news, or the periodic look
            if self._stopping.is_set():
                return
            try:
                self._tick()
            except _ERRORS as exc:
                self._reached = float("-inf")
                log.warning("replica coordination: %s", exc)
            except Exception:  # anything else: say so in full, and keep coordinating
                self._reached = float("-inf")
                log.exception("replica coordination failed; trying again")

    def _tick(self) -> None:
        """One look at the database: the lease, a newer generation to serve, compile
        requests to answer: at once when the urgent ones moved since the last look (a
        request for a compile at once, whether its news woke this look or was lost), else
        after the debounce."""
        self._repair_if_asked()
        self._keep_lease()
        generation, requests, urgent = self.db.read(replica_rows.compile_state)
        self._reached = time.monotonic()
        if generation > self.serving.generation:
            self.sync()
        if not self.holding:
            self._prefetch.look()
        else:
            self._prefetch.clear()
        at_once = self._urgent_seen not in (None, urgent)
        self._urgent_seen = urgent
        if self.holding and requests != self._requests_seen:
            self._requests_seen = requests
            self.on_compile_due(settle=not at_once)

    def request_compile(self, *, settle: bool = True) -> None:
        """Ask the holder (whichever replica it is) to compile, after its debounce or
        (`settle=False`: a single event, `wfm.fleet.compiles`) at once; does not wait."""
        self.db.submit(_request_compile if settle else _request_compile_now)

    # --- the lease ---------------------------------------------------------------------

    def _keep_lease(self) -> None:
        if self._lease is not None:
            try:
                replica_rows.lease_alive(self._lease)
                return
            except Exception as exc:
                log.warning("%s lost the compile lease: %s", self.name, exc)
                self._release()
        if time.monotonic() < self._lease_cooldown:
            return
        conn = self.db.connect()
        try:
            if not replica_rows.try_advisory_lock(conn, LEASE_KEY):
                conn.close()
                return
            self.epoch = replica_rows.take_lease(conn, self.name, time.time())
        except BaseException:
            conn.close()
            raise
        self._lease = conn
        self._requests_seen = None  # compile once now: requests may have gone unanswered
        log.info("%s holds the compile lease (epoch %d)", self.name, self.epoch)
        self.on_compile_due()

    def give_up_lease(self, *, cooldown: float) -> None:
        """After a compile that failed here: release the compile lease and leave it to the
        other replicas for `cooldown` seconds, asking the next holder to compile. A broken
        replica (a damaged disk, a lock it cannot take) must not hold the lease and stop
        the fleet; when every replica fails, they take turns."""
        if self._lease is None:
            return
        log.warning("%s gives up the compile lease for %.0f s after a failed compile",
                    self.name, cooldown)
        self._lease_cooldown = time.monotonic() + cooldown
        self._release()
        with contextlib.suppress(*_ERRORS):
            self.request_compile()

    @staticmethod
    def lost_lease(exc: BaseException) -> bool:
        """Whether a compile failed only because another replica took the lease."""
        return isinstance(exc, LeaseLost)

    def _release(self) -> None:
        lease, self._lease, self.epoch = self._lease, None, None
        if lease is not None:
            with contextlib.suppress(Exception):
                lease.close()

    # --- serving -----------------------------------------------------------------------

    def sync(self) -> bool:
        """Bring the served repository to the newest published generation."""
        return self._sync(full=False)

    def published_branch(self, device_id: str) -> str | None:
        """The commit the published state had for the device's branch at the generation
        this replica serves (None: no branch by then). The served copy is derived from the
        published state, so a branch missing here that was published by this generation
        is LOST here (`wfm.fleet.desired`), not absent. One published later is only not synced
        yet: absent until then, as on any replica behind (and the manifest versions'
        generation guard keeps a client from being handed that older state once it saw a
        newer one)."""
        name = device_ref(device_id)
        row = self.db.read(lambda c: replica_rows.published_ref(c, REPO, name))
        if row is None or row[0] is None or row[1] > self.serving.generation:
            return None
        return row[0]

    def request_repair(self, device_id: str) -> None:
        """A served branch is lost (its ref deleted, `packed-refs` emptied): the loop
        applies the whole published state again, at most every `REPAIR_EVERY` seconds."""
        if not self._repair.is_set():
            log.error("%s: device %r's branch is lost from the served repository; "
                      "applying the published state again", self.name, device_id)
        self._repair.set()

    def _repair_if_asked(self) -> None:
        if self._repair.is_set() and time.monotonic() - self._repaired >= REPAIR_EVERY:
            self._repair.clear()
            self._repaired = time.monotonic()
            self._sync(full=True)

    def _sync(self, *, full: bool) -> bool:
        with self._sync_lock:  # one sync at a time; readers wait only for the refs
            since = -1 if full else self.serving.generation
            # (A repair reads every pack: the refs it rewrites follow from there being any.)
            have = frozenset() if full else self.serving.linked_generations()
            linking = None if full else self._linking
            if linking is not None:
                # This replica's own publication, whose news may come before the publisher
                # can say its objects are here: its pack is not read back (at 100,000
                # devices 383 MB, 3-4 s) and, until the publisher says, nothing is applied.
                have |= {linking}
            with self.serving.spooling() as spool, self._prefetch.claim() as prefetched:
                snapshot = self.db.read(lambda c: replica_rows.read_snapshot(
                    c, REPO, since, dialect=self.db.dialect, spool=spool, have=have,
                    prefetched=prefetched))
                if (linking is not None and snapshot.generation >= linking
                        and linking not in self.serving.linked_generations()):
                    return False  # (`publish` syncs once it is published, or this reads it)
                if snapshot.generation <= self.serving.generation and not snapshot.packs:
                    return False
                with GIT_SECONDS.labels("sync").time():
                    self.serving.add_objects(snapshot)
                    return self._move_serving(snapshot)

    def _move_serving(self, snapshot: replica_rows.Snapshot, *,
                      like: tuple[RepoReplica, dict[str, str], dict[str, str]] | None = None
                      ) -> bool:
        """`snapshot` served; `like`: it is what moved that repository's refs from the
        first to the second (`RepoReplica.move_like`)."""
        with self.lock:
            moved = (self.serving.move_to(snapshot) if like is None
                     else self.serving.move_like(*like, snapshot))
            if moved is not None:
                # In the same step as the refs: a state computed in between would be the
                # previous generation's, served as this one's (replicas woken together by
                # the news sync at the same moment).
                self.on_synced(device_ids_from_refs(moved))
        return moved is not None

    # --- deleting a device (any replica) -----------------------------------------------

    @staticmethod
    def forget_device(conn: Any, client_id: str, device_id: str) -> bool:
        """`records.forget_device` and the publication of the deleted devices' branches
        (`publish_deletion`), in the caller's transaction: a deletion the database holds is
        one every replica applies. False (nothing changed) when the client has no such
        device."""
        family = [d for d in records.client_devices(conn, client_id)
                  if d == device_id or d.startswith(device_id + "/")]
        if not family:
            return False
        publish_deletion(conn, family)
        return records.forget_device(conn, client_id, device_id)

    @staticmethod
    def registered(conn: Any, client_id: str, device_id: str) -> None:
        """A device was just registered (the caller's transaction): if its id was deleted
        before, no replica that has not synced the deletion may give this client a new
        manifest (it would still hold the previous owner's branch), which the manifest
        versions' generation guard (`records.advance_manifest_version`) enforces."""
        generation = deletion_generation(conn, device_id)
        if generation is not None:
            records.raise_manifest_generation(conn, client_id, generation)

    # --- compiling (the holder) --------------------------------------------------------

    def prepare(self) -> Path | None:
        """Before a compile: the directory to compile into, with its repository at the
        newest generation and the compiler's state dropped unless it belongs to that
        generation (and the fleet source as the replicas last published it); None when this
        replica does not hold the lease."""
        if not self.holding:
            return None
        self._settle_leftover()  # (before the work repository catches up)
        self.sync_source()
        self._catch_up_working()
        self._before = self.working.refs()
        self._packs_before = self.working.pack_names()
        self._end_trickle()
        self._trickle = PackTrickle(self.db, REPO, self.working.path / "objects" / "pack")
        return self.compile_dir

    def _end_trickle(self) -> None:
        trickle, self._trickle = self._trickle, None
        if trickle is not None:
            trickle.finish(None)

    def stage(self, report: CompileReport) -> None:
        """As soon as a compile's branches moved (`compiler.compilation.compile_fleet`'s
        `on_moved`, before its state is committed and its objects freed: 5-6 s at a million
        devices), publish it in a thread of its own (`wfm.fleet.staging`): store its pack
        (`_store_ahead`), then publish; `publish` waits for that publication."""
        self._settle_leftover()  # (a compile again after a failed one: let it end)
        before, packs_before = self._before, self._packs_before
        restored = report.restored_branches
        trickle, self._trickle = self._trickle, None
        epoch = self.epoch
        if epoch is None:  # (`publish` says the lease is lost)
            if trickle is not None:
                trickle.finish(None)
            return

        def publish() -> tuple[Published | None, dict[str, str]]:
            try:
                after = self.working.refs()
                moved = ref_moves(after, before)
                try:
                    stored = self._store_ahead(before, moved, packs_before, restored, trickle)
                except Exception:  # (packed and stored again by the transaction)
                    log.exception("storing the compile's pack ahead of its publication failed")
                    stored = None
                return self._publish_moves(self.working, before, after, moved, epoch=epoch,
                                           packs_before=packs_before, restored=restored,
                                           stored=stored), after
            finally:
                if trickle is not None:
                    trickle.finish(None)  # (nothing, once finished by `_store_ahead`)

        self._early = Background(publish, name="margo-publication")

    def _store_ahead(self, before: dict[str, str], moved: dict[str, str | None],
                     packs_before: frozenset[str] | None, restored: int | None,
                     trickle: PackTrickle | None) -> tuple[PackData, PackData | None] | None:
        """The pack (and index) the publication will name, stored before its transaction,
        on a connection beside the writer's (`Database.write_apart`: the devices' writes do
        not queue behind 3.8 GB), the parts the trickle stored already kept; None when this
        publication packs every object (a compaction) or nothing moved."""
        current = self.db.read(lambda c: replica_rows.published_generation(c, REPO))
        if not moved or packs_before is None or (current + 1) % COMPACT_AFTER == 0:
            return None
        pack, index = self._pack_of(self.working, before, moved, packs_before, restored)
        if not pack:
            return None
        trickled = None if trickle is None else trickle.finish(self.working.pack_file(pack))
        self.db.write_apart(lambda c: pack_rows.stage_pack(c, REPO, pack, index,
                                                           trickled=trickled))
        return pack, index

    def _settle_early(self) -> Published | None:
        """Wait for the publication `stage` started, if any; what it published is what
        the next one is worked out from. Raises what it raised."""
        early, self._early = self._early, None
        if early is None:
            return None
        published, after = early.result()
        if published is not None:
            self._before, self._packs_before = after, None
        return published

    def _settle_leftover(self) -> None:
        """The publication of a compile that failed after its branches moved (or an
        attempt before the compile ran again) ends before anything else is published."""
        try:
            self._settle_early()
        except Exception as exc:  # (the compile it belonged to failed already)
            log.warning("%s: the publication of a failed compile failed too: %s", self.name,
                        exc)

    def _catch_up_working(self, *, compiled: bool = False) -> None:
        """Bring the work repository to the newest generation, and keep the compiler's
        state only if it belongs to that generation. Generations published since this
        replica's last one while it kept the lease without a break (the same epoch: nobody
        else could publish a compile) are deletions (`publish_deletion`): the state is kept,
        without what it remembered of the deleted devices. `compiled`: the state is the
        one a compile just left in the work repository (deletions raced its publication)."""
        since = self.working.generation
        with self.working.spooling() as spool:
            snapshot = self.db.read(lambda c: replica_rows.read_snapshot(
                c, REPO, since, dialect=self.db.dialect, spool=spool))
            self.working.apply(snapshot)
        deleted = sorted(i for i in (device_id_from_ref(n) for n, t in snapshot.refs.items()
                                     if t is None) if i is not None)
        mark = state_mark(self.compile_dir)
        state = self.compile_dir / STATE_FILE
        valid = compiled or (mark is not None and (
            mark[0] == snapshot.generation
            or (mark[0] == since and self.epoch is not None and mark[1] == self.epoch)))
        if not valid or not state.exists():
            with contextlib.suppress(FileNotFoundError):
                state.unlink()
            return
        if deleted:
            kept = CompilerState(state)
            try:
                kept.forget(deleted)
            finally:
                kept.close()
        if not compiled and mark != (snapshot.generation, self.epoch):
            write_state_mark(self.compile_dir, snapshot.generation, self.epoch)

    def publish(self, *, restored: int | None = None) -> Published | None:
        """After a compile: publish what moved under the next generation (None: nothing
        moved). `LeaseLost` when another replica holds the lease now. `restored`: how many
        lost branches the compile restored, as its report says (None: not known, so the
        created branches are looked at): with any, the compile's own pack is not enough
        (`RepoReplica.compiled_pack`)."""
        self._end_trickle()  # (no `stage`: nothing moved, or the compile failed)
        attempted = self._early is not None
        try:
            early = self._settle_early()
        except _DeletedMeanwhile:
            early = None
            self._drop_deleted()
        epoch = self.epoch
        if epoch is None:
            raise LeaseLost(f"{self.name} no longer holds the compile lease")
        # Once the early publication published, nothing moved since (the compile's end
        # moves no ref): its refs and moves are not worked out again (a million: 0.4-0.8 s).
        published = early if early is not None else self._publish_retrying(
            epoch, restored, discard=attempted)  # (what it stored ahead, if it failed)
        # The state is what this compile left, in the work repository as published now.
        write_state_mark(self.compile_dir, self.working.generation, epoch)
        self._before = self.working.refs()
        self._packs_before = None
        self.sync()
        return published

    def _publish_retrying(self, epoch: int, restored: int | None, *,
                          discard: bool) -> Published | None:
        """`_publish` of the work repository, again after each deletion published
        meanwhile (`_drop_deleted`), up to `_PUBLISH_ATTEMPTS` times."""
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                return self._publish(self.working, self._before, epoch=epoch,
                                     packs_before=self._packs_before, discard=discard,
                                     restored=restored)
            except _DeletedMeanwhile:
                self._drop_deleted()
        raise RuntimeError("devices kept being deleted while the compile was published; "
                           "compiling again")

    def _drop_deleted(self) -> None:
        """What this compile wrote for a device deleted meanwhile is dropped with its
        branch (a compile asked for by the deletion follows); the rest is published on top
        of the deletion, packed from its refs (the compile's own pack holds the deleted
        device's objects)."""
        self._packs_before = None
        self._catch_up_working(compiled=True)
        after = self.working.refs()
        self._before = {n: t for n, t in self._before.items() if n in after}

    def _publish(self, replica: RepoReplica, before: dict[str, str], *, epoch: int | None,
                 packs_before: frozenset[str] | None = None, restored: int | None = None,
                 discard: bool = False) -> Published | None:
        """Publish what moved in `replica` since `before` under its next generation; with
        `epoch`, only while the compile lease still has it. `packs_before`: the packs
        `replica` held before a compile, whose own pack is then published as it is when
        it can be (`RepoReplica.compiled_pack`); `restored`: as for `publish`; `discard`:
        drop the parts of a pack stored ahead that this publication does not name."""
        after = replica.refs()
        return self._publish_moves(replica, before, after, ref_moves(after, before), epoch=epoch,
                                   packs_before=packs_before, restored=restored,
                                   discard=discard)

    def _publish_moves(self, replica: RepoReplica, before: dict[str, str],
                       after: dict[str, str], moved: dict[str, str | None], *,
                       epoch: int | None, packs_before: frozenset[str] | None,
                       restored: int | None, discard: bool = False,
                       stored: tuple[PackData, PackData | None] | None = None
                       ) -> Published | None:
        """`_publish` of the refs `moved` from `before` to `after`; `stored`: the pack and
        index stored ahead (`_store_ahead`)."""
        if not moved:
            return None
        current = self.db.read(lambda c: replica_rows.published_generation(c, replica.repo))
        compact = (current + 1) % COMPACT_AFTER == 0
        pack: PackData
        index: PackData | None
        if compact:
            pack, index = replica.full_pack()
        elif stored is not None:
            pack, index = stored
        else:
            pack, index = self._pack_of(replica, before, moved, packs_before, restored)
        listed = self._stage_list(replica, after, after if compact else moved)

        def write(conn: Any) -> int:
            published, lease_epoch = replica_rows.lock_counter(conn, replica.repo)
            if epoch is not None and lease_epoch != epoch:
                raise LeaseLost(f"the compile lease moved to epoch {lease_epoch}")
            if epoch is not None and published != replica.generation:
                # The lease never left this replica, so only deletions were published.
                raise _DeletedMeanwhile(f"generation {published} was published meanwhile")
            generation = published + 1
            replica_rows.publish_rows(conn, replica.repo, generation, pack,
                                      after if compact else moved, compact=compact,
                                      index=index, discarded=discard, listed=listed)
            replica_rows.set_counter(conn, replica.repo, generation)
            replica_rows.announce(conn, f"{replica.repo} {generation}")
            return generation

        generation = self._commit_publication(replica, write, current + 1,
                                              None if compact else _Moves(before, after, moved))
        return Published(generation, len(moved), len(pack))

    def _stage_list(self, replica: RepoReplica, after: dict[str, str],
                    written: dict[str, str] | dict[str, str | None]) -> str | None:
        """The list of every ref `after` (`wfm.store.ref_lists`), stored before the
        publication (beside the writer, as the pack) when it is to write refs enough to be
        worth it (`written`); its name, or None: the refs go as rows."""
        if not ref_lists.worth_listing(len(written), len(after)):
            return None
        data = replica.refs_file(after)
        return self.db.write_apart(lambda c: ref_lists.stage_list(c, replica.repo, data))

    def _commit_publication(self, replica: RepoReplica, write: Callable[[Any], int],
                            generation: int, moves: _Moves | None) -> int:
        """Run the publication's `write` (of `generation`, unless another got there). From
        the work repository, the served copy takes the objects by hard links first,
        invisible until the refs move; then, with `moves` (before, after and what moved;
        not a compaction), it moves to what was published without reading it back (a
        million refs: 2 s, and as long to tell their devices), the sync waiting meanwhile."""
        linked = replica is self.working and self.serving.link_objects_from(replica)
        if linked:
            self._linking = generation
        own = moves if linked else None  # (the refs the served copy moves to by itself)
        with self._sync_lock if own is not None else contextlib.nullcontext():
            try:
                generation = self.db.write_sync(write)
                if linked:
                    self.serving.has_objects_of(generation)
            finally:
                self._linking = None
            replica.mark_generation(generation)
            if own is not None and self.serving.generation == generation - 1:
                with GIT_SECONDS.labels("sync").time():
                    self._move_serving(replica_rows.Snapshot(generation, [], own.moved),
                                       like=(replica, own.before, own.after))
        return generation

    @staticmethod
    def _pack_of(replica: RepoReplica, before: dict[str, str], moved: dict[str, str | None],
                 packs_before: frozenset[str] | None,
                 restored: int | None) -> tuple[PackData, PackData | None]:
        """The pack (and index) of what `moved` reaches that `before` does not: the
        compile's own when it is that (`RepoReplica.compiled_pack`; never when the compile
        said it restored lost branches), else packed anew."""
        if packs_before is not None and not restored:
            created = (None if restored == 0 else  # (else a million tips are not listed)
                       [t for n, t in moved.items() if t is not None and n not in before])
            own = replica.compiled_pack(packs_before, created)
            if own is not None:
                return own
        return replica.pack({n: t for n, t in moved.items() if t is not None}, before.values())

    # --- the fleet source (hosted, or mirrored from a remote) --------------------------

    def sync_source(self) -> bool:
        """Bring the local copy of the fleet source to what the replicas published."""
        if self.source is None:
            return False
        with self._source_lock:
            since = self.source.generation
            with self.source.spooling() as spool:
                snapshot = self.db.read(lambda c: replica_rows.read_snapshot(
                    c, "source", since, dialect=self.db.dialect, spool=spool))
                return self.source.apply(snapshot)

    def source_update(self) -> SourceUpdate:
        """Replicas take turns changing the fleet source (a push, a fetch): `begin()` waits
        for the turn and brings the copy up to date, `finish()` publishes what changed."""
        return SourceUpdate(self)

    def publish_source(self, before: dict[str, str]) -> Published | None:
        """Publish what moved in the fleet source since `before` (a `SourceUpdate`)."""
        assert self.source is not None
        return self._publish(self.source, before, epoch=None)


def _request_compile(conn: Any) -> None:
    """A compile request, announced to the holder (`wfm.fleet.news`)."""
    replica_rows.request_compile(conn)
    replica_rows.announce(conn, "compile")


def _request_compile_now(conn: Any) -> None:
    """A compile request for a compile at once (counted so: `Coordinator._tick`), announced
    to the holder."""
    replica_rows.request_compile(conn, at_once=True)
    replica_rows.announce(conn, "compile")
