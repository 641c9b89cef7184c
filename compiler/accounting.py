"""Capacity accounting: what the WFM has placed on a device, against what the device reports.

The rule (docs/intents.md, "Capacity accounting"), decided per device on every compile:

* every deployment the device's tree holds is *placed*; what its profile requires is its
  `Demand` (`margo.constraints.demand`);
* what the report already shows as used by a placed deployment is not subtracted again: a
  cluster's report subtracts the requests of scheduled pods and says whose they are
  (`margo.cluster_workloads`), so only the part of the demand its pods do not yet request is
  *assigned and not reflected*; a Compose or host device reports totals, so all of it is;
* a *new* placement (the tree does not hold it yet) is eligible only if its demand fits in
  what the device reports minus what is assigned and not reflected. New placements are
  decided one after another, highest intent `priority` first, then by name, each taking its
  share before the next is tried, so the same inputs always give the same trees;
* a placement the tree holds is never removed because of accounting: it is checked as the
  device would be without it, and only a failed eligibility rule or an intent change
  removes it. A fleet therefore converges and never flaps;
* an intent with `overcommit: true` is placed without accounting and its deployments are not
  counted against others (capacity shared by design).

`cpus` entries are placement units and are never summed: each deployment's cores are
counted on one entry (of an accepted architecture), packed so that no entry holds more than
it reports whenever that is possible (`compiler.packing`); memory and storage come from the
device's totals, and each GPU claim takes one matching GPU peripheral (a matching of every
claim, whenever one exists).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from compiler.packing import CoreDemand, fits, match_claims, pack_cores
from margo.cluster import exact_binary
from margo.constraints import ARCHITECTURE_ALIASES, Demand, Failure, GpuClaim
from margo.quantity import format_quantity, parse_quantity

__all__ = ["Ledger"]

_ZERO = Decimal(0)
STAGE = "accounting"


def _bytes(value: Any) -> Decimal | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return parse_quantity(value)
    except (ValueError, TypeError):
        return None


def _cores_text(amount: Decimal) -> str:
    text = format(amount.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _number(amount: Decimal) -> int | float:
    return int(amount) if amount == amount.to_integral_value() else float(amount)


def _names(holders: list[tuple[str, Any]]) -> str:
    return ", ".join(dict.fromkeys(name for name, _ in holders))


@dataclass
class _Cpu:
    """One `cpus` entry: what the device reports and who holds what of it."""

    cores: Decimal
    architecture: str | None
    taken: list[tuple[str, Decimal]] = field(default_factory=list)

    @property
    def left(self) -> Decimal:
        return max(_ZERO, self.cores - sum((a for _, a in self.taken), _ZERO))


@dataclass
class _Total:
    """`memory` or `storage`: reported (None: not reported or not a quantity) and taken."""

    reported: Decimal | None
    taken: list[tuple[str, Decimal]] = field(default_factory=list)

    @property
    def assigned(self) -> Decimal:
        return sum((a for _, a in self.taken), _ZERO)

    @property
    def left(self) -> Decimal:
        return _ZERO if self.reported is None else max(_ZERO, self.reported - self.assigned)


@dataclass
class _Peripheral:
    value: Any
    holder: str | None = None


class Ledger:
    """One device: its report, and what placed deployments take that the report does not
    show yet. Pure; built per device and compile."""

    def __init__(self, view: Mapping[str, Any], *, cluster: bool = False,
                 attributed: bool = True) -> None:
        """`view` is the device's matching view; `cluster` words messages for a cluster
        (available amounts); `attributed` is False when a cluster's report does not say
        which pods are ours (then placed deployments count in full, and messages say so)."""
        self.cluster, self.attributed = cluster, attributed
        cpus = view.get("cpus")
        self.cpus: list[_Cpu] = []
        for entry in cpus if isinstance(cpus, list | tuple) else ():
            cores = entry.get("cores") if isinstance(entry, Mapping) else None
            if isinstance(cores, int | float) and not isinstance(cores, bool):
                arch = entry.get("architecture")
                arch = ARCHITECTURE_ALIASES.get(arch, arch) if isinstance(arch, str) else None
                self.cpus.append(_Cpu(Decimal(str(cores)), arch))
            else:
                self.cpus.append(_Cpu(_ZERO, None))
        self.memory = _Total(_bytes(view.get("memory")))
        self.storage = _Total(_bytes(view.get("storage")))
        peripherals = view.get("peripherals")
        self.peripherals = [_Peripheral(p) for p in
                            (peripherals if isinstance(peripherals, list | tuple) else ())]
        #: What placed deployments take of cores and GPUs, in the order taken; where they
        #: are counted (`_Cpu.taken`, `_Peripheral.holder`) is worked out by `_count`.
        self._cores: list[tuple[str, Decimal, frozenset[str] | None]] = []
        self._claims: list[tuple[str, GpuClaim]] = []
        self._counted = True

    # ---- taking

    def _usable(self, demand: Demand) -> list[_Cpu]:
        accepted = demand.architectures
        return [c for c in self.cpus if accepted is None or c.architecture in accepted]

    def _entries(self) -> list[tuple[Decimal, str | None]]:
        return [(cpu.cores, cpu.architecture) for cpu in self.cpus]

    def _core_demands(self) -> list[CoreDemand]:
        return [(cores, accepted) for _, cores, accepted in self._cores]

    def _count(self) -> None:
        """Where the placed deployments' cores and GPUs are counted (`compiler.packing`):
        packed and matched so that nothing is counted over what the device reports
        whenever the placements fit at all."""
        if self._counted:
            return
        for cpu in self.cpus:
            cpu.taken = []
        for (name, _, _), parts in zip(self._cores, pack_cores(self._entries(),
                                                                self._core_demands()),
                                       strict=True):
            for index, amount in parts:
                self.cpus[index].taken.append((name, amount))
        for peripheral in self.peripherals:
            peripheral.holder = None
        matched = match_claims([p.value for p in self.peripherals],
                               [claim.matches for _, claim in self._claims])
        for (name, _), holder in zip(self._claims, matched, strict=True):
            if holder is not None:
                self.peripherals[holder].holder = name
        self._counted = True

    def take(self, name: str, demand: Demand) -> None:
        """Record that `name` holds `demand` (counted where it fits: see `_count`; when
        nothing fits, as a placement kept from before may, amounts stop at zero)."""
        if demand.cores:
            self._cores.append((name, demand.cores, demand.architectures))
        if demand.memory:
            self.memory.taken.append((name, demand.memory))
        if demand.storage:
            self.storage.taken.append((name, demand.storage))
        self._claims += [(name, claim) for claim in demand.gpus]
        self._counted = False

    def release(self, name: str) -> list[tuple[list[Any], int, Any]]:
        """Give back everything `name` holds (a placed deployment whose change is checked
        as the device would be without it); returns what it held, for `restore`."""
        held: list[tuple[list[Any], int, Any]] = []
        every: tuple[list[Any], ...] = (self._cores, self._claims, self.memory.taken,
                                        self.storage.taken)
        for taken in every:
            held += [(taken, i, entry) for i, entry in enumerate(taken) if entry[0] == name]
            taken[:] = [entry for entry in taken if entry[0] != name]
        self._counted = False
        return held

    def restore(self, held: list[tuple[list[Any], int, Any]]) -> None:
        """Take back exactly what `release` gave back, where it was."""
        for taken, index, entry in held:
            taken.insert(index, entry)
        self._counted = False

    # ---- checking

    def shortfalls(self, demand: Demand) -> list[Failure]:
        """Why `demand` does not fit in what is left, in numbers (empty: it fits). The
        claims are checked together: two GPUs need two free matching ones."""
        self._count()
        failures: list[Failure] = []
        if demand.cores:
            failures += self._cpu_shortfall(demand)
        for total, what in ((self.memory, "memory"), (self.storage, "storage")):
            needed = getattr(demand, what)
            if needed and total.reported is not None and total.left < needed:
                failures.append(self._total_shortfall(total, what, needed))
        if demand.gpus:
            failures += self._gpu_shortfall(demand.gpus)
        return failures

    def _has(self) -> str:
        return "the cluster has" if self.cluster else "the device has"

    def _tail(self) -> str:
        if self.cluster and not self.attributed:
            return (" (the cluster does not say which pods are ours, so placed deployments "
                    "count in full)")
        return " (not yet running)" if self.cluster else ""

    def _cpu_shortfall(self, demand: Demand) -> list[Failure]:
        usable = self._usable(demand)
        if not usable or any(c.left >= demand.cores for c in usable):
            return []  # no entry at all is matching's business, not accounting's
        if fits(self._entries(), [*self._core_demands(),
                                  (demand.cores, demand.architectures)]):
            return []  # room, once the placed ones are counted on other entries
        # The entries that could hold the demand if nothing were assigned say most.
        best = max([c for c in usable if c.cores >= demand.cores] or usable,
                   key=lambda c: c.left)
        needs = f"needs {_cores_text(demand.cores)} " + (
            "core" if demand.cores == 1 else "cores")
        assigned = best.cores - best.left
        available = " available" if self.cluster else ""
        where = "" if len(self.cpus) == 1 else " on one CPU entry (entries are never summed)"
        message = (f"{needs}{where}; {self._has()} {_cores_text(best.cores)}{available}"
                   f"{' on its best entry' if len(self.cpus) > 1 else ''}, of which "
                   f"{_cores_text(assigned)} {'is' if assigned == 1 else 'are'} assigned to "
                   f"{_names(best.taken)}{self._tail()}")
        return [Failure(STAGE, "cpu.cores", ">=", _number(demand.cores),
                        {"reported": _number(best.cores), "assigned": {
                            n: _number(a) for n, a in best.taken}}, None, message)]

    def _total_shortfall(self, total: _Total, what: str, needed: Decimal) -> Failure:
        assert total.reported is not None
        available = " available" if self.cluster else ""
        message = (f"needs {format_quantity(needed)} {what}; {self._has()} "
                   f"{format_quantity(total.reported)}{available}, of which "
                   f"{format_quantity(total.assigned)} "
                   f"{'is' if len(total.taken) == 1 else 'are'} assigned to "
                   f"{_names(total.taken)}{self._tail()}")
        return Failure(STAGE, what, ">=", exact_binary(needed), {
            "reported": exact_binary(total.reported),
            "assigned": {n: exact_binary(a) for n, a in total.taken}}, None, message)

    def _gpu_shortfall(self, claims: tuple[GpuClaim, ...]) -> list[Failure]:
        matched = match_claims([p.value for p in self.peripherals],
                               [c.matches for _, c in self._claims] + [c.matches
                                                                       for c in claims])
        failures = []
        for claim, found in zip(claims, matched[len(self._claims):], strict=True):
            if found is not None:
                continue
            matching = [p for p in self.peripherals if claim.matches(p.value)]
            if not matching:
                continue  # the device has none at all: matching says so
            holders = [(p.holder, 1) for p in matching if p.holder]
            count = len(matching)
            message = (f"needs {claim.text}; {self._has()} {count} matching "
                       f"GPU{'s' if count != 1 else ''}, assigned to {_names(holders)}"
                       f"{self._tail()}")
            failures.append(Failure(STAGE, "peripherals", "ContainsAll", claim.text, {
                "reported": count, "assigned": sorted({n for n, _ in holders})}, None,
                message))
        return failures

    # ---- the view of what is left

    def remaining_view(self, view: Mapping[str, Any]) -> dict[str, Any]:
        """`view` with `cpus`, `memory`, `storage` and `peripherals` as what is left: for
        matching a profile against the device's remaining capacity (exact amounts)."""
        self._count()
        out = dict(view)
        cpus = view.get("cpus")
        if isinstance(cpus, list | tuple):
            left = []
            for entry, cpu in zip(cpus, self.cpus, strict=True):
                if isinstance(entry, Mapping):
                    entry = {**entry, "cores": _number(cpu.left)} if cpu.taken else entry
                left.append(entry)
            out["cpus"] = left
        for total, what in ((self.memory, "memory"), (self.storage, "storage")):
            if total.reported is not None and total.taken:
                out[what] = exact_binary(total.left)
        if self.peripherals:
            out["peripherals"] = [p.value for p in self.peripherals if p.holder is None]
        return out

    def assigned(self) -> dict[str, dict[str, Any]]:
        """Per placed deployment (intent name), what it takes that the report does not
        show: for explanations and the dashboard."""
        self._count()
        out: dict[str, dict[str, Any]] = {}
        for name, amount, _ in self._cores:
            out.setdefault(name, {})["cpu"] = _number(amount)
        for total, what in ((self.memory, "memory"), (self.storage, "storage")):
            for name, amount in total.taken:
                out.setdefault(name, {})[what] = format_quantity(amount)
        for peripheral in self.peripherals:
            if peripheral.holder:
                gpus = out.setdefault(peripheral.holder, {})
                gpus["gpus"] = gpus.get("gpus", 0) + 1
        return out
