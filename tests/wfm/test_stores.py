"""The two stores behind one set of record functions: SQLite and a real PostgreSQL server
(a private cluster from Debian's packages). Migrations, group commit, the record functions,
and what happens when PostgreSQL goes away and comes back."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import psycopg
import pytest

from tools.postgres import PostgresServer
from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import Connection, Database, DatabaseUnavailable
from wfm.store.opening import open_database
from wfm.store.pgdb import translate
from wfm.store.schema import MIGRATIONS, SchemaTooNew, schema_version
from wfm.store.sqlitedb import SqliteDatabase

DOC = {"properties": {"id": "edge-1", "vendor": "Example"}}


def test_the_record_functions_read_back_what_they_wrote(store: Database) -> None:
    clients = ClientRegistry(store)
    client_id, token = clients.add("plant-a")
    assert clients.by_token(token) is not None
    written = store.write_sync(lambda c: records.store_capabilities(
        c, client_id=client_id, device_id="edge-1", document=DOC, digest="sha256:1",
        shape="rc.3"))
    assert (written.created, written.changed) == (True, True)
    again = store.write_sync(lambda c: records.store_capabilities(
        c, client_id=client_id, device_id="edge-1", document=DOC, digest="sha256:1",
        shape="rc.3"))
    assert (again.created, again.changed) == (False, False)
    row = store.read(lambda c: records.device_row(c, "edge-1"))
    assert row is not None and row.document == DOC and row.reported_at > 1.7e9
    assert store.read(lambda c: records.client_devices(c, client_id)) == ("edge-1",)
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:a")) == 1
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:a")) == 1
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:b")) == 2
    # Given generation 5's state, the client is not handed generation 4's (another).
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:c", 5)) == 3
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:b", 4)) is None
    assert store.write_sync(lambda c: records.advance_manifest_version(
        c, client_id, "sha256:c", 4)) == 3  # the same state, from a replica behind: fine
    status = store.write_sync(lambda c: records.store_status(
        c, client_id=client_id, deployment_id="d-1", device_id="edge-1", state="installed",
        document={"status": {"state": "installed"}}, digest="sha256:s", adopted=2))
    assert status.created
    history = store.read(lambda c: c.execute(
        "SELECT state FROM status_reports WHERE deployment_id = ?", ("d-1",)).fetchall())
    assert [tuple(r) for r in history] == [("installed",)]
    assert store.write_sync(lambda c: records.forget_device(c, client_id, "edge-1")) is True


def test_polls_and_git_handouts_are_stored_a_batch_at_a_time(store: Database) -> None:
    """One statement per batch (`executemany`), and on PostgreSQL inside the writer's
    pipeline: each row is written, an unknown interval keeps the stored one, a handout
    replaces the device's previous one, and a batch beside them keeps its own outcome."""
    clients = ClientRegistry(store)
    ids = [clients.add(f"plant-{n}")[0] for n in range(3)]
    store.write_sync(lambda c: records.record_polls(
        c, {ids[0]: (100.0, 15.0), ids[1]: (101.0, 60.0)}))
    store.write_sync(lambda c: records.record_polls(
        c, {ids[0]: (200.0, None), ids[2]: (202.0, 30.0)}))
    polls = store.read(records.client_polls)
    assert [polls[i] for i in ids] == [(200.0, 15.0), (101.0, 60.0), (202.0, 30.0)]
    store.write_sync(lambda c: records.record_git_handouts(
        c, {"edge-1": ("a" * 40, 10.0), "edge-2": ("b" * 40, 11.0)}))
    writes = [store.submit(lambda c: records.record_git_handouts(
        c, {"edge-1": ("c" * 40, 12.0), "edge-3": ("d" * 40, 13.0)}))]
    writes.append(store.submit(lambda c: c.execute("SELECT * FROM no_such_table")))
    assert writes[0].result(timeout=30) is None
    with pytest.raises(Exception, match="no_such_table"):
        writes[1].result(timeout=30)
    handouts = store.read(lambda c: {d: records.git_handout_at(c, d)
                                     for d in ("edge-1", "edge-2", "edge-3")})
    assert handouts == {"edge-1": ("c" * 40, 12.0), "edge-2": ("b" * 40, 11.0),
                        "edge-3": ("d" * 40, 13.0)}


