"""What every driver provides: a reading of what is installed, one step at a time, and a
reading back of what that step left in the engine.

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

    def confirm(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Read back from the engine what `apply` just did for `step`, and raise
        `ApplyError("READBACK_MISMATCH")` naming what was expected and what was found when
        they differ (`reconciler.drivers.readback`). The runner reports a component
        `installed` or `removed` only after this returns."""
        ...

    def close(self) -> None:
        """Release engine handles."""
        ...
