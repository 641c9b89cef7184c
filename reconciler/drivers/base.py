"""What every driver provides: a reading of what is installed, and one step at a time.

A driver never decides *what* to do (the planner does); it only does one step and says
precisely how it failed: an `ApplyError` (reconciler.errors) with a short machine code
(reported as the component's `error.code`) and the engine's own message.
"""

from __future__ import annotations

from typing import Protocol

from reconciler.desired import DesiredDeployment
from reconciler.planner import Step
from reconciler.releases import InstalledRelease

__all__ = ["Driver"]


class Driver(Protocol):
    """One engine. `profile_types` lists the ApplicationDeployment profile types it runs."""

    name: str
    profile_types: tuple[str, ...]

    def installed(self) -> list[InstalledRelease]:
        """Our releases, read from the engine's own records (never a private list).
        Raises `ApplyError("ENGINE_UNAVAILABLE", ...)` when the engine cannot be reached."""
        ...

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Perform one install / upgrade / reconfigure / remove step; raise `ApplyError`.
        `deployment` is None when a whole deployment is being removed."""
        ...

    def close(self) -> None:
        """Release engine handles."""
        ...
