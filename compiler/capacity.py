"""Capacity accounting for one device, as the compiler and `margo explain` both apply it.

The rule itself is documented in `compiler.accounting` and docs/intents.md; this module joins
it to intents, profiles and the device's report: which of a cluster's scheduled pods are a
placed deployment's (so they are not counted twice), what a placement held before asks of
the device it already runs on (read from the file it runs when that is not what its intent
renders now: `compiler.holding`), whether a new placement fits in what is left, and whether
a change that raises what a placed deployment takes still fits (`upgrade`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compiler.accounting import Ledger
from compiler.intents import Intent
from compiler.placement import Placement, ProfileConstraints, place
from compiler.render import deployment_id
from compiler.snapshot import Device
from compiler.source import AppVersion
from margo.cluster import EXTENSION_KEY, cluster_body
from margo.cluster_workloads import usage_of, with_workload_released, workload_requests
from margo.constraints import CompiledConstraints, Demand, Failure, demand_of
from margo.models import DeploymentProfile

__all__ = ["DeviceCapacity", "is_cluster"]


def is_cluster(device: Device) -> bool:
    """Whether the device reported a cluster body (cheap: one key lookup)."""
    return EXTENSION_KEY in device.matching and cluster_body(device.matching) is not None


class DeviceCapacity:
    """What one device reports, what the WFM's placements there take, and what is left."""

    def __init__(self, device: Device, constraints: ProfileConstraints) -> None:
        self.device, self.constraints = device, constraints
        body = cluster_body(device.matching) if EXTENSION_KEY in device.matching else None
        self._body = body
        self._requests = None if body is None else workload_requests(body)
        self.ledger = Ledger(device.matching, cluster=body is not None,
                             attributed=body is None or self._requests is not None)
        self._own: dict[str, Mapping[str, Any] | None] = {}

    def own_view(self, intent_name: str) -> Mapping[str, Any] | None:
        """What a placed deployment of `intent_name` is matched against: the report as if its
        own scheduled pods were not counted (None: the device's own view will do)."""
        if self._body is None or not self._requests:
            return None
        if intent_name not in self._own:
            self._own[intent_name] = self._released(intent_name)
        return self._own[intent_name]

    def _released(self, intent_name: str) -> Mapping[str, Any] | None:
        assert self._body is not None and self._requests is not None
        deployment = deployment_id(intent_name, self.device.id)
        mine = self._requests.get(deployment)
        if not mine:
            return None
        return with_workload_released(self.device.matching, self._body, mine, deployment)

    def _unreflected(self, intent_name: str, demand: Demand) -> Demand:
        if not self._requests:
            return demand
        return demand.minus(usage_of(self._requests.get(deployment_id(intent_name,
                                                                       self.device.id))))

    def hold(self, intent: Intent, app: AppVersion, profile: DeploymentProfile) -> None:
        """A placement the device's tree holds takes its share (unless it overcommits)."""
        if not intent.overcommit:
            self.hold_demand(intent.name, self.demand_now(intent, app, profile))

    def hold_frozen(self, name: str, app: AppVersion, profile: DeploymentProfile) -> None:
        """A placement of an intent that cannot be read now (its file kept as it is): its
        profile's requirements are still known from the application."""
        view = self.own_view(name) or self.device.matching
        self.hold_demand(name, demand_of(self.constraints.get(app, profile), view,
                                         self.device.labels))

    def demand_now(self, intent: Intent, app: AppVersion, profile: DeploymentProfile) -> Demand:
        """What a placed deployment of `intent` with `profile` takes, seen as the device would
        be without its own pods (that decides which GPU rule applies)."""
        view = self.own_view(intent.name) or self.device.matching
        return self.constraints.demand(intent, app, profile, view, self.device.labels)

    def file_demand(self, name: str, intent: Intent | None,
                    compiled: CompiledConstraints) -> Demand:
        """What a file on the device takes, from the constraints it carries
        (`compiler.holding.StoredFiles`), with the intent's own extra constraints."""
        view = self.own_view(name) or self.device.matching
        demand = demand_of(compiled, view, self.device.labels)
        if intent is not None and intent.constraints is not None:
            demand = demand.combined(demand_of(intent.constraints, view, self.device.labels))
        return demand

    def upgrade(self, name: str, demand: Demand) -> tuple[Failure, ...]:
        """A change of placed deployment `name` that raises what it takes to `demand`: checked
        as the device would be without what `name` holds now. It fits (nothing returned, and
        it takes `demand`), or it keeps what it holds and the shortfalls say why."""
        held = self.ledger.release(name)
        short = self.ledger.shortfalls(self._unreflected(name, demand)) if not demand.empty \
            else []
        if short:
            self.ledger.restore(held)
            return tuple(short)
        self.hold_demand(name, demand)
        return ()

    def hold_demand(self, name: str, demand: Demand) -> None:
        if not demand.empty:
            self.ledger.take(name, self._unreflected(name, demand))

    def admit(self, intent: Intent, app: AppVersion,
              placement: Placement) -> tuple[Placement, tuple[Failure, ...]]:
        """A new placement, eligible on the device's report: the placement to make (its
        profile, or another that fits what is left) and nothing, or the first one and why
        it does not fit. A placement that fits takes its share at once."""
        assert placement.profile is not None
        device = self.device
        demand = self.constraints.demand(intent, app, placement.profile, device.matching,
                                         device.labels)
        short = self.ledger.shortfalls(demand) if not demand.empty else []
        if short:
            left = self.ledger.remaining_view(device.matching)
            other = place(intent, app, device, self.constraints, targeted=True, view=left)
            if other.profile is not None and other.profile.id != placement.profile.id:
                other_demand = self.constraints.demand(intent, app, other.profile, left,
                                                       device.labels)
                if not self.ledger.shortfalls(other_demand):
                    placement, demand, short = other, other_demand, []
        if short:
            return placement, tuple(short)
        self.hold_demand(intent.name, demand)
        return placement, ()
