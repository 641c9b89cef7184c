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
  new Git objects and refs under the next generation (`wfm.replication`). Every replica,
  the holder too, syncs the repository it serves to the newest generation, under a lock that
  the manifest handler also takes, so what it computes a client's state from and the
  generation it says it served always agree.

The compiler's own state (`compiler.state`) is a cache per replica: valid only while this
replica was the last to publish (a sidecar records the generation it compiled), else
dropped, which costs one full compile that commits nothing.
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
from typing import Any

from compiler.gitstore import REPOSITORY_NAME, device_ref
from wfm.db import DatabaseUnavailable
from wfm.pgdb import PgConnection, PostgresDatabase
from wfm.replication import (
    COMPACT_AFTER,
    COUNTERS,
    Published,
    RepoReplica,
    publish_rows,
    read_snapshot,
)

__all__ = ["Coordinator", "LeaseLost", "SourceUpdate"]

log = logging.getLogger("margo.wfm.replicas")

#: The advisory lock key of the compile lease ("compile" in ASCII, as a bigint).
LEASE_KEY = 0x636F6D70696C65
#: The advisory lock under which replicas take turns updating the fleet source ("source").
SOURCE_KEY = 0x736F75726365
REPO = "devices"
#: Seconds between two repairs of the served repository (`request_repair`).
REPAIR_EVERY = 5.0
_STATE_FILE = "compiler-state.sqlite"
_STATE_GENERATION = "compiler-state.generation"
_ERRORS = (DatabaseUnavailable, OSError, RuntimeError)


