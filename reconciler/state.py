"""The device client's durable memory: one SQLite file that survives crashes and restarts.

What it holds, and why each part must be durable:
- the adopted desired state (source version marker, manifestVersion, ETag and the exact bytes of
  every document), so a restart re-applies exactly what was adopted, never rolls the
  manifestVersion back, and never fetches unchanged documents again;
- per component, the last state reported (and its error), so a status is sent only when
  something really changed; per deployment, which bytes of it (the document's digest) the
  last report was about, so that adopting new bytes is reported even when it changes no
  component's state (the server must learn the device runs them);
- per deployment, the component order it was installed in, so a deployment that vanished from
  the desired state is removed in reverse order;
- the outgoing journal of status reports (an outbox): a report is appended in the same
  transaction that changes the component state it describes, so a crash can never lose a
  transition or report one that was not stored; delivery removes entries only after the server
  acknowledged them;
- dead letters (entries the server refused for good) and a few keys and values.

Every method that writes commits before it returns (WAL, `synchronous=FULL`): a SIGKILL right
after a call loses nothing the call acknowledged. A file that cannot be read is an error that
names the file, never a silent fresh start: starting empty would forget the manifestVersion
(or commit) the device must never go back behind, and every status report not yet
delivered. Only a file that does not exist is created, and it is created whole (schema
written aside, then linked into place), so an empty or schema-less file under the real name
is always damage (a file system that lost its content in a power cut, a failed copy), and is
refused as such.

Stored documents are checked against their digests on every read (`_verified`): a copy
that no longer matches (a bad disk sector, an edit made behind the client's back) is never
handed out. `adopted()` leaves it out and names it in `Adopted.damaged`, so the source fetches
it again; `desired_documents()` refuses to return a damaged set at all.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from margo.digests import DigestError, verify_digest
from reconciler.desired import DesiredState
from reconciler.errors import ErrorCode
from reconciler.sources import Adopted

__all__ = ["SCHEMA_VERSION", "BodyFactory", "ComponentRecord", "ComponentReport",
           "DamagedDocumentsError", "DeadLetter", "DeviceState", "ErrorInfo", "JournalEntry",
           "StateError"]

SCHEMA_VERSION = 2
_APPLICATION_ID = 0x4D47_4F53  # "MGOS": marks the file as ours (PRAGMA application_id)
#: The kv key of the history rewrite an operator accepted and the device then adopted
#: (`Adopted.history_rewrite_accepted`): an override is used once, never again.
_REWRITE_ACCEPTED = "source.history-rewrite-accepted"
#: What every refusal of a damaged file ends with: what to do about it.
_WHAT_TO_DO = ("restore it from a backup, or move it (with its -wal and -shm files) aside to "
               "start this device over on purpose (see 'A damaged device state' in "
               "docs/operations.md); starting empty silently would forget the version the "
               "device must never go back behind and every status report not yet delivered")

_SCHEMA = """
CREATE TABLE adopted (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    source TEXT, version TEXT, manifest_version INTEGER, etag TEXT, adopted_at REAL NOT NULL
);
CREATE TABLE documents (
    deployment_id TEXT PRIMARY KEY, digest TEXT NOT NULL, data BLOB NOT NULL
);
CREATE TABLE components (
    deployment_id TEXT NOT NULL, component TEXT NOT NULL, state TEXT NOT NULL,
    error_code TEXT, error_message TEXT, updated_at REAL NOT NULL,
    PRIMARY KEY (deployment_id, component)
);
CREATE TABLE component_orders (deployment_id TEXT PRIMARY KEY, names TEXT NOT NULL);
CREATE TABLE journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, deployment_id TEXT, method TEXT NOT NULL,
    path TEXT NOT NULL, body BLOB NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0, created_at REAL NOT NULL
);
CREATE TABLE dead_letters (
    seq INTEGER PRIMARY KEY, deployment_id TEXT, method TEXT NOT NULL, path TEXT NOT NULL,
    body BLOB NOT NULL, attempts INTEGER NOT NULL, reason TEXT NOT NULL, created_at REAL NOT NULL,
    dead_at REAL NOT NULL
);
CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE reported (deployment_id TEXT PRIMARY KEY, about TEXT NOT NULL);
"""

#: What each schema version adds to the one before (applied in order when a file of an
#: older client is opened; a newer file is refused).
_MIGRATIONS = {
    2: "CREATE TABLE IF NOT EXISTS reported (deployment_id TEXT PRIMARY KEY, about TEXT NOT NULL)",
}

#: A component error: `{"code": ..., "message": ...}` or `(code, message)`; None for none.
ErrorInfo = Mapping[str, Any] | Sequence[str] | None
#: (state, error) per component.
StateUpdate = tuple[str, ErrorInfo]
#: What a body factory receives per component, in install order: (name, state, error).
ComponentReport = tuple[str, str, dict[str, str] | None]
Body = Mapping[str, Any] | bytes
BodyFactory = Callable[[list[ComponentReport]], Body | tuple[str, Body]]


class StateError(Exception):
    """The device state file cannot be used (corrupt, not ours, or from a newer version)."""


class DamagedDocumentsError(StateError):
    """Adopted documents whose stored bytes no longer hash to the digest they were adopted
    with. They must not be planned or applied; the source fetches them again (the damaged
    ones are left out of `Adopted.documents` and named in `Adopted.damaged`)."""

    def __init__(self, path: Path, damaged: Sequence[str]) -> None:
        self.damaged = tuple(damaged)
        super().__init__(f"{path}: the stored copies of deployments {', '.join(self.damaged)} no "
                         "longer match their digests (damaged on disk or changed behind the "
                         "client's back); they are not applied and are fetched again")


@dataclass(frozen=True)
class ComponentRecord:
    """The last state recorded for one component (what was, or will be, reported)."""

    state: str
    error_code: str | None
    error_message: str | None
    updated_at: float

    @property
    def error(self) -> dict[str, str] | None:
        if self.error_code is None and self.error_message is None:
            return None
        return {"code": self.error_code or "", "message": self.error_message or ""}


@dataclass(frozen=True)
class JournalEntry:
    """One request waiting to be delivered, in `seq` order."""

    seq: int
    deployment_id: str | None
    method: str
    path: str
    body: bytes
    attempts: int
    not_before: float  # wall-clock seconds; 0 = send at once
    created_at: float


@dataclass(frozen=True)
class DeadLetter:
    """An entry the server refused for good, kept so that people can see what was lost."""

    seq: int
    deployment_id: str | None
    method: str
    path: str
    body: bytes
    attempts: int
    reason: str
    created_at: float
    dead_at: float


def _error_pair(error: ErrorInfo) -> tuple[str | None, str | None]:
    if error is None:
        return None, None
    if isinstance(error, Mapping):
        return str(error.get("code", "")), str(error.get("message", ""))
    if isinstance(error, str | bytes) or len(error) != 2:
        raise TypeError(f"a component error is {{'code', 'message'}} or (code, message), "
                        f"not {error!r}")
    code, message = error
    return str(code), str(message)


def _ordered(records: Mapping[str, ComponentRecord], order: Sequence[str]) -> list[ComponentReport]:
    """Components in install order (as last set by `set_component_order`), then any others
    by name, so a report lists them the way the deployment does."""
    names = [n for n in order if n in records] + sorted(n for n in records if n not in order)
    return [(n, records[n].state, records[n].error) for n in names]


def _merged(before: Mapping[str, ComponentRecord], updates: Mapping[str, StateUpdate],
            keep: Collection[str] | None, now: float) -> dict[str, ComponentRecord]:
    """The stored component states with `updates` applied (a component whose state and
    error did not change keeps its record and time), less those not in `keep`."""
    merged = dict(before) if keep is None else {
        name: record for name, record in before.items() if name in keep}
    for name, (state, error) in updates.items():
        code, message = _error_pair(error)
        old = merged.get(name)
        if old is None or (old.state, old.error_code, old.error_message) != (
                state, code, message):
            merged[name] = ComponentRecord(str(state), code, message, now)
    return merged


class DeviceState:
    """The device's durable state in one SQLite file (see the module docstring).

    Safe to share between threads: one connection, serialised by a lock (the work per call is
    a few rows, so contention is not a concern)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        self._check_file()
        if not self.path.exists():
            self._create_file()
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None,
                                         check_same_thread=False, timeout=30)
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: cannot open the device state: {exc}") from exc
        try:
            self._open()
        except BaseException:
            self._conn.close()
            raise

    # --- lifecycle -----------------------------------------------------------------------

    def _check_file(self) -> None:
        """Damage SQLite itself would not report: it takes a 0-byte file for a new, empty
        database (so would start fresh), and a write-ahead log without its database for
        nothing at all (and would lose what the log holds)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            wal = self.path.with_name(self.path.name + "-wal")
            if wal.is_file() and wal.stat().st_size > 0:
                raise StateError(f"{self.path}: the device state is missing but its write-ahead "
                                 f"log {wal.name} is there: the file was deleted or lost; "
                                 f"{_WHAT_TO_DO}") from None
            return
        except OSError as exc:
            raise StateError(f"{self.path}: cannot read the device state: {exc}") from exc
        if size == 0 and self.path.is_file():
            raise StateError(f"{self.path}: the device state is empty (0 bytes): its content was "
                             f"lost (a power cut before the file system wrote it, a failed "
                             f"copy); {_WHAT_TO_DO}")

    def _create_file(self) -> None:
        """A new state file, created whole: the schema is written to a file beside it, which
        is then linked into place (never over a file another process created meanwhile) and
        the directory synced, so the real name never holds an empty or half-made file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=f".{self.path.name}.new-", dir=self.path.parent)
        os.close(descriptor)
        fresh = Path(name)
        try:
            conn = sqlite3.connect(fresh, isolation_level=None)
            try:
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("BEGIN IMMEDIATE")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {_APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            finally:
                conn.close()
            try:
                os.link(fresh, self.path)
            except FileExistsError:
                pass  # another process created it first: theirs is as good
            except OSError:  # a file system without hard links
                os.replace(fresh, self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except (sqlite3.Error, OSError) as exc:
            raise StateError(f"{self.path}: cannot create the device state: {exc}") from exc
        finally:
            for leftover in (fresh, fresh.with_name(fresh.name + "-journal")):
                leftover.unlink(missing_ok=True)

    def _open(self) -> None:
        try:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            check = self._conn.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._unreadable(exc) from exc
        if check != [("ok",)]:
            detail = "; ".join(str(row[0]) for row in check[:3])
            raise StateError(f"{self.path}: the device state is corrupt ({detail}); "
                             f"{_WHAT_TO_DO}")
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        if version == 0:
            self._refuse_unversioned()
        elif version > SCHEMA_VERSION:
            raise StateError(f"{self.path}: device state schema version {version} is newer than "
                             f"this client understands ({SCHEMA_VERSION}); upgrade the client")
        application = self._conn.execute("PRAGMA application_id").fetchone()[0]
        if application != _APPLICATION_ID:
            raise StateError(f"{self.path}: this SQLite file is not a margo-gitops device "
                             "state (application_id differs)")
        if version < SCHEMA_VERSION:
            self._migrate(version)

    def _migrate(self, version: int) -> None:
        """Bring a file an older client wrote up to `SCHEMA_VERSION`, in one transaction
        (a crash leaves the old version, which is migrated again on the next start)."""
        with self._transaction() as conn:
            for step in range(version + 1, SCHEMA_VERSION + 1):
                conn.execute(_MIGRATIONS[step])
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _unreadable(self, exc: Exception) -> StateError:
        return StateError(f"{self.path}: the device state is unreadable ({exc}); {_WHAT_TO_DO}")

    def _refuse_unversioned(self) -> None:
        """An existing file without a schema version. New files are created with their
        schema (`_create_file`), so this is never ours to write into: another program's
        database, or one of ours whose content was lost."""
        tables = self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if tables:
            raise StateError(f"{self.path}: this SQLite file is not a margo-gitops device state "
                             "(it has tables but no schema version)")
        raise StateError(f"{self.path}: the device state holds no schema (an empty database): "
                         f"its content was lost; {_WHAT_TO_DO}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> DeviceState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (and fsynced) before the caller continues.
        IMMEDIATE takes the write lock up front, so two processes never interleave halves."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute(ErrorCode.ROLLBACK)
                raise

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    # --- adopted desired state -----------------------------------------------------------

    def _verified(self, rows: Iterable[tuple[str, str, Any]]
                  ) -> tuple[dict[str, tuple[str, bytes]], list[str]]:
        """The one way stored documents are read: `(deployment id, digest, data)` rows split
        into those whose bytes still hash to their digest (deployment id -> (digest, bytes))
        and the ids of those that do not. Checking costs one sha256 per small document; using
        a damaged copy would apply what no server sent. A value SQLite no longer holds as a
        BLOB (an edit made with SQL text functions) is checked as its UTF-8 bytes."""
        good: dict[str, tuple[str, bytes]] = {}
        damaged: list[str] = []
        for deployment_id, digest, data in rows:
            raw = data.encode("utf-8") if isinstance(data, str) else data
            try:
                if not isinstance(raw, bytes | memoryview) or not isinstance(digest, str):
                    raise DigestError("not a stored document")
                verify_digest(bytes(raw), digest)
            except DigestError:
                damaged.append(str(deployment_id))
                continue
            good[deployment_id] = (digest, bytes(raw))
        return good, damaged

    def adopted(self) -> Adopted:
        """The adopted marker and the documents whose stored copies are intact (digest ->
        exact bytes), as sources expect it; damaged copies are named in `damaged`."""
        with self._lock:
            self._conn.execute("BEGIN")  # one snapshot: marker and documents agree
            try:
                row = self._conn.execute("SELECT version, manifest_version, etag FROM adopted"
                                         ).fetchone()
                rows = self._conn.execute(
                    "SELECT deployment_id, digest, data FROM documents").fetchall()
                accepted = self._conn.execute("SELECT value FROM kv WHERE key = ?",
                                              (_REWRITE_ACCEPTED,)).fetchone()
            finally:
                self._conn.execute("COMMIT")
        good, damaged = self._verified(rows)
        documents = dict(good.values())
        rewrite = accepted[0] if accepted else None
        if row is None:
            return Adopted(documents=documents, damaged=tuple(damaged),
                           history_rewrite_accepted=rewrite)
        return Adopted(version=row[0], manifest_version=row[1], etag=row[2], documents=documents,
                       damaged=tuple(damaged), history_rewrite_accepted=rewrite)

    def adopted_marker(self) -> tuple[str | None, str | None, int | None]:
        """(source, version, manifestVersion) of the adopted state, without its documents:
        what every status report names (`Reconciler._report`), read without verifying
        every document's digest each time."""
        rows = self._read("SELECT source, version, manifest_version FROM adopted")
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else (None, None, None)

    def adopted_source(self) -> str | None:
        """Which source ("git", "margo-rest") the adopted state came from, if any."""
        rows = self._read("SELECT source FROM adopted")
        return rows[0][0] if rows else None

    def adopt(self, state: DesiredState) -> None:
        """Replace the adopted marker and every document in one transaction: after a crash
        the device holds either the old state or the new one, never a mixture."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM adopted")
            conn.execute("INSERT INTO adopted (singleton, source, version, manifest_version, "
                         "etag, adopted_at) VALUES (1, ?, ?, ?, ?, ?)",
                         (state.source, state.version, state.manifest_version, state.etag,
                          self._clock()))
            conn.execute("DELETE FROM documents")
            conn.executemany("INSERT INTO documents (deployment_id, digest, data) VALUES (?, ?, ?)",
                             [(d.deployment_id, d.digest, d.document) for d in state.deployments])
            if state.history_rewrite_accepted is not None:
                conn.execute("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) "
                             "DO UPDATE SET value = excluded.value",
                             (_REWRITE_ACCEPTED, state.history_rewrite_accepted))

    def desired_documents(self) -> list[bytes]:
        """The adopted documents' exact bytes in deployment id order, to re-parse after a
        restart (parsing is cheap; storing parsed objects would tie the file to our code).

        Raises `DamagedDocumentsError` when any stored copy no longer matches its digest:
        a partial set would remove the deployments left out, a damaged one would apply bytes
        no server sent."""
        good, damaged = self._verified(self._read(
            "SELECT deployment_id, digest, data FROM documents"))
        if damaged:
            raise DamagedDocumentsError(self.path, sorted(damaged))
        return [good[deployment_id][1] for deployment_id in sorted(good)]

    # --- component states and install order ----------------------------------------------

    def component_states(self, deployment_id: str) -> dict[str, ComponentRecord]:
        rows = self._read("SELECT component, state, error_code, error_message, updated_at "
                          "FROM components WHERE deployment_id = ? ORDER BY component",
                          (deployment_id,))
        return {r[0]: ComponentRecord(r[1], r[2], r[3], r[4]) for r in rows}

    def known_deployments(self) -> list[str]:
        """Deployments with recorded component states (e.g. to finish a removal after a
        restart), in id order."""
        return [r[0] for r in self._read(
            "SELECT DISTINCT deployment_id FROM components ORDER BY deployment_id")]

    def forget(self, deployment_id: str) -> None:
        """Drop a deployment's component states and install order once its removal has been
        recorded as removed. Journal entries stay: they still have to be delivered."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM components WHERE deployment_id = ?", (deployment_id,))
            conn.execute("DELETE FROM component_orders WHERE deployment_id = ?",
                         (deployment_id,))
            conn.execute("DELETE FROM reported WHERE deployment_id = ?", (deployment_id,))

    def set_component_order(self, deployment_id: str, names: Sequence[str]) -> None:
        with self._transaction() as conn:
            conn.execute("INSERT INTO component_orders (deployment_id, names) VALUES (?, ?) "
                         "ON CONFLICT (deployment_id) DO UPDATE SET names = excluded.names",
                         (deployment_id, json.dumps(list(names))))

    def component_orders(self) -> dict[str, list[str]]:
        return {r[0]: list(json.loads(r[1])) for r in self._read(
            "SELECT deployment_id, names FROM component_orders ORDER BY deployment_id")}

    # --- the journal ---------------------------------------------------------------------

    def record(self, deployment_id: str, component_states: Mapping[str, StateUpdate],
               body_factory: BodyFactory, *, path: str | None = None, method: str = "POST",
               keep: Collection[str] | None = None, about: str | None = None,
               force: bool = False) -> bool:
        """Store new component states and, when they change anything, append the report.

        `component_states` updates some or all components with `(state, error)`; with `keep`,
        stored components not listed there are dropped (a component the deployment no longer
        has). When the merged states equal the stored ones, nothing is written and
        `body_factory` is not called: a repeated identical state never produces a second
        report. Otherwise `body_factory(components)` gets every component as
        `(name, state, error-dict-or-None)` in install order (ready for
        `statuses.status_body`) and returns the body (a dict, sent as compact JSON, or exact
        bytes) or `(path, body)`; the new states and the journal entry are then committed in
        ONE transaction. Returns whether it appended.

        `about`: the digest of the deployment's document the report is about. A report is
        also appended when the states are unchanged but the last report was about other
        bytes (new bytes adopted with nothing to apply must still be reported, or the server
        never learns the device runs them), and with `force` (a periodic re-assertion of
        the true state, so that a lost or forged report does not stand)."""
        with self._transaction() as conn:
            before = self._states_in(conn, deployment_id)
            now = self._clock()
            merged = _merged(before, component_states, keep, now)
            reported = conn.execute("SELECT about FROM reported WHERE deployment_id = ?",
                                    (deployment_id,)).fetchone()
            moved = about is not None and (reported is None or reported[0] != about)
            if merged == before and (not merged or not (moved or force)):
                return False  # (nothing recorded yet has nothing to re-assert either)
            if about is not None:
                conn.execute("INSERT INTO reported (deployment_id, about) VALUES (?, ?) "
                             "ON CONFLICT (deployment_id) DO UPDATE SET about = excluded.about",
                             (deployment_id, about))
            row = conn.execute("SELECT names FROM component_orders WHERE deployment_id = ?",
                               (deployment_id,)).fetchone()
            made = body_factory(_ordered(merged, json.loads(row[0]) if row else []))
            target, body = made if isinstance(made, tuple) else (path, made)
            if not isinstance(target, str) or not target.startswith("/"):
                raise ValueError("a journal entry needs a path: give `path=` or return "
                                 "(path, body) from the body factory")
            data = body if isinstance(body, bytes) else _json_bytes(body)
            conn.execute("DELETE FROM components WHERE deployment_id = ?", (deployment_id,))
            conn.executemany(
                "INSERT INTO components (deployment_id, component, state, error_code, "
                "error_message, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                [(deployment_id, name, r.state, r.error_code, r.error_message, r.updated_at)
                 for name, r in merged.items()])
            conn.execute("INSERT INTO journal (deployment_id, method, path, body, created_at) "
                         "VALUES (?, ?, ?, ?, ?)", (deployment_id, method, target, data, now))
            return True

    @staticmethod
    def _states_in(conn: sqlite3.Connection, deployment_id: str) -> dict[str, ComponentRecord]:
        rows = conn.execute("SELECT component, state, error_code, error_message, updated_at "
                            "FROM components WHERE deployment_id = ?", (deployment_id,))
        return {r[0]: ComponentRecord(r[1], r[2], r[3], r[4]) for r in rows}

    def pending(self, limit: int = 100) -> list[JournalEntry]:
        """The oldest `limit` undelivered entries, in the order they were recorded."""
        rows = self._read("SELECT seq, deployment_id, method, path, body, attempts, not_before, "
                          "created_at FROM journal ORDER BY seq LIMIT ?", (limit,))
        return [JournalEntry(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6], r[7]) for r in rows]

    def delivered(self, seq: int) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM journal WHERE seq = ?", (seq,))

    def deferred(self, seq: int, not_before: float, attempts: int) -> None:
        """Keep the entry, to be tried again no earlier than `not_before` (wall clock)."""
        with self._transaction() as conn:
            conn.execute("UPDATE journal SET not_before = ?, attempts = ? WHERE seq = ?",
                         (not_before, attempts, seq))

    def resume_deferred(self, not_before: float = 0.0) -> int:
        """Entries that have been deferred become due at `not_before` (0: now; an entry
        deferred to an earlier time keeps it), with their attempts counted from zero again;
        returns how many. Writes nothing when none was deferred, so calling it after every
        poll costs one read."""
        with self._lock:
            deferred = self._conn.execute("SELECT count(*) FROM journal WHERE attempts > 0"
                                          ).fetchone()[0]
        if not deferred:
            return 0
        with self._transaction() as conn:
            changed = conn.execute("UPDATE journal SET not_before = min(not_before, ?), "
                                   "attempts = 0 WHERE attempts > 0", (not_before,)).rowcount
        return int(changed)

    def dead_letter(self, seq: int, reason: str) -> None:
        """Move an entry the server refused for good out of the queue (so it cannot block
        later reports) into `dead_letters`, where it stays visible."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO dead_letters (seq, deployment_id, method, path, body, "
                "attempts, reason, created_at, dead_at) SELECT seq, deployment_id, method, path, "
                "body, attempts + 1, ?, created_at, ? FROM journal WHERE seq = ?",
                (reason, self._clock(), seq))
            conn.execute("DELETE FROM journal WHERE seq = ?", (seq,))

    def dead_letters(self) -> list[DeadLetter]:
        rows = self._read("SELECT seq, deployment_id, method, path, body, attempts, reason, "
                          "created_at, dead_at FROM dead_letters ORDER BY seq")
        return [DeadLetter(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6], r[7], r[8])
                for r in rows]

    def journal_size(self) -> int:
        return int(self._read("SELECT count(*) FROM journal")[0][0])

    # --- keys and values -----------------------------------------------------------------

    def get(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM kv WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def set(self, key: str, value: str) -> None:
        with self._transaction() as conn:
            conn.execute("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) "
                         "DO UPDATE SET value = excluded.value", (key, value))


def _json_bytes(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
