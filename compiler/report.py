"""What a compile reports: per device, whether it was committed, left unchanged or failed,
with the changes, problems and notes people read; for the fleet, the counts and errors.

`compiler.planning` starts the report (the devices left as they are, the errors of the
source and the snapshot), `compiler.writing` fills it in as each device's commit streams to
Git, and `compiler.compilation.compile_fleet` returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compiler.messages import Change
from margo.errors import Problem

__all__ = ["CompileReport", "DeviceResult"]


@dataclass
class DeviceResult:
    device_id: str
    status: str  # committed | unchanged | error
    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    commit: str | None = None
    notes: list[str] = field(default_factory=list)  # e.g. deployments kept for a grace period
    grace_until: float | None = None  # when the first grace period kept here runs out


@dataclass
class CompileReport:
    revision: str
    devices: int = 0
    deployments: int = 0
    commits: int = 0
    unchanged: int = 0
    errors: list[tuple[str | None, Problem]] = field(default_factory=list)  # (device, problem)
    results: list[DeviceResult] = field(default_factory=list)
    #: Per intent under a rollout: each targeted device's wave, and the devices this compile
    #: moved to the new revision with the blob each had before (for `wfm.rollouts`).
    rollout_waves: dict[str, dict[str, int]] = field(default_factory=dict)
    rollout_moves: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Devices whose lost branch this compile rebuilt on the commit it was last left at
    #: (such a branch's new commit names a parent no other branch reaches).
    restored_branches: int = 0

    @property
    def next_grace_expiry(self) -> float | None:
        """The earliest moment (epoch seconds) a kept deployment's grace period runs out: a
        compile is due then even if no input changes, or the deployment would stay forever."""
        times = [r.grace_until for r in self.results if r.grace_until is not None]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "deployments": self.deployments, "commits": self.commits,
            "unchanged": self.unchanged,
            "errors": [{"device": device, **problem.to_json()} for device, problem in self.errors],
        }
