"""Label selectors in Kubernetes' text form, for `margo get -l`.

`key=value` (or `==`), `key!=value`, `key` (has the label), `!key` (has not), `key in
(a,b)` and `key notin (a,b)`, comma-separated, all of which must hold: what `kubectl get
-l` accepts. Label values compare as text; a device's non-text label (a count, a list)
compares as its JSON text (`3`, `true`, `["amd64"]`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Requirement", "SelectorError", "label_text", "matches", "parse_selector"]

#: A label key: an optional DNS-subdomain prefix and `/`, then a name (Kubernetes' rule).
_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
#: A value: Kubernetes' are narrower, but a Margo label's value may hold any of these.
_VALUE = r"[^\s,()=!]*"
_EQUALITY = re.compile(rf"^\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*$")
_EXISTS = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")
_SET = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*$")


class SelectorError(ValueError):
    """A selector that is not in Kubernetes' syntax; the message quotes the part."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement: `operator` is `in`, `notin`, `exists` or `!` (does not exist)."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def holds(self, labels: Mapping[str, Any]) -> bool:
        present = self.key in labels
        if self.operator == "exists":
            return present
        if self.operator == "!":
            return not present
        inside = present and label_text(labels[self.key]) in self.values
        return inside if self.operator == "in" else not inside


def label_text(value: Any) -> str:
    """A label value as a selector compares it: text as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _split(selector: str) -> list[str]:
    """The requirements of `selector`: split on commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _requirement(text: str) -> Requirement:
    if found := _SET.match(text):
        values = frozenset(v.strip() for v in found.group(3).split(","))
        if not all(re.fullmatch(_VALUE, v) for v in values):
            raise SelectorError(f"invalid value in {text.strip()!r}")
        return Requirement(found.group(1), found.group(2), values)
    if found := _EQUALITY.match(text):
        operator = "notin" if found.group(2) == "!=" else "in"
        return Requirement(found.group(1), operator, frozenset({found.group(3)}))
    if found := _EXISTS.match(text):
        return Requirement(found.group(2), "!" if found.group(1) else "exists")
    raise SelectorError(f"not a label requirement: {text.strip()!r} (key, !key, key=value, "
                        "key!=value, key in (a,b), key notin (a,b))")


def parse_selector(selector: str) -> tuple[Requirement, ...]:
    """Every requirement of a comma-separated selector; SelectorError for bad syntax (an
    empty selector selects everything)."""
    if not selector.strip():
        return ()
    return tuple(_requirement(part) for part in _split(selector))


def matches(requirements: tuple[Requirement, ...], labels: Mapping[str, Any] | None) -> bool:
    """Whether `labels` meet every requirement (no labels: an empty set of labels)."""
    return all(r.holds(labels or {}) for r in requirements)
