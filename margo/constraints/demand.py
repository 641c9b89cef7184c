"""What a placement takes from a device: the consumable part of its constraints.

Capacity accounting (docs/intents.md, "Capacity accounting") needs, for every deployment the
WFM places, the resources it holds: the cores of its `cpu` requirement (on one `cpus` entry,
since entries are placement units and are never summed), its memory and storage, and one GPU
per GPU it asks for. Matching answers "does this device qualify"; a `Demand` answers "how
much of it does this deployment use", read from the same compiled clauses, so the two can
never disagree about what a profile requires.

Which clauses ask for a GPU:

* a legacy `requiredResources.peripherals` entry of `type: gpu` (one GPU each);
* an rc.3 eligibility-rule expression on `/peripherals` with `ContainsAll` whose item
  expressions include `/type In [gpu]` (the spec's own GPU example), or `ContainsAny` with
  that single item: one GPU matching every item expression. Rules are alternatives, so only
  the first rule the device satisfies counts.

Other peripherals (a display, a camera) and interfaces are not consumed: several deployments
may use them, and the standard does not say otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from margo.constraints.capacity import CpuCheck, QuantityCheck
from margo.constraints.compiled import CompiledConstraints
from margo.constraints.expressions import Expression
from margo.constraints.required_resources import PeripheralCheck
from margo.constraints.vocabulary import CONTAINS_OPERATORS, EMPTY

__all__ = ["Demand", "GpuClaim", "Usage", "demand_of"]

_ZERO = Decimal(0)
_GPU = "gpu"


@dataclass(frozen=True, slots=True)
class GpuClaim:
    """One GPU a placement takes: the first reported peripheral that `matches`."""

    test: Callable[[Any], bool]
    text: str  # "a GPU", "a GPU with /manufacturer In ['NVIDIA']"

    def matches(self, peripheral: Any) -> bool:
        return isinstance(peripheral, Mapping) and self.test(peripheral)


@dataclass(frozen=True, slots=True)
class Usage:
    """Amounts a device's report already shows as used by one deployment (a cluster counts
    the requests of its scheduled pods): subtracted from its demand, never below zero."""

    cores: Decimal = _ZERO
    memory: Decimal = _ZERO
    storage: Decimal = _ZERO
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class Demand:
    """What one placement holds on a device. Zero amounts and no claims: nothing."""

    cores: Decimal = _ZERO
    #: Normalised architectures the cores must be on (None: any entry).
    architectures: frozenset[str] | None = None
    memory: Decimal = _ZERO
    storage: Decimal = _ZERO
    gpus: tuple[GpuClaim, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.cores or self.memory or self.storage or self.gpus)

    def minus(self, used: Usage) -> Demand:
        """What is still to come once `used` shows in the report."""
        return Demand(max(_ZERO, self.cores - used.cores), self.architectures,
                      max(_ZERO, self.memory - used.memory),
                      max(_ZERO, self.storage - used.storage), self.gpus[used.gpus:])

    def combined(self, other: Demand) -> Demand:
        """Both requirements hold for one deployment (the profile's and the intent's): the
        larger of each amount, one set of GPU claims (the longer)."""
        architectures = self.architectures
        if other.architectures is not None:
            architectures = (other.architectures if architectures is None
                             else architectures & other.architectures)
        return Demand(max(self.cores, other.cores), architectures,
                      max(self.memory, other.memory), max(self.storage, other.storage),
                      self.gpus if len(self.gpus) >= len(other.gpus) else other.gpus)


def _claim_of_legacy(check: PeripheralCheck) -> GpuClaim | None:
    required = dict(check.required)
    if required.get("type") != _GPU:
        return None
    pairs = check.required
    rest = [f"{field} {value!r}" for field, value in pairs if field != "type"]
    text = "a GPU" + (f" with {', '.join(rest)}" if rest else "")
    return GpuClaim(lambda p: all(p.get(f) == v for f, v in pairs), text)


def _is_gpu_type(item: Expression) -> bool:
    return (item.key == "/type" and item.operator == "In" and bool(item.values)
            and all(v == _GPU for v in item.values))


def _claim_of_expression(expr: Expression) -> GpuClaim | None:
    if expr.key != "/peripherals" or expr.operator not in CONTAINS_OPERATORS:
        return None
    items = expr.items
    if not any(_is_gpu_type(i) for i in items):
        return None
    if expr.operator == "ContainsAny" and len(items) != 1:
        return None  # "a GPU, or anything from NVIDIA": not necessarily a GPU

    def test(peripheral: Any) -> bool:
        return all(item.test(item.lookup(peripheral)) for item in items)

    rest = [i.text for i in items if not _is_gpu_type(i)]
    return GpuClaim(test, "a GPU" + (f" with {', '.join(rest)}" if rest else ""))


def _fixed(compiled: CompiledConstraints) -> Demand:
    cores, architectures = _ZERO, None
    amounts = {"memory": _ZERO, "storage": _ZERO}
    claims: list[GpuClaim] = []
    for check in compiled.checks:
        if isinstance(check, CpuCheck):
            cores = max(cores, Decimal(str(check.cores)))
            if check.accepted is not None:
                architectures = (check.accepted if architectures is None
                                 else architectures & check.accepted)
        elif isinstance(check, QuantityCheck) and check.field in amounts:
            amounts[check.field] = max(amounts[check.field], check.required_bytes)
        elif isinstance(check, PeripheralCheck):
            claim = _claim_of_legacy(check)
            if claim is not None:
                claims.append(claim)
    return Demand(cores, architectures, amounts["memory"], amounts["storage"], tuple(claims))


#: The device-independent part of each compiled constraints' demand, by identity (compiled
#: constraints live as long as the compile that made them; the entry keeps them alive).
_FIXED: dict[int, tuple[CompiledConstraints, Demand]] = {}


def demand_of(compiled: CompiledConstraints, view: Mapping[str, Any] | None = None,
              labels: Mapping[str, Any] | None = None) -> Demand:
    """What a placement under `compiled` takes from the device whose matching view and
    labels are given (they decide which eligibility rule applies, and so which GPU)."""
    key = id(compiled)
    cached = _FIXED.get(key)
    if cached is None or cached[0] is not compiled:
        if len(_FIXED) > 4096:
            _FIXED.clear()
        cached = _FIXED[key] = (compiled, _fixed(compiled))
    demand = cached[1]
    if not compiled.rules:
        return demand
    view = EMPTY if view is None else view
    labels = EMPTY if labels is None else labels
    for rule in compiled.rules:
        if rule.passes(view, labels):
            claims = tuple(c for c in map(_claim_of_expression, rule.properties)
                           if c is not None)
            if claims and len(claims) > len(demand.gpus):
                return Demand(demand.cores, demand.architectures, demand.memory,
                              demand.storage, claims)
            return demand
    return demand
