"""What the device-client benchmarks share: the Hello World intent they deploy many of, one
timed cycle, the process's memory, a p90, and the digests a recompile changes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["HELLO_INTENT", "digests", "memory_kib", "p90", "timed"]

#: One Hello World deployment (Helm) per intent: `name`, `index` (its namespace),
#: `greeting` and `device` to fill in.
HELLO_INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {{name: {name}}}
spec:
  application: {{id: com-example-hello-world}}
  profile: {{type: helm}}
  namespace: bench-{index}
  parameters:
    greeting: {greeting}
  targets: {{devices: [{device}]}}
"""


def memory_kib(field: str) -> int:
    """`VmRSS`, `VmHWM`, ... of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def timed(reconciler: Any) -> tuple[float, float, int]:
    """One device cycle: wall seconds, CPU seconds, steps; a failing cycle ends the run."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = reconciler.cycle()
    if result.failures:
        raise SystemExit(f"cycle failed: {result.failures}")
    return time.perf_counter() - wall, time.process_time() - cpu, len(result.steps)


def p90(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.9) - 1)]


def digests(server: Any, device_id: str) -> set[str]:
    """The desired digests of a device's deployments, as the server serves them."""
    return {d["digest"] for d in server.device(device_id)["deployments"]}
