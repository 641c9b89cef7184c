"""The legacy dialect (`requiredResources`, the older spec generation's block beside
deviceConstraints): the capacity fields plus peripherals and interfaces a device must have;
compiled and checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from margo.constraints.capacity import CpuCheck, QuantityCheck, compile_capacity
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure, show
from margo.constraints.vocabulary import MISSING
from margo.errors import Path

__all__ = ["InterfaceCheck", "PeripheralCheck", "compile_required_resources",
           "locate_required_resources"]

_LEGACY_FIELDS: Final = ("cpu", "memory", "storage", "peripherals", "interfaces")
_PERIPHERAL_FIELDS: Final = ("type", "manufacturer", "model")
_INTERFACE_FIELDS: Final = ("type",)


@dataclass(frozen=True, slots=True)
class PeripheralCheck:
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
        has = "no peripherals" if actual is None else show(actual)
        message = f"needs a peripheral with {wanted}, but the device has {has}"
        return [Failure(self.stage, "peripherals", "ContainsAll", dict(self.required), actual,
                        None, message)]


@dataclass(frozen=True, slots=True)
class InterfaceCheck:
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
        has = "no interfaces" if actual is None else show(actual)
        message = f"needs a {self.type!r} interface, but the device has {has}"
        return [Failure(self.stage, "interfaces", "ContainsAll", {"type": self.type}, actual,
                        None, message)]


# --------------------------------------------------------------------------- compilation


def locate_required_resources(path: Path) -> Path:
    """Where requiredResources sits: beside a `.../deviceConstraints` path, at a
    `.../requiredResources` path itself, else inside `path` (a profile)."""
    if path and path[-1] == "deviceConstraints":
        return (*path[:-1], "requiredResources")
    if path and path[-1] == "requiredResources":
        return path
    return (*path, "requiredResources")


def compile_required_resources(
    log: ProblemCollector, value: Any, path: Path
) -> list[CpuCheck | QuantityCheck | PeripheralCheck | InterfaceCheck]:
    """The legacy block: its capacity checks, then one check per peripheral and interface."""
    stage = "requiredResources"
    checks: list[CpuCheck | QuantityCheck | PeripheralCheck | InterfaceCheck] = []
    checks += compile_capacity(log, value, path, stage, _LEGACY_FIELDS, "requiredResources")
    if not isinstance(value, Mapping):
        return checks
    extra: list[PeripheralCheck | InterfaceCheck | None] = []
    for i, item in log.items(value, "peripherals", path):
        extra.append(_compile_peripheral(log, item, (*path, "peripherals", i), stage))
    for i, item in log.items(value, "interfaces", path):
        extra.append(_compile_interface(log, item, (*path, "interfaces", i), stage))
    return checks + [c for c in extra if c is not None]


def _compile_peripheral(log: ProblemCollector, value: Any, path: Path,
                        stage: str) -> PeripheralCheck | None:
    before = len(log.problems)
    doc = log.fields_of(value, path, "a peripheral", _PERIPHERAL_FIELDS)
    if doc is None:
        return None
    if "type" not in doc:
        log.problem(path, "a peripheral needs `type`", expected="e.g. type: gpu")
    for field in _PERIPHERAL_FIELDS:
        if field in doc and (not isinstance(doc[field], str) or not doc[field]):
            log.problem((*path, field), f"peripheral {field} must be a non-empty string",
                        expected="a non-empty string", found=doc[field])
    if len(log.problems) != before:
        return None
    return PeripheralCheck(stage, tuple((f, doc[f]) for f in _PERIPHERAL_FIELDS if f in doc))


def _compile_interface(log: ProblemCollector, value: Any, path: Path,
                       stage: str) -> InterfaceCheck | None:
    doc = log.fields_of(value, path, "an interface", _INTERFACE_FIELDS)
    if doc is None:
        return None
    kind = doc.get("type", MISSING)
    if isinstance(kind, str) and kind:
        return InterfaceCheck(stage, kind)
    if kind is MISSING:
        log.problem(path, "an interface needs `type`", expected="e.g. type: ethernet")
    else:
        log.problem((*path, "type"), "interface type must be a non-empty string",
                    expected="a non-empty string", found=kind)
    return None
