"""What the compiler remembers between runs (SQLite beside the repository).

It is a cache plus a few timers, never a source of truth: the device branches are. Losing
it costs one full recompile (which commits nothing, since trees are unchanged) and restarts
running grace periods. It holds:

* per intent, the digests of the intent, of what decides its placement (targets,
  constraints, profile choice) and of the application version it used, so the next run
  knows which intents changed, whom they targeted, and whether placements still hold;
* per device, the digest of its capability document and whether its last compile
  succeeded, so an untouched device is skipped without rendering, and the commit its
  branch was left at with that commit's files (name -> blob id), so a device recompiled
  for one intent need not read its tree back from Git;
* per (device, intent), whether the device was targeted, eligible and deployed, with which
  profile, since when it has been ineligible (grace periods), and whether it waits for
  capacity (accounting), which also lets commit messages say *why*;
* the `SnapshotMemo` of the keyed capability file the last compile read (the identity of its
  bytes, its documents' digests and, for JSON, where each document lies in the text), so
  reading the same bytes again skips that work.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from compiler import statedamage
from compiler.gcpause import collection_paused
from compiler.remembered import DeviceRecords, Remembered
from compiler.snapshot import SnapshotMemo, TrustedDigests
from compiler.statedamage import is_damage, is_sound, set_aside

__all__ = ["FORGOTTEN_KEY", "STATE_FILE_NAME", "CompilerState", "DeviceRecord",
           "IntentRecord", "PlacementRecord", "StagedSave", "StagingSave", "is_damage", "is_sound",
           "set_aside"]

SCHEMA_VERSION = "4"
#: The state's file beside the repository (``<repos>/compiler-state.sqlite``) in the server.
STATE_FILE_NAME = "compiler-state.sqlite"
#: The meta key listing the devices `CompilerState.forget` marked (JSON list of ids).
FORGOTTEN_KEY = "forgotten"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS intents (
    name TEXT PRIMARY KEY, digest TEXT NOT NULL, app_id TEXT NOT NULL,
    app_version TEXT NOT NULL, app_digest TEXT NOT NULL, placement_digest TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, caps_digest TEXT NOT NULL, compiled_at REAL NOT NULL,
    tree TEXT NOT NULL, deployments INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS placements (
    device_id TEXT NOT NULL, intent TEXT NOT NULL, eligible INTEGER NOT NULL,
    deployed INTEGER NOT NULL, ineligible_since REAL, profile TEXT,
    waiting INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (device_id, intent));
CREATE TABLE IF NOT EXISTS device_trees (
    device_id TEXT PRIMARY KEY, tip TEXT NOT NULL, files TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot_documents (
    device_id TEXT PRIMARY KEY, digest TEXT, start INTEGER, end INTEGER,
    plain INTEGER NOT NULL);
DROP INDEX IF EXISTS placements_by_intent;
CREATE INDEX IF NOT EXISTS placements_of_intent ON placements (intent, device_id);
CREATE INDEX IF NOT EXISTS placements_in_grace ON placements (ineligible_since)
    WHERE ineligible_since IS NOT NULL;
""" + "".join(f"CREATE TRIGGER IF NOT EXISTS devices_{event.lower()} AFTER {event} ON devices "
             "BEGIN DELETE FROM meta WHERE key = 'devices_id'; END;"
             for event in ("INSERT", "UPDATE", "DELETE"))
#: The meta key of a random id naming the device records as they were last written: this
#: module writes a new one with every write of the `devices` table (`stage`, `forget`,
#: `_reset`), and the triggers above delete it whenever a row is written by anyone (another
#: process, an older compiler, a hand edit), so an id still present names exactly the rows
#: it was written with. What lets a process keep the records in memory between compiles
#: (`compiler.remembered.DeviceRecords`) instead of reading 100,000 rows again (0.1-0.2 s).
_DEVICES_ID = "devices_id"


