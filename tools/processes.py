"""Helpers for the real servers the tools start (etcd and Kubernetes, dockerd, PostgreSQL):
children that die with the process that started them, and free loopback ports."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket

__all__ = ["die_with_parent", "free_port"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec (`preexec_fn`): get SIGTERM when the process that started
    it dies, so a test run killed half-way leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
