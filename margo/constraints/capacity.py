"""Capacity checks: CPU placement units, memory and storage quantities, peripherals and
interfaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any

from margo.constraints.results import Failure, _is_number, _number, _show
from margo.constraints.vocabulary import ARCHITECTURE_ALIASES
from margo.quantity import format_quantity, parse_quantity

__all__ = []


@lru_cache(maxsize=4096)
def _parse_reported_text(text: str) -> Decimal | str:
    """Device quantities repeat across a fleet; parse each distinct string once."""
    try:
        return parse_quantity(text)
    except ValueError as exc:
        return str(exc)


def _reported_bytes(value: Any) -> Decimal | str:
    """A device-reported quantity as bytes, or the reason it is not one (never raises)."""
    if isinstance(value, str):
        return _parse_reported_text(value)
    try:
        return parse_quantity(value)
    except ValueError as exc:
        return str(exc)


@dataclass(frozen=True, slots=True)
class _CpuCheck:
    """Some single `cpus` entry has enough cores (and a listed architecture)."""

    stage: str
    cores: int | float
    architectures: tuple[str, ...] | None  # as written, for reports
    accepted: frozenset[str] | None  # normalised

    def _arch_ok(self, entry: Any) -> bool:
        if self.accepted is None:
            return True
        arch = entry.get("architecture") if isinstance(entry, Mapping) else None
        return isinstance(arch, str) and ARCHITECTURE_ALIASES.get(arch, arch) in self.accepted

    def _cores_ok(self, entry: Any) -> bool:
        cores = entry.get("cores") if isinstance(entry, Mapping) else None
        return _is_number(cores) and cores >= self.cores

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cpus = properties.get("cpus")
        if not isinstance(cpus, list | tuple):
            return False
        return any(self._cores_ok(e) and self._arch_ok(e) for e in cpus)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        cpus = properties.get("cpus")
        if not isinstance(cpus, list | tuple):
            return self._no_cpus(cpus)
        if self.accepted is None:
            return [self._cores_failure(cpus, None)]
        arch_matching = [e for e in cpus if self._arch_ok(e)]
        if arch_matching:
            return [self._cores_failure(cpus, arch_matching)]
        failures = [self._architecture_failure(cpus)]
        if not any(self._cores_ok(e) for e in cpus):
            failures.append(self._cores_failure(cpus, None))
        return failures

    def _wanted(self) -> str:
        arch = f" {'/'.join(self.architectures)}" if self.architectures else ""
        return f"a single{arch} CPU entry with at least {_number(self.cores)} cores"

    def _no_cpus(self, cpus: Any) -> list[Failure]:
        reported = "no cpus" if cpus is None else f"cpus as {_show(cpus)}, not a list"
        message = f"needs {self._wanted()}, but the device reports {reported}"
        failures = [
            Failure(self.stage, "cpu.cores", ">=", _number(self.cores), None, None, message)
        ]
        if self.architectures:
            failures.append(
                Failure(self.stage, "cpu.architectures", "In", list(self.architectures), None,
                        None, message)
            )
        return failures

    def _architecture_failure(self, cpus: list[Any] | tuple[Any, ...]) -> Failure:
        actual = [_entry_field(e, "architecture") for e in cpus]
        required = list(self.architectures or ())
        message = (
            f"needs a CPU entry with architecture in {_show(required)}, "
            f"but the device's cpus are {_show(actual)}"
        )
        return Failure(self.stage, "cpu.architectures", "In", required, actual, None, message)

    def _cores_failure(self, cpus: list[Any] | tuple[Any, ...],
                       arch_matching: list[Any] | None) -> Failure:
        """Cores per entry; `arch_matching` narrows the explanation to the usable entries."""
        actual = [_entry_field(e, "cores") for e in cpus]
        if arch_matching is None:
            has = f"the device's cpus have {_show(actual)} cores"
        else:
            usable = [_entry_field(e, "cores") for e in arch_matching]
            arch = "/".join(self.architectures or ())
            has = (
                f"the device's {arch} entries have {_show(usable)} cores"
                f" (all entries: {_show(actual)})"
            )
        message = f"needs {self._wanted()}, but {has}; entries are never summed"
        return Failure(self.stage, "cpu.cores", ">=", _number(self.cores), actual, None, message)


def _entry_field(entry: Any, field: str) -> Any:
    value = entry.get(field) if isinstance(entry, Mapping) else None
    return _number(value) if _is_number(value) else value


@dataclass(frozen=True, slots=True)
class _QuantityCheck:
    """`memory` / `storage`: the device reports at least the required bytes."""

    stage: str
    field: str
    required_text: Any  # as written in the constraint
    required_bytes: Decimal
    required_shown: str  # format_quantity(required_bytes), rendered once at compile time

    def passes(self, properties: Mapping[str, Any]) -> bool:
        reported = _reported_bytes(properties.get(self.field))
        return isinstance(reported, Decimal) and reported >= self.required_bytes

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        raw = properties.get(self.field)
        needs = f"needs {self.required_shown} {self.field}"
        if raw is None:
            message = f"{needs}, but the device does not report {self.field}"
        else:
            reported = _reported_bytes(raw)
            message = (
                f"{needs}, has {self._has(reported)}"
                if isinstance(reported, Decimal)
                else f"{needs}, but the device reports {_show(raw)}, which is not a quantity"
                f" ({reported})"
            )
        return [Failure(self.stage, self.field, ">=", self.required_text, raw, None, message)]

    def _has(self, reported: Decimal) -> str:
        has = format_quantity(reported)
        if has != self.required_shown:
            return has
        return f"{has} ({reported} < {self.required_bytes} bytes)"


@dataclass(frozen=True, slots=True)
class _PeripheralCheck:
    """Legacy: some device peripheral has the required type (and manufacturer/model if given)."""

    stage: str
    required: tuple[tuple[str, str], ...]

    def passes(self, properties: Mapping[str, Any]) -> bool:
        peripherals = properties.get("peripherals")
        if not isinstance(peripherals, list | tuple):
            return False
        return any(
            isinstance(p, Mapping) and all(p.get(f) == v for f, v in self.required)
            for p in peripherals
        )

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        actual = properties.get("peripherals")
        wanted = ", ".join(f"{f} {v!r}" for f, v in self.required)
        has = "no peripherals" if actual is None else _show(actual)
        message = f"needs a peripheral with {wanted}, but the device has {has}"
        return [Failure(self.stage, "peripherals", "ContainsAll", dict(self.required), actual,
                        None, message)]


@dataclass(frozen=True, slots=True)
class _InterfaceCheck:
    """Legacy: the device has an interface of the required type."""

    stage: str
    type: str

    def passes(self, properties: Mapping[str, Any]) -> bool:
        interfaces = properties.get("interfaces")
        if not isinstance(interfaces, list | tuple):
            return False
        return any(isinstance(i, Mapping) and i.get("type") == self.type for i in interfaces)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        actual = properties.get("interfaces")
        has = "no interfaces" if actual is None else _show(actual)
        message = f"needs a {self.type!r} interface, but the device has {has}"
        return [Failure(self.stage, "interfaces", "ContainsAll", {"type": self.type}, actual,
                        None, message)]