def test_manifest_history_is_read_for_many_clients_at_once(store: Database) -> None:
    """`manifest_contents_of`: one query for the fleet-wide views, the same answers as one
    `manifest_contents` per client; the history is trimmed to the last HISTORY_VERSIONS
    (and at most ten more)."""
    clients = ClientRegistry(store)
    ids = [clients.add(f"plant-{i}")[0] for i in range(3)]
    for n, client_id in enumerate(ids):
        for version in range(1, 4 + 60 * (n == 0)):
            store.write_sync(lambda c, v=version, i=client_id: records.advance_manifest_version(
                c, i, f"sha256:{v}", 0, {"d-1": f"sha256:{v}"}))
    wanted = [(ids[0], 63), (ids[0], 1), (ids[1], 2), (ids[1], 3), (ids[2], 9), ("nobody", 1)]
    found = store.read(lambda c: records.manifest_contents_of(c, wanted))
    assert found == {ids[0]: {63: {"d-1": "sha256:63"}},
                     ids[1]: {2: {"d-1": "sha256:2"}, 3: {"d-1": "sha256:3"}}}
    for client_id, version in wanted:
        one = store.read(lambda c, i=client_id, v=version: records.manifest_contents(c, i, {v}))
        assert one == ({version: found[client_id][version]}
                       if version in found.get(client_id, {}) else {})
    kept = store.read(lambda c: c.execute(
        "SELECT COUNT(*) FROM manifest_history WHERE client_id = ?", (ids[0],)).fetchone()[0])
    assert records.HISTORY_VERSIONS <= kept <= records.HISTORY_VERSIONS + 10


def test_one_bad_write_does_not_sink_its_batch(store: Database) -> None:
    ClientRegistry(store).add("plant-a")
    good = [store.submit(lambda c, i=i: c.execute(
        "INSERT INTO access_tokens VALUES (?, ?, ?)", (f"t{i}", "plant-a", 1.0)).rowcount)
        for i in range(20)]
    bad = store.submit(lambda c: c.execute("INSERT INTO nowhere VALUES (1)"))
    assert [f.result(timeout=10) for f in good] == [1] * 20
    with pytest.raises((sqlite3.OperationalError, psycopg.errors.UndefinedTable)):
        bad.result(timeout=10)
    assert store.read(lambda c: c.execute("SELECT COUNT(*) FROM access_tokens")
                      .fetchone()[0]) == 20


def test_each_write_of_a_batch_keeps_its_own_outcome(store: Database) -> None:
    """Wherever a failure falls in one batch, it is that write's alone: an SQL error
    between a write's statements (PostgreSQL's writer sends a write's statements without
    waiting for each answer, so the error arrives after the next statement was sent), an
    exception raised after a write's statements ran; and a row count read inside a write
    is the statement's own, not one still on its way."""
    ClientRegistry(store).add("plant-a")

    def token(conn: Connection, name: str) -> int:
        return conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)",
                            (name, "plant-a", 1.0)).rowcount

    def sql_error_midway(conn: Connection) -> None:
        token(conn, "half-1")
        conn.execute("INSERT INTO nowhere VALUES (1)")
        token(conn, "half-2")

    def sql_error_then_read(conn: Connection) -> None:
        conn.execute("INSERT INTO nowhere VALUES (3)")
        conn.execute("SELECT COUNT(*) FROM access_tokens").fetchone()

    def sql_error_last(conn: Connection) -> None:
        token(conn, "last-1")
        conn.execute("INSERT INTO nowhere VALUES (2)")

    def refused_after_writing(conn: Connection) -> None:
        token(conn, "refused")
        raise ValueError("refused after writing")

    def counted(conn: Connection) -> int:
        token(conn, "c-1")
        token(conn, "c-2")
        return conn.execute("UPDATE access_tokens SET expires_at = 2.0 WHERE client_id = ? "
                            "AND token_hash LIKE 'c-%'", ("plant-a",)).rowcount

    release = threading.Event()
    first = store.submit(lambda conn: release.wait(10))  # the rest queue behind it: one batch
    futures = [store.submit(lambda c: token(c, "before")), store.submit(sql_error_midway),
               store.submit(lambda c: token(c, "between")), store.submit(sql_error_last),
               store.submit(refused_after_writing), store.submit(counted),
               store.submit(sql_error_then_read), store.submit(lambda c: token(c, "after"))]
    release.set()
    assert first.result(timeout=10)
    for failed in (futures[1], futures[3], futures[6]):
        with pytest.raises((sqlite3.OperationalError, psycopg.errors.UndefinedTable)):
            failed.result(timeout=10)
    with pytest.raises(ValueError, match="refused after writing"):
        futures[4].result(timeout=10)
    assert [futures[i].result(timeout=10) for i in (0, 2, 5, 7)] == [1, 1, 2, 1]
    assert store.read(lambda c: sorted(row[0] for row in c.execute(
        "SELECT token_hash FROM access_tokens"))) == ["after", "before", "between", "c-1",
                                                      "c-2"]