@dataclass(frozen=True, slots=True)
class IntentRecord:
    name: str
    digest: str
    app_id: str
    app_version: str
    app_digest: str
    #: Digest of the intent's fields that decide placement (`Intent.placement_digest`).
    placement_digest: str


# Per-device rows are NamedTuples: a compile builds, pickles (from worker processes) and
# reads back tens of thousands of them, several times cheaper than frozen dataclasses.


class DeviceRecord(NamedTuple):
    device_id: str
    caps_digest: str
    compiled_at: float
    tree: str  # the tree id committed (or found unchanged) for these inputs
    deployments: int


class PlacementRecord(NamedTuple):
    device_id: str
    intent: str
    eligible: bool
    deployed: bool
    ineligible_since: float | None
    profile: str | None = None  # the id of the profile deployed (eligible placements)
    #: Eligible, but what the device has left after the WFM's other placements is too little
    #: (capacity accounting): evaluated again whenever the device is compiled. With
    #: `deployed`: a change of the placed deployment is *held* (its file is kept as it is).
    waiting: bool = False


def _upsert(table: str, keys: str, columns: str) -> str:
    """An INSERT that updates a row of the same key in place: ``INSERT OR REPLACE`` deletes
    and inserts it anew, touching more pages (9,752 of 100,000 devices: 295 -> 215 ms)."""
    names = [c.strip() for c in columns.split(",")]
    updates = ", ".join(f"{c} = excluded.{c}" for c in names if c not in keys)
    return (f"INSERT INTO {table} VALUES ({', '.join('?' * len(names))}) "
            f"ON CONFLICT ({keys}) DO UPDATE SET {updates}")


_UPSERT_DEVICE = _upsert("devices", "device_id",
                         "device_id, caps_digest, compiled_at, tree, deployments")
_UPSERT_TREE = _upsert("device_trees", "device_id", "device_id, tip, files")

#: A `DeviceRecord` from a row of its five columns, built in C (what `_make` does after a
#: length check the SELECT makes needless).
_new_device_record = functools.partial(tuple.__new__, DeviceRecord)

_PLACEMENT_COLUMNS = ("device_id, intent, eligible, deployed, ineligible_since, profile, "
                      "waiting")
_UPSERT_PLACEMENT = _upsert("placements", "device_id, intent", _PLACEMENT_COLUMNS)

#: ``json.dumps(files, sort_keys=True, separators=(",", ":"))`` (what it runs) without
#: making an encoder per call (4.2 -> 2.5 us for a tree of six files, measured).
_encode_files = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def files_json(files: Mapping[str, str]) -> str:
    """The JSON text a device's tree (file name -> blob id) is recorded as."""
    return _encode_files(files)


def _text_of(files: str | Mapping[str, str]) -> str:
    return files if isinstance(files, str) else files_json(files)

#: A `PlacementRecord` from a tuple of its fields, built in C (see `_new_device_record`).
_new_placement = functools.partial(tuple.__new__, PlacementRecord)


def _placements(rows: list[Any]) -> Iterator[PlacementRecord]:
    """A `PlacementRecord` from each row of `_PLACEMENT_COLUMNS` (SQLite stores booleans as
    0/1), made column by column in C: a Python call per row was most of reading the
    placements of the devices a recompile compiles."""
    if not rows:
        return iter(())
    device, intent, eligible, deployed, since, profile, waiting = zip(*rows, strict=True)
    return map(_new_placement, zip(device, intent, map(bool, eligible), map(bool, deployed),
                                   since, profile, map(bool, waiting), strict=True))


