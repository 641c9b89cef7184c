"""The database writer survives every error outside a single write (issue 15).

Another process holding SQLite's write lock (`BEGIN IMMEDIATE`) longer than the busy
timeout used to kill the writer thread, after which every durable write hung forever while
`/healthz` still answered 200. Now the writes waiting behind the lock are answered 503 with
`Retry-After`, the writer goes on with the next batch, `/readyz` says "not ready" while the
store cannot be written and "ready" again once it can, and a writer that did stop makes
writes fail at once instead of hanging.

Everything runs on real SQLite files, locked by a real second process. One test needs a
fault real SQLite cannot be made to produce on demand (an unexpected exception type out of
`BEGIN` or `COMMIT`); it wraps the real connection and says so.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import ROOT, add_client, running_server

from tools.polling import poll_until
from tools.postgres import PostgresServer
from wfm.fleet.lastseen import PollClock
from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import DatabaseUnavailable
from wfm.store.opening import open_database
from wfm.store.sqlitedb import SqliteDatabase

#: How long a test waits for any answer: far more than the busy timeouts used here, far
#: less than "forever" (the defect).
ANSWER_WITHIN = 15.0

#: Holds the write lock of the SQLite file argv[1] until its stdin closes.
_HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
conn.close()
"""


@contextmanager
def write_lock_held(path: Path) -> Iterator[Callable[[], None]]:
    """Another process holds `BEGIN IMMEDIATE` on `path` inside the block (or until the
    yielded `release` is called)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    stdin = holder.stdin

    def release() -> None:
        if not stdin.closed:
            stdin.close()
            assert holder.wait(timeout=ANSWER_WITHIN) == 0

    try:
        assert holder.stdout.readline().strip() == "locked"
        yield release
    finally:
        release()
        holder.stdout.close()


def insert_token(name: str) -> Callable[[Any], int]:
    def write(conn: Any) -> int:
        return int(conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)",
                                (name, "plant-a", 1.0)).rowcount)
    return write


def tokens(db: SqliteDatabase) -> set[str]:
    return {r[0] for r in db.read(lambda c: c.execute("SELECT token_hash FROM access_tokens")
                                  .fetchall())}


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteDatabase]:
    database = SqliteDatabase(tmp_path / "wfm.sqlite", busy_timeout=0.5)
    ClientRegistry(database).add("plant-a")
    try:
        yield database
    finally:
        database.close()


def test_a_write_behind_a_held_lock_is_refused_and_the_writer_goes_on(
        db: SqliteDatabase) -> None:
    assert db.readiness() is None
    with write_lock_held(db.path) as release:
        refused = db.submit(insert_token("during"))
        with pytest.raises(DatabaseUnavailable, match="locked"):
            refused.result(timeout=ANSWER_WITHIN)  # before the fix: no answer, ever
        reason = db.readiness()
        assert reason is not None and "locked" in reason
        release()
        assert db.readiness() is None  # the probe can write again: ready before any write
    assert db.submit(insert_token("after")).result(timeout=ANSWER_WITHIN) == 1
    assert tokens(db) == {"after"}
    assert db.readiness() is None


def test_a_cancelled_write_is_skipped_without_stopping_the_writer(tmp_path: Path) -> None:
    """A request that gives up (its task cancelled) while its write is still queued: the
    writer used to run it anyway, then die on `set_result` of the cancelled future."""
    db = SqliteDatabase(tmp_path / "wfm.sqlite", busy_timeout=ANSWER_WITHIN)
    ClientRegistry(db).add("plant-a")

    async def scenario(release: Callable[[], None]) -> None:
        # The first write keeps the writer in BEGIN IMMEDIATE behind the other process;
        # the second waits in the queue and is given up on there.
        first = db.submit(insert_token("first"))
        poll_until("the writer to wait for the lock", lambda: db._batch_started is not None,
                   timeout=ANSWER_WITHIN)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(db.write(insert_token("given-up")), timeout=0.1)
        release()
        assert first.result(timeout=ANSWER_WITHIN) == 1
        assert await asyncio.wait_for(db.write(insert_token("next")), ANSWER_WITHIN) == 1

    try:
        with write_lock_held(db.path) as release:
            asyncio.run(scenario(release))
        assert tokens(db) == {"first", "next"}  # the given-up write was not stored
    finally:
        db.close()


class _FaultyConnection:
    """A real SQLite connection whose statements listed in `faults` raise, once each.

    A test double, because real SQLite raises only `sqlite3` errors there: this stands for
    any error type the writer did not expect (a driver bug, a wrapper's own error)."""

    def __init__(self, conn: sqlite3.Connection, faults: dict[str, Exception]) -> None:
        self._conn, self._faults = conn, faults
        self.closed = False

    def execute(self, sql: str, parameters: Any = ()) -> sqlite3.Cursor:
        fault = self._faults.pop(sql, None)
        if fault is not None:
            raise fault
        return self._conn.execute(sql, parameters)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        fault = self._faults.pop(sql, None)
        if fault is not None:
            raise fault
        return self._conn.executemany(sql, rows)

    def close(self) -> None:
        self.closed = True
        self._conn.close()


class _FaultyDatabase(SqliteDatabase):
    """Real SQLite underneath; `faults` arms the next occurrence of a statement."""

    def __init__(self, path: Path) -> None:
        self.faults: dict[str, Exception] = {}
        self.connections: list[_FaultyConnection] = []
        super().__init__(path, busy_timeout=0.5)

    def _write_connection(self) -> Any:
        conn = _FaultyConnection(self._connect(), self.faults)
        self.connections.append(conn)
        return conn


@pytest.mark.parametrize("statement", ["BEGIN IMMEDIATE", "COMMIT"])
def test_an_unexpected_error_from_begin_or_commit_does_not_kill_the_writer(
        tmp_path: Path, statement: str) -> None:
    db = _FaultyDatabase(tmp_path / "wfm.sqlite")
    try:
        ClientRegistry(db).add("plant-a")
        db.faults[statement] = ValueError(f"unexpected trouble in {statement}")
        failed = db.submit(insert_token("faulted"))
        with pytest.raises(ValueError, match="unexpected trouble"):
            failed.result(timeout=ANSWER_WITHIN)  # before the fix: no answer, ever
        assert tokens(db) == set()  # nothing of the failed batch was committed
        assert db.connections[0].closed  # a connection in an unknown state is let go
        assert db.submit(insert_token("next")).result(timeout=ANSWER_WITHIN) == 1
        assert tokens(db) == {"next"}
        assert len(db.connections) == 2
        assert db.alive()
        assert db.readiness() is None  # not an outage: nothing to report as unready
    finally:
        db.close()


class _Fatal(BaseException):
    """Not an `Exception`: what a writer is not expected to catch and go on after."""


def test_a_writer_that_stopped_fails_writes_at_once(db: SqliteDatabase) -> None:
    def fatal(conn: Any) -> None:
        raise _Fatal("stop")

    with pytest.raises(_Fatal):
        db.submit(fatal).result(timeout=ANSWER_WITHIN)  # its own caller hears of it
    refused = db.submit(insert_token("later"))
    with pytest.raises(DatabaseUnavailable, match="writer stopped"):
        refused.result(timeout=1)  # at once: nobody is left to answer it
    reason = db.readiness()
    assert reason is not None and "writer stopped" in reason
    assert not db.alive()


def test_writes_after_close_fail_at_once(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "wfm.sqlite")
    db.close()
    with pytest.raises(DatabaseUnavailable, match="closed"):
        db.write_sync(insert_token("late"))


def test_polls_that_could_not_be_stored_are_kept_for_the_next_flush(
        db: SqliteDatabase) -> None:
    clock = PollClock(db, flush_every=3600)

    def last_poll() -> float | None:
        return db.read(records.client_polls)["plant-a"][0]

    with write_lock_held(db.path):
        clock.seen("plant-a", now=1000.0)
        clock.flush()
        poll_until("the refused flush", lambda: db.readiness() is not None,
                   timeout=ANSWER_WITHIN)
    poll_until("the kept poll to be stored", lambda: last_poll() == 1000.0,
               each=clock.flush, timeout=ANSWER_WITHIN)


def test_postgresql_away_is_not_ready_and_back_is_ready(postgres: PostgresServer,
                                                        pg_url: str) -> None:
    db = open_database(pg_url)
    try:
        ClientRegistry(db).add("plant-a")
        assert db.readiness() is None
        postgres.stop(mode="immediate")
        with pytest.raises(DatabaseUnavailable):
            db.submit(insert_token("away")).result(timeout=ANSWER_WITHIN)
        assert db.readiness() is not None  # the probe cannot reach it either
        assert db.alive()
        postgres.start()
        poll_until("ready again", lambda: db.readiness() is None, timeout=ANSWER_WITHIN)
        assert db.submit(insert_token("back")).result(timeout=ANSWER_WITHIN) == 1
    finally:
        db.close()


def test_the_server_answers_503_behind_a_held_lock_and_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARGO_SQLITE_BUSY_TIMEOUT", "1")  # the server inherits it
    data = tmp_path / "data"
    token = add_client(data, "edge")
    doc = json.loads((ROOT / "examples" / "capabilities" / "compose-box-amd64.json")
                     .read_text())
    path = f"/api/v1/capabilities/{doc['properties']['id']}"
    with running_server(data) as base, \
            httpx.Client(base_url=base, timeout=ANSWER_WITHIN,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.get("/readyz").status_code == 200
        with write_lock_held(data / "wfm.sqlite") as release:
            refused = http.put(path, json=doc)  # before the fix: a read timeout
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/problem+json"
            assert int(refused.headers["retry-after"]) > 0
            assert "retry later" in refused.json()["detail"]
            unready = http.get("/readyz")
            assert unready.status_code == 503
            assert unready.headers["content-type"] == "application/problem+json"
            assert "locked" in unready.json()["detail"]
            assert "retry-after" in unready.headers
            assert http.get("/healthz").status_code == 200  # alive: do not restart it
            assert http.get("/livez").status_code == 200
            release()
            poll_until("ready again", lambda: http.get("/readyz").status_code == 200,
                       timeout=ANSWER_WITHIN)
        assert http.put(path, json=doc).status_code == 201  # nothing was stored before
        assert http.put(path, json=doc).status_code == 200
