"""A compile forks only as many workers as the memory available could hold a copy of the
compiling process for (`compiler.parallel.affordable_workers`): a fleet server's first
compile of a million devices forked two at 7 GB resident and ran a 24 GiB machine out of
memory. The figures below are that machine's; the last test reads this machine's own."""

from __future__ import annotations

import pytest

from compiler import parallel
from compiler.parallel import PARALLEL_THRESHOLD, affordable_workers, worker_count
from margo.heap import resident_and_available

GB = 10**9


def test_a_large_process_on_a_full_machine_compiles_alone() -> None:
    assert affordable_workers(2, (7 * GB, 16 * GB)) == 1  # the million-device server


def test_what_fits_is_forked() -> None:
    assert affordable_workers(2, (int(4.6 * GB), 19 * GB)) == 2  # bench/compile.py's 1M
    assert affordable_workers(4, (2 * GB, 7 * GB)) == 2
    assert affordable_workers(4, (GB // 5, 20 * GB)) == 4


def test_unknown_memory_changes_nothing() -> None:
    assert affordable_workers(2, None) == 2
    assert affordable_workers(1, (7 * GB, 1 * GB)) == 1


def test_the_count_reads_this_machine_and_the_setting_overrides_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    memory = resident_and_available()
    assert memory is not None and memory[0] > 0 and memory[1] > 0  # (a Linux machine)
    monkeypatch.delenv("MARGO_COMPILE_WORKERS", raising=False)
    # (a 7 GB process on a machine with 16 GB available cannot be made on demand here)
    monkeypatch.setattr(parallel, "resident_and_available", lambda: (7 * GB, 16 * GB))
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 2)
    assert worker_count(PARALLEL_THRESHOLD, 1_000_000) == 1
    assert "rather than 2 forked workers" in caplog.text
    monkeypatch.setenv("MARGO_COMPILE_WORKERS", "2")
    assert worker_count(PARALLEL_THRESHOLD, 1_000_000) == 2
