"""Where the fleet source comes from, and what makes the server recompile it.

* a local directory or repository (`--source`), optionally watched (`--watch-source`):
  edits recompile within a second, for development;
* a remote repository (`--source-url`, `--source-branch`) mirrored into
  `<data>/source.git`: a verified push webhook (`POST /hooks/git`) fetches it and
  recompiles. The webhook is only a trigger — the server fetches its *configured* URL,
  never one taken from the request.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from compiler.stalelocks import recover_stale_locks
from wfm.telemetry.metrics import GIT_SECONDS

if TYPE_CHECKING:
    from wfm.fleet.coordination import Coordinator

__all__ = ["RemoteSource", "SourceWatcher", "fetch_source", "git_environment"]

log = logging.getLogger("margo.wfm.sources")


@dataclass(frozen=True)
class RemoteSource:
    url: str
    branch: str
    mirror: Path  # <data>/source.git

    @property
    def ref(self) -> str:
        return f"refs/heads/{self.branch}"

    def fetch(self, *, timeout: float = 300) -> str:
        """Fetch the branch into the mirror (created on first use); return the commit id."""
        if not self.mirror.exists():
            subprocess.run(["git", "init", "-q", "--bare", str(self.mirror)], check=True,
                           timeout=60, env=git_environment())
        recover_stale_locks(self.mirror)  # a fetch killed with the server must not stop all
        result = subprocess.run(
            ["git", "--git-dir", str(self.mirror), "fetch", "--quiet", "--no-tags",
             "--prune", "--", self.url, f"+{self.ref}:{self.ref}"],
            capture_output=True, text=True, timeout=timeout, env=git_environment(),
            check=False)
        if result.returncode != 0:
            raise RuntimeError(f"fetching {self.url} {self.branch} failed: "
                               f"{result.stderr.strip()}")
        head = subprocess.run(["git", "--git-dir", str(self.mirror), "rev-parse", self.ref],
                              capture_output=True, text=True, check=True,
                              env=git_environment())
        return head.stdout.strip()


def git_environment() -> dict[str, str]:
    """The server's environment without GIT_* variables that could redirect git."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    return env


class SourceWatcher:
    """Calls `on_change` when files under a directory change (watchfiles, debounced)."""

    def __init__(self, directory: Path, on_change: Callable[[], None]):
        self._directory, self._on_change = directory, on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="margo-source-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Watch until stopped. A failing watch (the directory went away, inotify limits)
        or a failing callback is logged and the watch starts again a second later: a
        watcher that died quietly would leave source edits uncompiled with no word."""
        from watchfiles import watch

        while not self._stop.is_set():
            try:
                for _changes in watch(self._directory, stop_event=self._stop, debounce=200,
                                      step=20):
                    log.info("fleet source changed; recompiling")
                    self._on_change()
                return  # stopped
            except Exception:
                log.exception("watching the fleet source %s failed; watching again",
                              self._directory)
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def fetch_source(remote: RemoteSource, coordinator: Coordinator | None) -> str:
    """Fetch the remote fleet source into the mirror; with replicas, in this replica's turn
    at the source, publishing what it brought (so the compiling replica has it too)."""
    with GIT_SECONDS.labels("source_fetch").time():
        return _fetch(remote, coordinator)


def _fetch(remote: RemoteSource, coordinator: Coordinator | None) -> str:
    if coordinator is None:
        return remote.fetch()
    turn = coordinator.source_update()
    turn.begin()
    try:
        commit = remote.fetch()
    except BaseException:
        turn.finish(publish=False)
        raise
    turn.finish()
    return commit
