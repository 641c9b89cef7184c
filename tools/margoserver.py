"""`margo serve` as a real child process on loopback, for the test kits and the benchmarks:
started on a free port with a data directory, waited for until `/healthz` answers, stopped
when the block ends. Its log is `server-<port>.log` in `log_dir` (default: next to the data
directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tools.processes import die_with_parent, free_port, stop, wait_until_ready

__all__ = ["MargoServer", "margo_server", "running_margo"]


@dataclass(frozen=True)
class MargoServer:
    """One started `margo serve`: where it answers, its process and its log."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def margo_server(data: Path, *extra: str, log_dir: Path | None = None,
                 log_level: str = "warning", cwd: Path | None = None,
                 env: Mapping[str, str] | None = None,
                 stopping: Callable[[MargoServer], None] | None = None,
                 port: int | None = None) -> Iterator[MargoServer]:
    """One `margo serve --data DATA EXTRA...` (in `env`, default this process's), which dies
    with this process; stopped by `stopping` (default: SIGTERM, then SIGKILL after 20 s).
    `port`: the one it listens on (default: a free one; a restarted server keeps its own)."""
    port = port or free_port()
    log_dir = log_dir or data.parent
    data.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "serve", "--port", str(port), "--data",
             str(data), "--log-level", log_level, *extra],
            cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**(env or os.environ)},
            preexec_fn=die_with_parent)
        server = MargoServer(port, process, log_path)
        try:
            wait_until_ready(process, lambda: httpx.get(f"{server.url}/healthz", timeout=1)
                             .status_code == 200, "server", log_path)
            yield server
        finally:
            (stopping or (lambda s: stop(s.process)))(server)


@contextmanager
def running_margo(data: Path, *extra: str, log_dir: Path | None = None,
                  log_level: str = "warning", cwd: Path | None = None) -> Iterator[str]:
    """`margo_server`, yielding just its base URL."""
    with margo_server(data, *extra, log_dir=log_dir, log_level=log_level, cwd=cwd) as server:
        yield server.url
