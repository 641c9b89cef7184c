"""A real OCI registry (Debian's `docker-registry`) on loopback: `tools.registry`, which the
benchmarks use too. The Makefile installs the package; a machine without it fails loudly
instead of skipping (the drivers must be tested against a real registry)."""

from __future__ import annotations

from tools.registry import running_registry

__all__ = ["running_registry"]