def test_placeholders_are_translated_outside_quoted_text() -> None:
    assert translate("SELECT '?', x FROM t WHERE a = ? AND b LIKE '%z' AND c = ?") == (
        "SELECT '?', x FROM t WHERE a = %s AND b LIKE '%%z' AND c = %s")
    assert translate('SELECT "we?ird" FROM t WHERE x % 2 = ?') == (
        'SELECT "we?ird" FROM t WHERE x %% 2 = %s')


def test_a_data_directory_from_before_migrations_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "wfm.sqlite"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE clients (client_id TEXT PRIMARY KEY, token_hash TEXT UNIQUE,
            certificate TEXT, created_at REAL NOT NULL, retired INTEGER NOT NULL DEFAULT 0,
            manifest_version INTEGER NOT NULL DEFAULT 0,
            manifest_state TEXT NOT NULL DEFAULT '');
        INSERT INTO clients (client_id, created_at, manifest_version) VALUES ('a', 1, 7);
    """)
    old.close()
    db = SqliteDatabase(path)
    try:
        assert db.read(schema_version) == MIGRATIONS[-1].version
        assert db.read(lambda c: records.manifest_version(c, "a")) == (7, "")
        assert db.read(lambda c: c.execute(
            "SELECT manifest_generation FROM clients").fetchone()[0]) == 0
    finally:
        db.close()
    SqliteDatabase(path).close()  # opening again applies nothing twice


def test_a_database_migrated_by_a_newer_server_is_refused(store: Database,
                                                          tmp_path: Path) -> None:
    newer = MIGRATIONS[-1].version + 1
    store.write_sync(lambda c: c.execute(
        "INSERT INTO schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
        (newer, "from the future", 0.0)))
    target = getattr(store, "url", None) or getattr(store, "path", None)
    with pytest.raises(SchemaTooNew, match=f"schema version {newer}, migrated by a newer"):
        open_database(target)


def test_postgresql_gone_is_unavailable_and_back_is_served(postgres: PostgresServer,
                                                           pg_url: str) -> None:
    db = open_database(pg_url)
    try:
        ClientRegistry(db).add("plant-a")
        postgres.stop(mode="immediate")
        with pytest.raises(DatabaseUnavailable):
            db.read(lambda c: records.client_devices(c, "plant-a"))
        with pytest.raises(DatabaseUnavailable):
            db.write_sync(lambda c: records.advance_manifest_version(c, "plant-a", "s"))
        postgres.start()
        assert db.write_sync(lambda c: records.advance_manifest_version(
            c, "plant-a", "s")) == 1
        assert db.read(lambda c: records.manifest_version(c, "plant-a")) == (1, "s")
    finally:
        db.close()


def test_bulk_marks_and_refs_upsert_alike_on_both_engines(store: Database,
                                                          tmp_path: Path) -> None:
    """A compile's lead-time marks (PostgreSQL: through COPY beyond a few hundred) and a
    publication's refs (statements of several hundred) land whole, and writing them again
    updates each row in place, twice in one transaction included."""
    from wfm.store import lead_rows, replica_rows

    def marks(commit: str) -> list[tuple[object, ...]]:
        return [(f"dep-{i:05d}", f"dev-{i // 5:05d}", commit, 1.0 + i, 2.0 + i, "push",
                 None if i % 2 else f"trace-{i}") for i in range(1_234)]

    store.write_sync(lambda conn: lead_rows.store_marks(conn, marks("a" * 40), 0))

    def twice(conn: Connection) -> None:  # a batch may hold two compiles' writes
        lead_rows.store_marks(conn, marks("b" * 40)[:700], 0)
        lead_rows.store_marks(conn, marks("c" * 40)[500:], 0)
    store.write_sync(twice)
    wanted = [f"dep-{i:05d}" for i in (0, 499, 500, 699, 700, 1_233)]
    found = store.read(lambda conn: lead_rows.marks_of(conn, wanted))
    assert {d: m[1][0] for d, m in found.items()} == {
        "dep-00000": "b", "dep-00499": "b", "dep-00500": "c", "dep-00699": "c",
        "dep-00700": "c", "dep-01233": "c"}
    assert found["dep-00500"] == ("dev-00100", "c" * 40, 501.0, 502.0, "push", "trace-500")
    assert found["dep-00699"][5] is None
    assert store.read(lambda conn: conn.execute(
        "SELECT COUNT(*) FROM lead_marks").fetchone()[0]) == 1_234
    # Taken in statements of 300: a mark of other bytes stays, the same mark twice is
    # taken once, a mark nobody holds is not taken.
    taking = [("dep-00000", "b" * 40), ("dep-00001", "a" * 40), ("dep-00000", "b" * 40),
              ("dep-01200", "c" * 40), ("dep-09999", "c" * 40),
              *((f"dep-{i:05d}", "c" * 40) for i in range(700, 1_100))]
    taken = store.write_sync(lambda conn: lead_rows.consume_marks(conn, taking))
    assert taken[:5] == [True, False, False, True, False] and all(taken[5:])
    assert store.read(lambda conn: lead_rows.marks_of(conn, ["dep-00001", "dep-01200"])) \
        .keys() == {"dep-00001"}
    assert store.read(lambda conn: conn.execute(
        "SELECT COUNT(*) FROM lead_marks").fetchone()[0]) == 1_234 - 2 - 400

    refs: dict[str, str | None] = {f"refs/heads/devices/d{i:05d}": f"{i:040x}"
                                   for i in range(1_201)}
    refs["refs/heads/devices/gone"] = None
    store.write_sync(lambda conn: replica_rows.publish_rows(conn, "devices", 1, b"pack", refs,
                                                            compact=False))
    moved = {"refs/heads/devices/d00007": "f" * 40, "refs/heads/devices/d01200": None}
    store.write_sync(lambda conn: replica_rows.publish_rows(conn, "devices", 2, b"", moved,
                                                            compact=False))
    published = store.read(lambda conn: replica_rows.read_snapshot(
        conn, "devices", -1, dialect=store.dialect, spool=tmp_path))
    assert published.generation == 0  # (the counter is set by the caller)
    rows = store.read(lambda conn: dict(conn.execute(
        "SELECT name, generation FROM git_refs WHERE repo = ?", ("devices",)).fetchall()))
    assert len(rows) == 1_202 and rows["refs/heads/devices/d00007"] == 2
    assert store.read(lambda conn: replica_rows.published_ref(
        conn, "devices", "refs/heads/devices/d01200")) == (None, 2)
    assert store.read(lambda conn: replica_rows.published_ref(
        conn, "devices", "refs/heads/devices/d00006")) == (f"{6:040x}", 1)
