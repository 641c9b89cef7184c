"""The capacity dialect (`deviceConstraints.capacityRequirements`, and the same fields of the
older `requiredResources`): a CPU placement unit (cores on one `cpus` entry, of a listed
architecture) and memory and storage quantities; compiled and checked here.

`cpus` entries are placement units and are never summed. Reported quantities repeat across a
fleet, so each distinct string is parsed once (`reported_bytes`, also read by the cluster
dialect for node amounts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Final

from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure, display_number, is_number, kind_of, show
from margo.constraints.vocabulary import ARCHITECTURE_ALIASES, MISSING
from margo.errors import Path
from margo.quantity import format_quantity, parse_quantity

__all__ = ["CAPACITY_FIELDS", "CpuCheck", "QuantityCheck", "compile_capacity",
           "parse_reported_text", "reported_bytes"]

#: The fields of `capacityRequirements`.
CAPACITY_FIELDS: Final = ("cpu", "memory", "storage")
_CPU_FIELDS: Final = ("cores", "architectures")


@lru_cache(maxsize=4096)
def parse_reported_text(text: str) -> Decimal | str:
    """Device quantities repeat across a fleet; parse each distinct string once."""
    try:
        return parse_quantity(text)
    except ValueError as exc:
        return str(exc)


def reported_bytes(value: Any) -> Decimal | str:
    """A device-reported quantity as bytes, or the reason it is not one (never raises)."""
    if isinstance(value, str):
        return parse_reported_text(value)
    try:
        return parse_quantity(value)
    except ValueError as exc:
        return str(exc)


@dataclass(frozen=True, slots=True)
class CpuCheck:
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
        return is_number(cores) and cores >= self.cores

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
        return f"a single{arch} CPU entry with at least {display_number(self.cores)} cores"

    def _no_cpus(self, cpus: Any) -> list[Failure]:
        reported = "no cpus" if cpus is None else f"cpus as {show(cpus)}, not a list"
        message = f"needs {self._wanted()}, but the device reports {reported}"
        failures = [
            Failure(self.stage, "cpu.cores", ">=", display_number(self.cores), None, None, message)
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
            f"needs a CPU entry with architecture in {show(required)}, "
            f"but the device's cpus are {show(actual)}"
        )
        return Failure(self.stage, "cpu.architectures", "In", required, actual, None, message)

    def _cores_failure(self, cpus: list[Any] | tuple[Any, ...],
                       arch_matching: list[Any] | None) -> Failure:
        """Cores per entry; `arch_matching` narrows the explanation to the usable entries."""
        actual = [_entry_field(e, "cores") for e in cpus]
        if arch_matching is None:
            has = f"the device's cpus have {show(actual)} cores"
        else:
            usable = [_entry_field(e, "cores") for e in arch_matching]
            arch = "/".join(self.architectures or ())
            has = (
                f"the device's {arch} entries have {show(usable)} cores"
                f" (all entries: {show(actual)})"
            )
        message = f"needs {self._wanted()}, but {has}; entries are never summed"
        return Failure(self.stage, "cpu.cores", ">=", display_number(self.cores), actual, None,
                       message)


def _entry_field(entry: Any, field: str) -> Any:
    value = entry.get(field) if isinstance(entry, Mapping) else None
    return display_number(value) if is_number(value) else value


@dataclass(frozen=True, slots=True)
class QuantityCheck:
    """`memory` / `storage`: the device reports at least the required bytes."""

    stage: str
    field: str
    required_text: Any  # as written in the constraint
    required_bytes: Decimal
    required_shown: str  # format_quantity(required_bytes), rendered once at compile time

    def passes(self, properties: Mapping[str, Any]) -> bool:
        reported = reported_bytes(properties.get(self.field))
        return isinstance(reported, Decimal) and reported >= self.required_bytes

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        raw = properties.get(self.field)
        needs = f"needs {self.required_shown} {self.field}"
        if raw is None:
            message = f"{needs}, but the device does not report {self.field}"
        else:
            reported = reported_bytes(raw)
            message = (
                f"{needs}, has {self._has(reported)}"
                if isinstance(reported, Decimal)
                else f"{needs}, but the device reports {show(raw)}, which is not a quantity"
                f" ({reported})"
            )
        return [Failure(self.stage, self.field, ">=", self.required_text, raw, None, message)]

    def _has(self, reported: Decimal) -> str:
        has = format_quantity(reported)
        if has != self.required_shown:
            return has
        return f"{has} ({reported} < {self.required_bytes} bytes)"


# --------------------------------------------------------------------------- compilation


def compile_capacity(log: ProblemCollector, value: Any, path: Path, stage: str,
                     fields: tuple[str, ...], what: str) -> list[CpuCheck | QuantityCheck]:
    """cpu, memory and storage of `value` (an object with `fields`), as checks of `stage`."""
    doc = log.fields_of(value, path, what, fields)
    if doc is None:
        return []
    checks: list[CpuCheck | QuantityCheck | None] = []
    if "cpu" in doc:
        checks.append(_compile_cpu(log, doc["cpu"], (*path, "cpu"), stage))
    for field in ("memory", "storage"):
        checks.append(_compile_quantity(log, doc, field, path, stage))
    return [c for c in checks if c is not None]


def _compile_cpu(log: ProblemCollector, value: Any, path: Path, stage: str) -> CpuCheck | None:
    before = len(log.problems)
    doc = log.fields_of(value, path, "cpu", _CPU_FIELDS)
    if doc is None:
        return None
    cores = doc.get("cores", MISSING)
    if cores is MISSING:
        log.problem(path, "cpu needs `cores`", expected="a number of cores greater than 0")
    elif not is_number(cores) or not math.isfinite(cores) or cores <= 0:
        log.problem((*path, "cores"), "cores must be a number greater than 0",
                    expected="a number greater than 0", found=cores)
    architectures = _compile_architectures(log, doc.get("architectures", MISSING), path)
    if len(log.problems) != before:
        return None
    accepted = (
        None
        if architectures is None
        else frozenset(ARCHITECTURE_ALIASES.get(a, a) for a in architectures)
    )
    return CpuCheck(stage, cores, architectures, accepted)


def _compile_architectures(log: ProblemCollector, value: Any,
                           path: Path) -> tuple[str, ...] | None:
    """The listed architectures, None when absent (problems recorded when malformed)."""
    if value is MISSING:
        return None
    path = (*path, "architectures")
    if not isinstance(value, list | tuple) or not value:
        log.problem(path, "architectures must be a non-empty list of architecture names",
                    expected="a non-empty list such as [amd64, arm64]", found=value)
        return None
    for i, arch in enumerate(value):
        if not isinstance(arch, str) or not arch:
            log.problem((*path, i), "an architecture must be a non-empty string",
                        expected="a name such as amd64", found=arch)
    return tuple(value)


def _compile_quantity(log: ProblemCollector, doc: Mapping[str, Any], field: str, path: Path,
                      stage: str) -> QuantityCheck | None:
    if field not in doc:
        return None
    value = doc[field]
    try:
        if not isinstance(value, str | int | float):
            raise ValueError(f"expected a quantity string, found {kind_of(value)}")
        required = parse_quantity(value)
    except ValueError as exc:
        log.problem((*path, field), f"{field} is not a quantity: {exc}",
                    expected="a quantity such as 1024Mi or 10Gi", found=value)
        return None
    return QuantityCheck(stage, field, value, required, format_quantity(required))
