"""The source watcher outlives a failing callback: a later edit still triggers a compile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from wfm.fleet.sources import SourceWatcher


def _wait(event: threading.Event, path: Path, text: str, timeout: float = 20.0) -> bool:
    """Edit `path` until the watcher reacts (inotify may need a moment to start)."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        path.write_text(f"{text} {n}\n")
        if event.wait(1.0):
            return True
    return False


def test_a_callback_that_raises_does_not_end_the_watch(tmp_path: Path) -> None:
    calls: list[int] = []
    first, second = threading.Event(), threading.Event()

    def on_change() -> None:
        calls.append(1)
        if not first.is_set():
            first.set()
            raise RuntimeError("the compile trigger failed once")
        second.set()

    watcher = SourceWatcher(tmp_path, on_change)
    try:
        assert _wait(first, tmp_path / "intent.yaml", "one")
        assert _wait(second, tmp_path / "intent.yaml", "two"), \
            "the watch ended with the callback's exception"
    finally:
        watcher.stop()
    assert len(calls) >= 2
