"""Servers the tests start as real child processes (`margo serve`, the OCI registry): a free
loopback port, waiting until one answers, stopping it. One copy for every kit that needs it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from tools.polling import poll_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_ready(process: subprocess.Popen[bytes], ready: Callable[[], bool], what: str,
                     log_path: Path, *, timeout: float = 30, interval: float = 0.1,
                     not_yet: tuple[type[Exception], ...] = (httpx.TransportError,)) -> None:
    """Call `ready` until it says yes (`not_yet` errors count as no); RuntimeError with the
    process's log if it exits first or `timeout` seconds pass."""
    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{what} did not start: " + log_path.read_text())
        return ready()

    try:
        poll_until(what, answers, timeout=timeout, interval=interval, not_yet=not_yet)
    except TimeoutError:
        raise RuntimeError(f"{what} did not start: " + log_path.read_text()) from None


def stop(process: subprocess.Popen[bytes], *, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
