"""Helpers for the real servers the tools, the test kits and the benchmarks start (etcd and
Kubernetes, dockerd, PostgreSQL, `margo serve`, the OCI registry): children that die with
the process that started them, free loopback ports, waiting until a server answers,
stopping it, and the CPU time it has used (the benchmarks' figures)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tools.polling import poll_until

__all__ = ["cpu_seconds", "die_with_parent", "free_port", "stop", "thread_cpu_seconds",
           "unanswered_port", "wait_until_ready"]

TICKS = os.sysconf("SC_CLK_TCK")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec (`preexec_fn`): get SIGTERM when the process that started
    it dies, so a test run killed half-way leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A loopback port nothing listens on, for a server started next. Chosen below the
    kernel's ephemeral range: a port the kernel hands out (port 0) is also what every
    outgoing connection gets, and with thousands of them from the suite's other workers one
    took a replica's port between this probe and its bind (a test failed with "address
    already in use"). Port 0 only where no such port can be bound."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(_LOWEST_CHOSEN, low) if low > _LOWEST_CHOSEN else 0
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: The lowest port `free_port` chooses (above the ports services usually take).
_LOWEST_CHOSEN = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


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


@contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose connection attempts time out: its listener has a backlog of
    one, already taken by a connection nobody accepts, so the kernel drops every further
    SYN (as a router does for a host that is gone)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    try:
        yield int(listener.getsockname()[1])
    finally:
        filler.close()
        listener.close()


def cpu_seconds(pid: int, *, children: bool = True) -> tuple[float, float]:
    """(user, sys) CPU seconds of a process (Linux /proc), with its waited-for children's
    by default."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"), children=children)


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User and system CPU seconds of each of a process's threads, by thread id (a thread
    that ends while they are read is left out)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found[task.name] = sum(_stat_cpu(task / "stat", children=False))
    return found


def _stat_cpu(stat: Path, *, children: bool) -> tuple[float, float]:
    """(user, sys) CPU seconds from a /proc `stat` file."""
    fields = stat.read_text().rpartition(")")[2].split()
    user, system = int(fields[11]), int(fields[12])
    if children:
        user, system = user + int(fields[13]), system + int(fields[14])
    return user / TICKS, system / TICKS