class CompilerState:
    """Read everything at the start of a compile, write one transaction at the end."""

    def __init__(self, path: str | Path):
        """Open the state at `path`, creating it. A damaged file (not a database, or failing
        its integrity check, checked once per process) is set aside (`set_aside`) and a new
        state started: it is a cache, and the next compile, a full one, rebuilds it."""
        self.path = Path(path)
        self._pid, self._forked = os.getpid(), dict[int, sqlite3.Connection]()  # `_reader`
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            set_aside(self.path, exc)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            key = self.path.absolute()
            if key not in statedamage.CHECKED:
                check = db.execute("PRAGMA quick_check").fetchall()
                if check != [("ok",)]:
                    raise sqlite3.DatabaseError(
                        "integrity check failed: "
                        + "; ".join(str(r[0]) for r in check[:3]).replace("\n", " ")[:300])
                statedamage.CHECKED.add(key)
            db.executescript(_SCHEMA)
            self._db = db
            version = self._meta("schema")
            if version != SCHEMA_VERSION:  # a cache: start over rather than migrate
                self._reset()
                self._set_meta("schema", SCHEMA_VERSION)
        except BaseException:
            db.close()
            raise
        return db

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def _reset(self) -> None:
        # Dropped, not emptied: an older schema's tables may lack columns.
        self._db.executescript("DROP TABLE IF EXISTS devices; DROP TABLE IF EXISTS intents; "
                               "DROP TABLE IF EXISTS placements; "
                               "DROP TABLE IF EXISTS device_trees; "
                               "DROP TABLE IF EXISTS snapshot_documents; "
                               "DELETE FROM meta WHERE key IN ('snapshot', "
                               f"'{_MEMO_ID}');" + _SCHEMA)
        self._set_meta(_DEVICES_ID, str(uuid.uuid4()))

    def bind(self, repository: str, *, compiler_version: str | None = None) -> None:
        """Forget everything remembered about another repository (e.g. one recreated), or
        remembered by a compiler whose decisions may differ (`compiler_version` changed):
        remembered placements would otherwise be reused without being evaluated again."""
        if self._meta("repository") != repository or (
                compiler_version is not None
                and self._meta("compiler_version") != compiler_version):
            self._reset()
            self._set_meta("repository", repository)
            if compiler_version is not None:
                self._set_meta("compiler_version", compiler_version)

    def close(self) -> None:
        self._db.close()

    def forget(self, device_ids: Iterable[str]) -> None:
        """Forget everything remembered about these devices (record, placements, tree), in
        one transaction: a device deleted from the fleet, whose id may be registered again
        by another client that must start from nothing (no skipped compile because its
        capabilities happen to be the same, no placements or grace periods carried over)."""
        forgotten = [(device_id,) for device_id in dict.fromkeys(device_ids)]
        with self.transaction() as db:
            for table in ("devices", "placements", "device_trees"):
                db.executemany(f"DELETE FROM {table} WHERE device_id=?", forgotten)
            # Marked until a compile gives the device a branch of its own again: a compile
            # that read the state before this may still write the records back, and a tip
            # it names must then never be taken for a lost branch to continue.
            marked = self._forgotten() | {device_id for (device_id,) in forgotten}
            self._set_meta(FORGOTTEN_KEY, json.dumps(sorted(marked)))
            self._set_meta(_DEVICES_ID, str(uuid.uuid4()))  # the remembered rows: not these

    def forgotten(self) -> frozenset[str]:
        """The devices `forget` was told about whose branch no compile has started anew."""
        return frozenset(self._forgotten())

    def _forgotten(self) -> set[str]:
        text = self._meta(FORGOTTEN_KEY)
        return set(json.loads(text)) if text else set()

    def intents(self) -> dict[str, IntentRecord]:
        rows = self._db.execute("SELECT name, digest, app_id, app_version, app_digest, "
                                "placement_digest FROM intents")
        return {r[0]: IntentRecord(*r) for r in rows}

    def devices(self) -> dict[str, DeviceRecord]:
        """Every device record (a dict of the caller's own).

        Remembered in this process while the state still names the id they were read or
        written with (`_DEVICES_ID`): a recompile in the same process (the fleet server,
        ``margo compile --watch``) does not read 100,000 rows again, nor a compile the
        rows `trusted_digests` read just before."""
        return dict(self._remembered_records().records)

    def device_records(self) -> tuple[dict[str, DeviceRecord], dict[str, str], int]:
        """`devices`, each device's capability digest (what `trusted_digests` gives) and
        the deployments of all records summed, from one read (dicts of the caller's own):
        what a compile that skips most devices needs without a Python step per device."""
        remembered = self._remembered_records()
        return dict(remembered.records), dict(remembered.digests), remembered.deployments

    def _remembered_records(self) -> DeviceRecords[DeviceRecord]:
        """The records as this process remembers them, read again unless the state still
        names the id they were remembered under (read in one transaction with the rows)."""
        with self._reading():
            version = self._records_version()
            remembered = _RECORDS.get(self.path, version[0] and version)
            if remembered is None:
                rows = self._db.execute("SELECT device_id, caps_digest, compiled_at, tree, "
                                        "deployments FROM devices").fetchall()
                remembered = DeviceRecords.of_rows(rows, _new_device_record)
                _RECORDS.put(self.path, version[0] and version, remembered)  # (no id: not)
        return remembered

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """One read transaction (unless one is open already): what is read in it is one
        state, whatever other writers commit meanwhile."""
        if self._db.in_transaction:
            yield
            return
        self._db.execute("BEGIN")
        try:
            yield
        finally:
            self._db.execute("COMMIT")

    def _records_version(self) -> tuple[str | None, int]:
        """What names the device rows as they are: their id (`_DEVICES_ID`), and SQLite's
        schema version, which dropping the table (a reset by any writer) changes."""
        schema_version = self._db.execute("PRAGMA schema_version").fetchone()[0]
        return self._meta(_DEVICES_ID), int(schema_version)

    def devices_in_grace(self) -> set[str]:
        """Devices with a deployment kept for a grace period (re-evaluated every compile)."""
        # Not DISTINCT: SQLite would then walk the whole table in key order instead of
        # the few rows of the partial index (12 ms on 55,000 placements).
        rows = self._db.execute("SELECT device_id FROM placements "
                                "WHERE ineligible_since IS NOT NULL")
        return {r[0] for r in rows}

    def waiting(self, *, held: bool = False) -> dict[str, list[str]]:
        """Device -> the intents that wait for capacity there (as of the last compile); with
        `held`, the placed ones whose change is held for capacity instead."""
        out: dict[str, list[str]] = {}
        for device_id, intent in self._db.execute(
                "SELECT device_id, intent FROM placements WHERE waiting = 1 AND deployed = ? "
                "ORDER BY device_id, intent", (int(held),)):
            out.setdefault(device_id, []).append(intent)
        return out

    def devices_placed_by(self, intents: Iterable[str]) -> set[str]:
        """Devices that any of these intents targeted at the last compile: read from the index
        alone (`placements_of_intent`; one on the intent only, before, had SQLite read every
        row for its device id: 16 -> 3 ms for 9,752 rows)."""
        query = "SELECT device_id FROM placements WHERE intent=?"
        return {row[0] for name in intents for row in self._db.execute(query, (name,))}

    def placements_of(self, device_ids: Iterable[str]) -> dict[str, dict[str, PlacementRecord]]:
        """`placements_for` of many devices at once (one query per 500 devices instead of
        one per device); every device asked for is in the result."""
        ids = list(dict.fromkeys(device_ids))
        out: dict[str, dict[str, PlacementRecord]] = {device_id: {} for device_id in ids}
        for record in _placements(self._rows_of_devices(_PLACEMENT_COLUMNS, "placements",
                                                         ids)):
            out[record[0]][record[1]] = record
        return out

    def trees_of(self, device_ids: Iterable[str]) -> dict[str, tuple[str, dict[str, str]]]:
        """Device id -> (the commit its branch was left at, that commit's files as name ->
        blob id), for the devices asked for that have one recorded (one query per 500)."""
        return {device_id: (tip, json.loads(files))
                for device_id, (tip, files) in self.tree_texts_of(device_ids).items()}

    def tree_texts_of(self, device_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        """`trees_of` with the files' JSON text, decoded by each device's own compile."""
        return {device_id: (tip, files) for device_id, tip, files in self._rows_of_devices(
            "device_id, tip, files", "device_trees", list(dict.fromkeys(device_ids)))}

    def _rows_of_devices(self, columns: str, table: str, ids: list[str]) -> list[Any]:
        """``SELECT columns FROM table`` for these devices, 500 ids per query (SQLite's
        limit on bound parameters is at least 999), gathered in C rather than yielded
        (a generator step for each of the 50,000 rows of a recompile of 10,000 devices)."""
        rows: list[Any] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            rows += self._reader().execute(
                f"SELECT {columns} FROM {table} "
                f"WHERE device_id IN ({','.join('?' * len(chunk))})", chunk)
        return rows

    def _reader(self) -> sqlite3.Connection:
        """`_rows_of_devices`'s connection; in a process forked since (a compile's worker), one
        of its own that never creates the file: SQLite's must not cross `fork` (nor libgit2's,
        `DeviceStore`), so the inherited one is left untouched there."""
        pid = os.getpid()
        if pid != self._pid and pid not in self._forked:
            self._forked[pid] = sqlite3.connect(f"{self.path.absolute().as_uri()}?mode=rw",
                                                uri=True, isolation_level=None)
        return self._db if pid == self._pid else self._forked[pid]

    def placements_for(self, device_id: str) -> dict[str, PlacementRecord]:
        rows = self._db.execute(f"SELECT {_PLACEMENT_COLUMNS} FROM placements "
                                "WHERE device_id=?", (device_id,))
        return {record[1]: record for record in _placements(rows.fetchall())}

    @collection_paused()  # 20,000 rows become objects that live through the compile
    def trusted_digests(self) -> TrustedDigests:
        """Device id -> digest of the capability document last compiled successfully
        (documents with that exact content need not be validated again), carrying the
        memo of the keyed snapshot file last compiled (see `load_snapshot`)."""
        remembered = self._remembered_records()
        return TrustedDigests(remembered.digests, self.snapshot_memo(), source=remembered)

    def records_are_those_of(self, trusted: TrustedDigests) -> bool:
        """Whether the device records are still those `trusted` was made from (by
        `trusted_digests`), so `device_records` gives exactly its digests: a compile that
        found every document trusted then knows every device is recorded as it is, without
        comparing a million digests a second time. The remembered records are replaced,
        never changed, whenever the state is written (`_remembered_records`)."""
        return trusted.source is not None and trusted.source is self._remembered_records()

    def snapshot_memo(self) -> SnapshotMemo | None:
        """The memo saved by the last compile, or None when it read no keyed file.

        Remembered in this process under the random id it was saved with (`_MEMO_ID`):
        while the state still names that id, its rows are the ones remembered, and the
        100,000 rows of a large fleet (0.1 s) are not read again on every recompile."""
        key = self._meta("snapshot")
        if key is None:
            return None
        memo_id = self._meta(_MEMO_ID)
        remembered = _MEMO.get(self.path, memo_id and (memo_id, key))
        if remembered is not None:
            return remembered
        memo = self._read_memo(key)
        if memo_id is not None and self._meta(_MEMO_ID) == memo_id:  # not replaced meanwhile
            _MEMO.put(self.path, (memo_id, key), memo)
        return memo

    def _read_memo(self, key: str) -> SnapshotMemo:
        """The memo's rows, as saved with `key`."""
        digests: dict[str, str] = {}
        spans: dict[str, tuple[int, int]] = {}
        plain: list[str] = []
        for device_id, digest, start, end, is_plain in self._db.execute(
                "SELECT device_id, digest, start, end, plain FROM snapshot_documents"):
            if digest is not None:
                digests[device_id] = digest
            if start is not None:
                spans[device_id] = (start, end)
            if is_plain:
                plain.append(device_id)
        return SnapshotMemo(key, digests, spans, frozenset(plain))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def save(self, *, intents: Iterable[IntentRecord], forget_intents: Iterable[str],
             devices: Iterable[DeviceRecord], placements: Iterable[PlacementRecord],
             forget_devices: Iterable[str], snapshot: SnapshotMemo | None = None,
             trees: Mapping[str, tuple[str, str | Mapping[str, str]]] | None = None,
             dropped_placements: Iterable[tuple[str, str]] | None = None) -> None:
        """Record one compile's outcome atomically. `devices` lists the devices whose
        placements are replaced by `placements`; `forget_devices` must be fully recompiled
        next time (e.g. they had errors). `snapshot` is the memo of the keyed capability
        file this compile read (None: it read none, and no memo is kept)."""
        self.stage(intents=intents, forget_intents=forget_intents, devices=devices,
                   placements=placements, forget_devices=forget_devices,
                   snapshot=snapshot, trees=trees,
                   dropped_placements=dropped_placements).commit()

    def stage(self, *, intents: Iterable[IntentRecord], forget_intents: Iterable[str],
              devices: Iterable[DeviceRecord], placements: Iterable[PlacementRecord],
              forget_devices: Iterable[str], snapshot: SnapshotMemo | None = None,
              trees: Mapping[str, tuple[str | None, str | Mapping[str, str]]] | None = None,
              dropped_placements: Iterable[tuple[str, str]] | None = None,
              restarted: Iterable[str] = (),
              ) -> StagedSave:
        """`save`, with its transaction left open until the handle is committed or rolled
        back: a compile writes its records while Git moves the branches and commits them
        only if that succeeded. No other use of this state until then.

        `trees` gives, for devices of `devices`, the commit their branch is left at and its
        files; a device of `devices` or `forget_devices` without one has none recorded.
        A tip of None is given later (`StagedSave.record_tips`): what a compile stages
        while Git still finishes writing its commits (`DeviceStore.write_objects`).
        `restarted` are devices this compile gave a branch with no parent: no longer
        `forgotten`.

        `dropped_placements` lists the placement rows (device id, intent) to delete, and
        `placements` are then only the rows to write, the others of `devices` kept (None:
        all are replaced). Why: a recompile for one intent keeps every placement, and
        rewriting them was most of its save; the compile tells which rows changed where
        each device compiles (`compiler.device_compile.placement_changes`).

        The same in parts: `begin_stage`."""
        staging = self.begin_stage(snapshot)
        try:
            staging.write_devices(list(devices), placements, trees or {}, dropped_placements)
        except BaseException:
            staging.rollback()
            raise
        return staging.stage(intents=intents, forget_intents=forget_intents,
                             forget_devices=forget_devices, restarted=restarted)

    def begin_stage(self, snapshot: SnapshotMemo | None = None) -> StagingSave:
        """`stage` in parts, in one transaction opened now: the device rows as a compile
        accounts its devices (`StagingSave.write_devices`), then the rest
        (`StagingSave.stage`). `snapshot` is saved now."""
        return StagingSave(self, snapshot)

    def _finish_devices(self, written: list[DeviceRecord], forget: list[tuple[str]],
                        before: tuple[str | None, int]) -> None:
        """After `written` were written (`StagingSave.write_devices`), delete the records
        of `forget` (a device in both ends deleted) and name the rows anew
        (`_DEVICES_ID`). Rows this process remembered as of `before` (`_records_version`
        when the transaction began) are remembered with the changes applied, under that id:
        valid once the transaction commits, and never if it is rolled back (the id with
        it)."""
        if not written and not forget and before[0] is not None:
            return  # the rows stay as the id names them
        base = _RECORDS.get(self.path, before[0] and before)
        self._db.executemany("DELETE FROM devices WHERE device_id=?", forget)
        records_id = str(uuid.uuid4())
        self._set_meta(_DEVICES_ID, records_id)
        if base is None:
            _RECORDS.forget()
        else:
            _RECORDS.put(self.path, (records_id, before[1]),
                         base.changed(written, [d for (d,) in forget], DeviceRecord))

    def _save_memo(self, db: sqlite3.Connection, memo: SnapshotMemo | None) -> None:
        """Replace the memo unless it is the one already saved (the same bytes give the same
        digests, so rewriting 10,000 rows would change nothing)."""
        if memo is not None and memo.key == self._meta("snapshot"):
            if self._meta(_MEMO_ID) is None:  # saved by a compiler that wrote no id
                self._set_meta(_MEMO_ID, str(uuid.uuid4()))
            return
        db.execute("DELETE FROM snapshot_documents")
        db.execute("DELETE FROM meta WHERE key IN ('snapshot', ?)", (_MEMO_ID,))
        if memo is not None:
            spans, plain = memo.spans, memo.plain
            db.executemany("INSERT INTO snapshot_documents VALUES (?, ?, ?, ?, ?)",
                           [(d, memo.digests.get(d), *spans.get(d, (None, None)), d in plain)
                            for d in sorted(memo.digests.keys() | spans.keys())])
            self._set_meta("snapshot", memo.key)
            memo_id = str(uuid.uuid4())
            self._set_meta(_MEMO_ID, memo_id)
            _MEMO.put(self.path, (memo_id, memo.key), memo)  # used once committed (the id)


#: The device records this process last read or wrote, under their `_records_version`.
_RECORDS: Remembered[DeviceRecords[DeviceRecord]] = Remembered()


#: The meta key of a random id written with every memo saved (`snapshot_memo`).
_MEMO_ID = "snapshot_id"
#: The memo this process last read or saved, under its `_MEMO_ID` (and key).
_MEMO: Remembered[SnapshotMemo] = Remembered()


def _write_trees(db: sqlite3.Connection, rows: Iterable[tuple[str, str, str]],
                 deleted: list[tuple[str]]) -> None:
    """Delete the tree rows of `deleted`, then write `rows` (device id, tip, files' JSON)."""
    db.executemany("DELETE FROM device_trees WHERE device_id=?", deleted)
    db.executemany(_UPSERT_TREE, rows)


class StagingSave:
    """A compile's records being written into one open transaction of the state
    (`CompilerState.begin_stage`): the rows of its devices batch by batch as the compile
    accounts them (`write_devices`), then the rest (`stage`), which leaves the
    `StagedSave` to commit.

    Why in parts: at 100,000 devices SQLite takes about 3 s to write their rows; written
    after the last device compiled, they took one core while the other waited; written
    while the devices compile, they share both (`compiler.writing`)."""

    def __init__(self, state: CompilerState, snapshot: SnapshotMemo | None) -> None:
        self._state, self._db = state, state._db
        self._db.execute("BEGIN IMMEDIATE")
        self.pending = True
        try:
            #: Read before any row's trigger deletes the records' id (`_finish_devices`).
            self._before = state._records_version()
            state._save_memo(self._db, snapshot)
        except BaseException:
            self.rollback()
            raise
        self._written: list[DeviceRecord] = []
        self._tipped: set[str] = set()  # devices whose tree row was written with a tip
        self._later: dict[str, str | Mapping[str, str]] = {}

    def write_devices(self, devices: list[DeviceRecord], placements: Iterable[PlacementRecord],
                      trees: Mapping[str, tuple[str | None, str | Mapping[str, str]]],
                      dropped: Iterable[tuple[str, str]] | None) -> None:
        """Write these devices' records, placements and trees (as `CompilerState.stage`
        says); a tree whose tip is None waits for `StagedSave.record_tips`."""
        if not self.pending:
            raise RuntimeError("this save was already staged or rolled back")
        db = self._db
        if dropped is None:
            db.executemany("DELETE FROM placements WHERE device_id=?",
                           [(d.device_id,) for d in devices])
        else:
            db.executemany("DELETE FROM placements WHERE device_id=? AND intent=?", dropped)
        db.executemany(_UPSERT_DEVICE,
                       ((d.device_id, d.caps_digest, d.compiled_at, d.tree, d.deployments)
                        for d in devices))
        db.executemany(_UPSERT_PLACEMENT,  # (rows generated: 5.4 million at 1M devices)
                       ((p.device_id, p.intent, int(p.eligible), int(p.deployed),
                         p.ineligible_since, p.profile, int(p.waiting)) for p in placements))
        tipped = [(d, tip, _text_of(files)) for d, (tip, files) in trees.items()
                  if tip is not None]
        _write_trees(db, tipped, [(d.device_id,) for d in devices if d.device_id not in trees])
        self._tipped.update(d for d, _, _ in tipped)
        self._later.update((d, files) for d, (tip, files) in trees.items() if tip is None)
        self._written.extend(devices)

    def stage(self, *, intents: Iterable[IntentRecord], forget_intents: Iterable[str],
              forget_devices: Iterable[str], restarted: Iterable[str] = ()) -> StagedSave:
        """Write the rest (as `CompilerState.stage` says); the save to commit."""
        if not self.pending:
            raise RuntimeError("this save was already staged or rolled back")
        state, db = self._state, self._db
        try:
            restarted = set(restarted)
            if restarted:  # read inside the transaction: `forget` may have marked more
                marked = state._forgotten()
                if marked & restarted:
                    state._set_meta(FORGOTTEN_KEY, json.dumps(sorted(marked - restarted)))
            db.executemany("INSERT OR REPLACE INTO intents VALUES (?, ?, ?, ?, ?, ?)",
                           [(i.name, i.digest, i.app_id, i.app_version, i.app_digest,
                             i.placement_digest) for i in intents])
            db.executemany("DELETE FROM intents WHERE name=?", [(n,) for n in forget_intents])
            forget = [(d,) for d in forget_devices]
            state._finish_devices(self._written, forget, self._before)
            # A forgotten device's tree written with its tip stays (as it always has).
            _write_trees(db, (), [f for f in forget if f[0] not in self._tipped])
        except BaseException:
            self.rollback()
            raise
        self.pending = False
        return StagedSave(db, self._later)

    def rollback(self) -> None:
        if self.pending:
            self.pending = False
            self._db.execute("ROLLBACK")


class StagedSave:
    """A compile's records written but not yet committed (see `CompilerState.stage`)."""

    def __init__(self, db: sqlite3.Connection,
                 later: Mapping[str, str | Mapping[str, str]] | None = None) -> None:
        self._db: sqlite3.Connection | None = db
        #: device id -> its tree's files (their JSON, as a compile gives them), staged
        #: without a tip
        self._later = later or {}

    def record_tips(self, tips: Mapping[str, str]) -> None:
        """Write the trees staged without a tip at theirs in `tips` (a device with none
        there has no tree recorded, as `stage` does); rolled back if that fails."""
        if self._db is None:
            raise RuntimeError("this save was already committed or rolled back")
        later, self._later = self._later, {}
        try:
            _write_trees(self._db, ((d, tips[d], _text_of(tree))
                                    for d, tree in later.items() if d in tips),
                         [(d,) for d in later if d not in tips])
        except BaseException:
            self.rollback()
            raise

    @property
    def pending(self) -> bool:
        """Neither committed nor rolled back yet."""
        return self._db is not None

    def commit(self) -> None:
        if self._later:  # it would keep the old tips of trees staged without one
            self.rollback()
            raise RuntimeError("trees staged without a tip were not given one")
        self._end("COMMIT")

    def rollback(self) -> None:
        self._end("ROLLBACK")

    def _end(self, statement: str) -> None:
        if self._db is None:
            raise RuntimeError("this save was already committed or rolled back")
        db, self._db = self._db, None
        db.execute(statement)
