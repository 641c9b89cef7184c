"""One server per SQLite data directory: a second `margo serve` is refused at once, naming
the first; a crashed server does not block its successor (the lock is the kernel's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kits.pgkit import fresh_database
from kits.processkit import free_port
from kits.serverkit import ROOT, add_client, killable_server, running_server, use_store

from wfm.server.datalock import DataDirBusy, DataDirLock


def serve(data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", "serve", "--port",
                           str(free_port()), "--data", str(data), "--log-level", "warning",
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_second_server_on_the_same_data_directory_exits_naming_the_first(
        tmp_path: Path) -> None:
    with use_store("sqlite"):  # the SQLite server's message (whatever MARGO_TEST_STORE says)
        _second_sqlite_server_refused(tmp_path / "data")


def _second_sqlite_server_refused(data: Path) -> None:
    add_client(data, "edge")
    with killable_server(data) as (base, first):
        assert httpx.get(f"{base}/healthz").status_code == 200
        second = serve(data)
        assert second.returncode == 1
        assert f"is in use by another margo serve (pid {first.pid} on " in second.stderr
        assert "listening on 127.0.0.1:" in second.stderr
        assert "--database postgresql://" in second.stderr
        assert "on its SQLite database)" in second.stderr  # what holds it
        assert "PostgreSQL replica" not in second.stderr
        assert httpx.get(f"{base}/healthz").status_code == 200  # the first is unharmed
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    # A crash releases the lock: the next server starts and serves.
    with running_server(data) as base:
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_a_second_replica_on_a_replicas_data_directory_is_told_each_needs_its_own(
        tmp_path: Path) -> None:
    """Replicas on PostgreSQL share the database, never a data directory: the message says
    so, and names the replica that holds the directory, rather than talking of SQLite."""
    data, url = tmp_path / "replica-0", fresh_database()
    with use_store("sqlite"), killable_server(data, "--database", url) as (base, first):
        assert httpx.get(f"{base}/healthz").status_code == 200
        second = serve(data, "--database", url)
        assert second.returncode == 1
        message = " ".join(second.stderr.split())
        assert f"(pid {first.pid} on " in message
        assert "a PostgreSQL replica" in message
        assert "every replica needs its own --data directory" in message
        assert "SQLite" not in message
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_operator_commands_share_the_directory_with_a_running_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    add_client(data, "edge")
    with running_server(data):
        assert add_client(data, "second")  # `margo clients add` takes no server lock


def test_the_lock_is_held_until_released(tmp_path: Path) -> None:
    first, second = DataDirLock(tmp_path), DataDirLock(tmp_path)
    first.acquire(listening="127.0.0.1:1")
    with pytest.raises(DataDirBusy, match=f"pid {os.getpid()} on .*listening on 127.0.0.1:1"):
        second.acquire()
    # Before the server says what its store is, the message holds for either
    with pytest.raises(DataDirBusy, match="every margo serve needs a --data directory of its"):
        second.acquire()
    first.release()
    second.acquire()
    assert second.held
    second.release()
