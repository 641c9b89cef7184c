"""What the device-client benchmarks share: the Hello World intent they deploy many of, one
timed cycle, a process's memory (and what it is made of), a p90, and the digests a
recompile changes."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["HELLO_INTENT", "digests", "memory_kib", "p90", "resident_by_mapping", "timed"]

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


def memory_kib(field: str, pid: int | str = "self") -> int:
    """`VmRSS`, `VmHWM`, ... of this process (or of `pid`), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def resident_by_mapping(pid: int | str = "self") -> list[tuple[str, int]]:
    """What a process's resident memory is made of: KiB resident per mapped file (a shared
    library's code and data together), `[heap]`, `[stack]` and `[anonymous]` (mmap'd
    arenas: the Python heap and a Go runtime's), largest first (/proc/<pid>/smaps)."""
    sizes: Counter[str] = Counter()
    name = "[anonymous]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode
            name = fields[5] if len(fields) > 5 else "[anonymous]"
        elif fields[0] == "Rss:":
            sizes[name] += int(fields[1])
    return sizes.most_common()


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
