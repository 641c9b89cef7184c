"""Staged rollouts, the compiler's side: which wave each device of an intent is in, and
what a device gets while its wave is closed or the rollout is rolled back.

An intent with `spec.rollout` changes its devices in waves. The fleet server decides, from
status reports and time, how far a rollout has got (`wfm.rollouts`); the compiler is given
that decision as a `RolloutPlan` and turns it into desired state, so Git history tells the
whole story:

* a device whose wave is open gets the intent's new rendering, as without a rollout;
* a device whose wave is not open yet keeps its file as it is (the previous revision); a
  device that never had the intent gets the new one, since there is nothing to keep;
* once the plan says `rolled back`, every device the rollout moved gets back the file it
  had before (`base`, a blob the device's branch held), in a commit that says why.

Waves are filled in a fixed order: a wave with a `selector` takes the matching devices not
in an earlier wave, one with `devices` (a count, or a percentage of the targeted devices,
rounded up) takes the next ones in the order of sha256(intent/device), and a wave with
neither takes the rest. The same devices, intent and spec give the same waves.

With `maxUnavailable`, an open wave moves its devices progressively rather than all at once:
the server lets the next ones through (in the same sha256 order, `next_admissions`) only
while fewer than that many moved devices of the rollout are unavailable (pending or failed
on the new revision), and names the devices it let through in the plan (`admitted`). The
plan is stored by the server, so a recompile moves exactly the same devices.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from margo.constraints import CompiledConstraints

__all__ = ["PERCENT", "POSITIVE_PERCENT", "RolloutPlan", "RolloutSpec", "Wave",
           "assign_waves", "budget_of", "move_order", "next_admissions",
           "unavailable_limit"]

PERCENT = r"^(100|[1-9]?[0-9])%$"
#: 1% to 100%: a cap of 0% would let no device move, ever.
POSITIVE_PERCENT = r"^(100|[1-9][0-9]?)%$"


@dataclass(frozen=True, slots=True)
class Wave:
    name: str
    count: int | None = None  # a number of devices
    percent: int | None = None  # or a percentage of the targeted devices
    selector: CompiledConstraints | None = None  # or the devices it selects


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    waves: tuple[Wave, ...]
    soak_seconds: int = 0
    deadline_seconds: int = 3600
    max_failed: int | None = 0  # a count of failed or stale devices...
    max_failed_percent: int | None = None  # ...or a percentage of the targeted devices
    #: At most this many moved devices may be unavailable at once (None: no cap, a whole
    #: wave moves together)...
    max_unavailable: int | None = None
    max_unavailable_percent: int | None = None  # ...or a percentage of the targeted devices


def budget_of(spec: RolloutSpec, targeted: int) -> int:
    """How many moved devices may fail (or go stale) before the rollout is rolled back."""
    if spec.max_failed_percent is not None:
        return math.floor(targeted * spec.max_failed_percent / 100)
    return spec.max_failed or 0


def unavailable_limit(spec: RolloutSpec, targeted: int) -> int | None:
    """How many moved devices may be unavailable at once (None: no cap). A percentage
    rounds down, as Kubernetes Deployments round `maxUnavailable`, but never below 1: a
    cap of 0 would stall the rollout before its first device."""
    if spec.max_unavailable_percent is not None:
        return max(1, math.floor(targeted * spec.max_unavailable_percent / 100))
    return spec.max_unavailable


def move_order(intent: str, devices: Iterable[str]) -> list[str]:
    """Device ids in the fixed order of sha256(intent/device): the order count waves are
    filled in and capped waves let devices through, so neither depends on the order
    devices reported in (a different intent spreads over different devices first)."""
    return sorted(devices, key=lambda d: hashlib.sha256(f"{intent}/{d}".encode()).hexdigest())


def next_admissions(intent: str, waiting: Iterable[str], unavailable: int,
                    limit: int) -> list[str]:
    """Which waiting devices of the open wave move next under a `maxUnavailable` of `limit`
    while `unavailable` moved devices are not installed: the first ones in `move_order`,
    as many as there is room for. A pure function of its inputs, so the server's choice is
    the same on every replica and after a restart."""
    return move_order(intent, waiting)[:max(0, limit - unavailable)]


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """What the fleet server decided for one intent's rollout (`wfm.rollouts`)."""

    revision: str  # the intent revision being rolled out (`rollout_revision`)
    #: progressing | paused (waves up to `open_wave` get the new revision) | rolled back |
    #: complete (everything gets the new revision: the plan is then not needed)
    status: str
    open_wave: int = 0
    #: The file each moved device had before the rollout moved it (blob ids).
    base: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""
    #: Under `maxUnavailable`: the devices of the open wave let through so far (earlier
    #: waves have settled, so all theirs are); None: every device of the open wave moves.
    admitted: frozenset[str] | None = None

    @property
    def rolled_back(self) -> bool:
        return self.status == "rolled back"

    def is_open(self, wave: int | None, device: str | None = None) -> bool:
        """Whether `device`, in `wave` (None: not in any), gets the new revision. Without a
        device, in the open wave of a capped rollout: no (no device was named)."""
        if self.status == "complete":
            return True
        if self.rolled_back or wave is None or wave > self.open_wave:
            return False
        return wave < self.open_wave or self.admitted is None or device in self.admitted


def assign_waves(intent: str, spec: RolloutSpec,
                 devices: Iterable[tuple[str, Mapping[str, Any], Mapping[str, Any]]]
                 ) -> dict[str, int]:
    """Each targeted device's wave index. `devices`: (id, properties, labels)."""
    by_id = {d[0]: d for d in devices}
    ordered = [by_id[d] for d in move_order(intent, by_id)]
    total = len(ordered)
    waves: dict[str, int] = {}
    for index, wave in enumerate(spec.waves):
        left = [d for d in ordered if d[0] not in waves]
        if wave.selector is not None:
            chosen = [d for d in left if wave.selector.is_eligible(d[1], d[2])]
        elif wave.count is not None:
            chosen = left[:wave.count]
        elif wave.percent is not None:
            chosen = left[:math.ceil(total * wave.percent / 100)]
        else:
            chosen = left
        waves.update((d[0], index) for d in chosen)
    return waves
