"""Servers the tests start as real child processes (`margo serve`, the OCI registry): a free
loopback port, waiting until one answers, stopping it. The helpers live in `tools.processes`,
which the benchmarks use too; the kits import them from here."""

from __future__ import annotations

from tools.processes import free_port, stop, wait_until_ready

__all__ = ["free_port", "stop", "wait_until_ready"]