class LeaseLost(RuntimeError):
    """Another replica took the compile lease: this one's compile is not published."""


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
        self._source_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._repair = threading.Event()
        self._repaired = -REPAIR_EVERY
        #: Held while the served repository moves (and by readers that must not see it move).
        self.lock = threading.RLock()
        self.on_synced: Callable[[], None] = lambda: None
        self.on_compile_due: Callable[[], None] = lambda: None
        self._lease: PgConnection | None = None
        self.epoch: int | None = None
        self._requests_seen: int | None = None
        self._before: dict[str, str] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="margo-replica", daemon=True)

    def start(self) -> None:
        with contextlib.suppress(*_ERRORS):
            self.sync()  # serve what is published before answering anyone
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)
        self._release()

    @property
    def holding(self) -> bool:
        return self._lease is not None

    @property
    def generation(self) -> int:
        """The generation this replica serves."""
        return max(self.serving.generation, 0)

    # --- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.wait(self.poll):
            try:
                self._tick()
            except _ERRORS as exc:
                log.warning("replica coordination: %s", exc)
            except Exception:  # anything else: say so in full, and keep coordinating
                log.exception("replica coordination failed; trying again")

    def _tick(self) -> None:
        self._repair_if_asked()
        self._keep_lease()
        generation, requests = self.db.read(lambda c: c.execute(
            "SELECT generation, compile_requests FROM fleet_state WHERE id = 1").fetchone())
        if int(generation) > self.serving.generation:
            self.sync()
        if self.holding and requests != self._requests_seen:
            self._requests_seen = requests
            self.on_compile_due()

    def request_compile(self) -> None:
        """Ask the holder (whichever replica it is) to compile; does not wait."""
        self.db.submit(lambda c: c.execute(
            "UPDATE fleet_state SET compile_requests = compile_requests + 1 WHERE id = 1"))

    # --- the lease ---------------------------------------------------------------------

    def _keep_lease(self) -> None:
        if self._lease is not None:
            try:
                self._lease.execute("SELECT 1").fetchone()
                return
            except Exception as exc:
                log.warning("%s lost the compile lease: %s", self.name, exc)
                self._release()
        conn = self.db.connect()
        try:
            got = conn.execute("SELECT pg_try_advisory_lock(?)", (LEASE_KEY,)).fetchone()[0]
            if not got:
                conn.close()
                return
            self.epoch = int(conn.execute(
                "UPDATE fleet_state SET lease_epoch = lease_epoch + 1, lease_holder = ?, "
                "lease_since = ? WHERE id = 1 RETURNING lease_epoch",
                (self.name, time.time())).fetchone()[0])
        except BaseException:
            conn.close()
            raise
        self._lease = conn
        self._requests_seen = None  # compile once now: requests may have gone unanswered
        log.info("%s holds the compile lease (epoch %d)", self.name, self.epoch)
        self.on_compile_due()

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
        is LOST here (`wfm.desired`), not absent. One published later is only not synced
        yet: absent until then, as on any replica behind (and the manifest versions'
        generation guard keeps a client from being handed that older state once it saw a
        newer one)."""
        name = device_ref(device_id)
        row = self.db.read(lambda c: c.execute(
            "SELECT target, generation FROM git_refs WHERE repo = ? AND name = ?",
            (REPO, name)).fetchone())
        if row is None or row[0] is None or int(row[1]) > self.serving.generation:
            return None
        return str(row[0])

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
            snapshot = self.db.read(lambda c: read_snapshot(c, REPO, since,
                                                            dialect=self.db.dialect))
            if snapshot.generation <= self.serving.generation and not snapshot.packs:
                return False
            self.serving.add_objects(snapshot)
            with self.lock:
                moved = self.serving.move_to(snapshot)
        if moved:
            self.on_synced()
        return moved

    # --- compiling (the holder) --------------------------------------------------------

    def prepare(self) -> Path | None:
        """Before a compile: the directory to compile into, with its repository at the
        newest generation and the compiler's state dropped unless it belongs to that
        generation (and the fleet source as the replicas last published it); None when this
        replica does not hold the lease."""
        if not self.holding:
            return None
        self.sync_source()
        since = self.working.generation
        snapshot = self.db.read(lambda c: read_snapshot(c, REPO, since,
                                                        dialect=self.db.dialect))
        self.working.apply(snapshot)
        if _state_generation(self.compile_dir) != snapshot.generation:
            with contextlib.suppress(FileNotFoundError):
                (self.compile_dir / _STATE_FILE).unlink()
        self._before = self.working.refs()
        return self.compile_dir

    def publish(self) -> Published | None:
        """After a compile: publish what moved under the next generation (None: nothing
        moved). `LeaseLost` when another replica holds the lease now."""
        epoch = self.epoch
        if epoch is None:
            raise LeaseLost(f"{self.name} no longer holds the compile lease")
        published = self._publish(self.working, self._before, epoch=epoch)
        if published is not None:
            _write_state_generation(self.compile_dir, published.generation)
        self._before = self.working.refs()
        self.sync()
        return published

    def _publish(self, replica: RepoReplica, before: dict[str, str], *,
                 epoch: int | None) -> Published | None:
        """Publish what moved in `replica` since `before` under its next generation; with
        `epoch`, only while the compile lease still has it."""
        after = replica.refs()
        moved: dict[str, str | None] = {n: t for n, t in after.items() if before.get(n) != t}
        moved.update({n: None for n in before if n not in after})
        if not moved:
            return None
        counter = COUNTERS[replica.repo]
        current = self.db.read(lambda c: int(c.execute(
            f"SELECT {counter} FROM fleet_state WHERE id = 1").fetchone()[0]))
        compact = (current + 1) % COMPACT_AFTER == 0
        pack = (replica.full_pack() if compact else
                replica.pack({n: t for n, t in moved.items() if t is not None},
                             before.values()))

        def write(conn: Any) -> int:
            row = conn.execute(f"SELECT {counter}, lease_epoch FROM fleet_state WHERE id = 1 "
                               "FOR UPDATE").fetchone()
            if epoch is not None and int(row[1]) != epoch:
                raise LeaseLost(f"the compile lease moved to epoch {row[1]}")
            generation = int(row[0]) + 1
            publish_rows(conn, replica.repo, generation, pack, after if compact else moved,
                         compact=compact)
            conn.execute(f"UPDATE fleet_state SET {counter} = ? WHERE id = 1", (generation,))
            return generation

        generation = self.db.write_sync(write)
        replica.mark_generation(generation)
        return Published(generation, len(moved), len(pack))

    # --- the fleet source (hosted, or mirrored from a remote) --------------------------

    def sync_source(self) -> bool:
        """Bring the local copy of the fleet source to what the replicas published."""
        if self.source is None:
            return False
        with self._source_lock:
            since = self.source.generation
            snapshot = self.db.read(lambda c: read_snapshot(c, "source", since,
                                                            dialect=self.db.dialect))
            return self.source.apply(snapshot)

    def source_update(self) -> SourceUpdate:
        """Replicas take turns changing the fleet source (a push, a fetch): `begin()` waits
        for the turn and brings the copy up to date, `finish()` publishes what changed."""
        return SourceUpdate(self)


class SourceUpdate:
    """One replica's turn at the fleet source (see `Coordinator.source_update`)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._conn: PgConnection | None = None
        self._before: dict[str, str] = {}

    def begin(self) -> None:
        source = self._coordinator.source
        assert source is not None
        conn = self._coordinator.db.connect()
        try:
            conn.execute("SET statement_timeout = 120000")
            conn.execute("SELECT pg_advisory_lock(?)", (SOURCE_KEY,))
            self._coordinator.sync_source()
        except BaseException:
            conn.close()
            raise
        self._conn, self._before = conn, source.refs()

    def finish(self, *, publish: bool = True) -> Published | None:
        """Publish what the turn changed (unless `publish` is false) and end the turn."""
        conn, self._conn = self._conn, None
        try:
            source = self._coordinator.source
            if not publish or source is None:
                return None
            return self._coordinator._publish(source, self._before, epoch=None)
        finally:
            if conn is not None:
                conn.close()  # ends the session: the advisory lock goes with it


def _state_generation(directory: Path) -> int | None:
    try:
        return int((directory / _STATE_GENERATION).read_text().strip())
    except (OSError, ValueError):
        return None


def _write_state_generation(directory: Path, generation: int) -> None:
    tmp = directory / f"{_STATE_GENERATION}.tmp"
    tmp.write_text(f"{generation}\n")
    os.replace(tmp, directory / _STATE_GENERATION)
