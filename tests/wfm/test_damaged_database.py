"""A damaged or lost server database is refused, never started over silently (issue 15:
"a 0-byte or deleted server database starts silently with no clients"). SQLite takes a
0-byte file, or none, for a new empty database; `wfm.store.sqlitedb.check_sqlite_file` and the real
`margo serve` refuse them with what happened and what to do, as they refuse a file that is
not a database or fails `PRAGMA quick_check`. `--new-database` starts over on purpose."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kits.processkit import free_port
from kits.serverkit import ROOT, add_client, running_server

from wfm.store.sqlitedb import DatabaseDamaged, SqliteDatabase, check_sqlite_file


def _database(path: Path, rows: int = 3000) -> None:
    """A healthy SQLite file of many pages."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE a (id INTEGER PRIMARY KEY, x TEXT)")
    conn.execute("CREATE INDEX ax ON a (x)")
    conn.executemany("INSERT INTO a (x) VALUES (?)", [(f"v{i}" * 20,) for i in range(rows)])
    conn.commit()
    conn.close()


def _damage_a_page(path: Path) -> None:
    """Garbage over a page of table rows (three quarters in: the filler's, not free space)."""
    page = path.stat().st_size // 4096 * 3 // 4
    with path.open("r+b") as file:
        file.seek(4096 * page + 100)
        file.write(os.urandom(3000))


def test_a_new_or_healthy_file_passes(tmp_path: Path) -> None:
    check_sqlite_file(tmp_path / "wfm.sqlite")  # none yet, nothing says one was there
    _database(tmp_path / "wfm.sqlite")
    check_sqlite_file(tmp_path / "wfm.sqlite", used_before=("repos/fleet-state.git",))


def test_an_empty_file_is_refused_by_the_check_and_by_the_store(tmp_path: Path) -> None:
    path = tmp_path / "wfm.sqlite"
    path.touch()
    with pytest.raises(DatabaseDamaged, match=r"empty \(0 bytes\).*restore it from a backup"):
        check_sqlite_file(path)
    with pytest.raises(DatabaseDamaged, match="empty"):
        SqliteDatabase(path)  # `margo clients add` must not make it a valid empty one
    assert path.stat().st_size == 0


def test_a_missing_file_is_refused_where_a_server_ran(tmp_path: Path) -> None:
    path = tmp_path / "wfm.sqlite"
    with pytest.raises(DatabaseDamaged, match=r"missing, but .* holds repos/fleet-state.git"):
        check_sqlite_file(path, used_before=("repos/fleet-state.git",))
    (tmp_path / "wfm.sqlite-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(28))
    with pytest.raises(DatabaseDamaged, match=r"write-ahead log wfm\.sqlite-wal is there"):
        check_sqlite_file(path)
    with pytest.raises(DatabaseDamaged, match="write-ahead log"):
        SqliteDatabase(path)
    assert not path.exists()


def test_garbage_and_a_damaged_page_are_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(os.urandom(20_000))
    with pytest.raises(DatabaseDamaged, match=r"unreadable .*not a database"):
        check_sqlite_file(garbage)
    with pytest.raises(DatabaseDamaged, match="unreadable"):
        SqliteDatabase(garbage)
    damaged = tmp_path / "damaged.sqlite"
    _database(damaged)
    _damage_a_page(damaged)
    with pytest.raises(DatabaseDamaged, match=r"corrupt .*move it .* aside"):
        check_sqlite_file(damaged)


def _serve(data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`margo serve` that is expected to refuse at once."""
    return subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "serve", "--port", str(free_port()),
         "--data", str(data), "--log-level", "warning", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_margo_serve_refuses_a_lost_database_and_starts_over_only_when_told(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "plant-a")
    with running_server(data) as base:
        assert httpx.get(f"{base}/api/v1/deployments", timeout=10,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200
    database = data / "wfm.sqlite"

    database.write_bytes(b"")  # a power cut before the file system wrote it
    refused = _serve(data)
    assert refused.returncode != 0
    assert "wfm.sqlite: the server's database is empty (0 bytes)" in refused.stderr
    assert "--new-database" in refused.stderr and "Traceback" not in refused.stderr
    assert database.stat().st_size == 0  # left as it was, for the operator

    database.unlink()
    for leftover in ("wfm.sqlite-wal", "wfm.sqlite-shm"):
        (data / leftover).unlink(missing_ok=True)
    refused = _serve(data)
    assert refused.returncode != 0
    assert "the server's database is missing" in refused.stderr
    assert "repos/fleet-state.git" in refused.stderr and "Traceback" not in refused.stderr
    assert not database.exists()

    with running_server(data, "--new-database") as base:  # on purpose: no clients
        assert httpx.get(f"{base}/api/v1/deployments", timeout=10,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 401
    with running_server(data) as base:  # the new database is the database now
        assert httpx.get(f"{base}/livez", timeout=10).status_code == 200


def test_margo_serve_refuses_a_corrupt_database(tmp_path: Path) -> None:
    data = tmp_path / "data"
    add_client(data, "plant-a")
    conn = sqlite3.connect(data / "wfm.sqlite")  # enough pages to damage one in the middle
    conn.execute("CREATE TABLE filler (id INTEGER PRIMARY KEY, x TEXT)")
    conn.execute("CREATE INDEX filler_x ON filler (x)")
    conn.executemany("INSERT INTO filler (x) VALUES (?)", [(f"v{i}" * 20,) for i in range(3000)])
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    _damage_a_page(data / "wfm.sqlite")
    refused = _serve(data)
    assert refused.returncode != 0
    # Random bytes over a page: quick_check lists the damage, or fails reading it; either
    # way the server refuses and says why.
    assert ("the server's database is corrupt" in refused.stderr
            or "the server's database is unreadable" in refused.stderr), refused.stderr
    assert "Traceback" not in refused.stderr
    (data / "wfm.sqlite").write_bytes(os.urandom(50_000))
    refused = _serve(data)
    assert "the server's database is unreadable" in refused.stderr, refused.stderr
