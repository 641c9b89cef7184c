"""Which devices does each intent target? Answered per intent for the whole fleet at once.

Asking every intent about every device is the compiler's innermost loop (30 intents x
10,000 devices). Most selectors start with a label `In` expression (`site In [plant-a]`),
so an index from label values to devices narrows each rule to its candidates, and only
those are evaluated in full. The answer is exactly `Intent.targets` (a test checks that);
an intent whose selectors cannot be narrowed is evaluated on every device, as before.
Sets are built lazily, on the first question about an intent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from compiler.intents import Intent
from compiler.snapshot import Device

__all__ = ["TargetIndex"]


def _tag(value: Any) -> tuple[str, Any] | None:
    """Equality class of a scalar under the constraint grammar's strict `In` (1 == 1.0,
    but "1" != 1 and true != 1); None for values `In` never matches."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, (int, float)):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    return None


def _narrowing_expression(rule: Mapping[str, Any]) -> tuple[str, list[Any]] | None:
    """A label `In` expression every device matching the rule must satisfy, if any."""
    selector = rule.get("labelSelector") or {}
    for expression in selector.get("matchExpressions", []):
        if expression.get("operator") == "In" and expression.get("values"):
            return expression["key"], list(expression["values"])
    return None


class TargetIndex:
    def __init__(self, devices: Mapping[str, Device]):
        self._devices = devices
        self._labels: dict[str, dict[tuple[str, Any], set[str]]] = {}
        self._targeted: dict[str, frozenset[str]] = {}

    def _label_index(self, key: str) -> dict[tuple[str, Any], set[str]]:
        index = self._labels.get(key)
        if index is None:
            index = {}
            for device_id, device in self._devices.items():
                labels = device.labels
                if key in labels and (tag := _tag(labels[key])) is not None:
                    index.setdefault(tag, set()).add(device_id)
            self._labels[key] = index
        return index

    def _candidates(self, intent: Intent) -> Iterable[str]:
        spec = intent.document.value.get("spec", {})
        rules = spec.get("targets", {}).get("selectors") or []
        candidates: set[str] = set()
        for rule in rules:
            narrowing = _narrowing_expression(rule)
            if narrowing is None:
                return self._devices.keys()
            key, values = narrowing
            index = self._label_index(key)
            for value in values:
                tag = _tag(value)
                if tag is not None:
                    candidates |= index.get(tag, set())
        return candidates

    def targeted(self, intent: Intent) -> frozenset[str]:
        """Every device of the snapshot the intent targets."""
        found = self._targeted.get(intent.name)
        if found is not None:
            return found
        if intent.targets_everything:
            found = frozenset(self._devices)
        else:
            selected = set(intent.devices or ()) & self._devices.keys()
            if intent.selector is not None:
                selector, devices = intent.selector, self._devices
                if selector.reads_properties:
                    selected.update(
                        device_id for device_id in self._candidates(intent)
                        if selector.is_eligible(devices[device_id].matching,
                                                devices[device_id].labels))
                else:  # labels only: no device's model needs building to answer
                    selected.update(
                        device_id for device_id in self._candidates(intent)
                        if selector.is_eligible(None, devices[device_id].labels))
            found = frozenset(selected)
        self._targeted[intent.name] = found
        return found

    def targets(self, intent: Intent, device_id: str) -> bool:
        return device_id in self.targeted(intent)
