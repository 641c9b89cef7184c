"""The Kubernetes version dialect (`cluster.kubernetesVersion`): a version range such as
`>=1.28 <1.33 || =1.34` that the cluster's reported version must fall in; parsed, compiled and
checked here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import eq, ge, gt, le, lt
from typing import Any, Final

from margo.constraints.cluster_report import NO_CLUSTER, cluster_failure, section, unknown_note
from margo.constraints.pointers import cluster_of
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure, show
from margo.constraints.vocabulary import MISSING
from margo.errors import Path

__all__ = ["Bound", "Version", "VersionRequirement", "compile_version_requirement",
           "parse_version_range"]

Version = tuple[int, int, int]
Bound = tuple[str, Version]  # (">=" | ">" | "<=" | "<" | "==", version)

_COMPARISONS: Final[Mapping[str, Callable[[Version, Version], bool]]] = {
    ">=": ge, ">": gt, "<=": le, "<": lt, "==": eq,
}
_COMPARATOR = re.compile(
    r"(>=|<=|>|<|=)?\s*v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(?:\.(0|[1-9][0-9]*))?"
)
_REPORTED_VERSION = re.compile(r"v?([0-9]+)\.([0-9]+)(?:\.([0-9]+))?")
_RANGE_EXPECTED = ("a version range such as '>=1.28 <1.33' (comparators >=, >, <=, <, = with "
                   "MAJOR.MINOR[.PATCH], space = AND, || = OR)")


def _partial_bounds(op: str, major: int, minor: int, patch: int | None) -> list[Bound]:
    """Comparator -> bounds. A MAJOR.MINOR version stands for every patch of that minor:
    `>1.31` is `>=1.32.0`, `<=1.31` is `<1.32.0`, `=1.31` is `>=1.31.0 <1.32.0`."""
    if patch is not None:
        return [("==" if op == "=" else op, (major, minor, patch))]
    low, high = (major, minor, 0), (major, minor + 1, 0)
    return {">=": [(">=", low)], "<": [("<", low)], ">": [(">=", high)],
            "<=": [("<", high)], "=": [(">=", low), ("<", high)]}[op]


def parse_version_range(text: str) -> tuple[tuple[Bound, ...], ...]:
    """Parse a Kubernetes version range into OR-alternatives of AND-ed bounds.

    Grammar: alternatives separated by `||`; each is one or more whitespace-separated
    comparators `[>=|>|<=|<|=]MAJOR.MINOR[.PATCH]` (a leading `v` is allowed, no operator
    means `=`). Raises `ValueError` saying what could not be read.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a version range is a non-empty string")
    alternatives: list[tuple[Bound, ...]] = []
    for alternative in text.split("||"):
        words = alternative.split()
        if not words:
            raise ValueError(f"an alternative of {text!r} is empty")
        bounds: list[Bound] = []
        for word in _comparator_words(words):
            found = _COMPARATOR.fullmatch(word)
            if found is None:
                raise ValueError(f"cannot read {word!r} in {text!r}")
            op, major, minor, patch = found.groups()
            bounds += _partial_bounds(op or "=", int(major), int(minor),
                                      None if patch is None else int(patch))
        alternatives.append(tuple(bounds))
    return tuple(alternatives)


def _comparator_words(words: list[str]) -> list[str]:
    """`>= 1.28` is one comparator written with a space: join a bare operator to its version."""
    joined: list[str] = []
    for word in words:
        if joined and joined[-1] in (">=", "<=", ">", "<", "="):
            joined[-1] += word
        else:
            joined.append(word)
    return joined


def _in_range(version: Version, alternatives: tuple[tuple[Bound, ...], ...]) -> bool:
    return any(all(_COMPARISONS[op](version, bound) for op, bound in alternative)
               for alternative in alternatives)


@dataclass(frozen=True, slots=True)
class VersionRequirement:
    """The cluster's Kubernetes version (metadata.kubernetesVersion) is in a range; patch and
    distribution suffixes (`+k3s1`, `-gke.100`) are ignored."""

    stage: str
    text: str
    alternatives: tuple[tuple[Bound, ...], ...]

    @staticmethod
    def _reported(cluster: Mapping[str, Any] | None) -> Any:
        return MISSING if cluster is None else section(cluster, "metadata", "kubernetesVersion")

    @staticmethod
    def _version(raw: Any) -> Version | None:
        found = _REPORTED_VERSION.match(raw) if isinstance(raw, str) else None
        if found is None:
            return None
        return int(found[1]), int(found[2]), int(found[3] or 0)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        version = self._version(self._reported(cluster_of(properties)))
        return version is not None and _in_range(version, self.alternatives)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        cluster = cluster_of(properties)
        raw = self._reported(cluster)
        needs = f"needs Kubernetes {self.text}"
        if cluster is None:
            message = f"{needs}, but {NO_CLUSTER}"
        elif raw is MISSING:
            message = (f"{needs}, but the cluster reported no Kubernetes version"
                       f"{unknown_note(cluster, 'kubernetesVersion')}")
        elif self._version(raw) is None:
            message = f"{needs}, but the cluster reports {show(raw)}, not MAJOR.MINOR[.PATCH]"
        else:
            message = f"{needs}, but the cluster runs {raw}"
        return cluster_failure(self.stage, "kubernetesVersion", "In", self.text,
                                None if raw is MISSING else raw, message)


def compile_version_requirement(log: ProblemCollector, value: Any,
                                path: Path) -> VersionRequirement | None:
    """`kubernetesVersion`: a range the cluster's version must be in."""
    try:
        alternatives = parse_version_range(value)
    except ValueError as exc:
        log.problem(path, f"kubernetesVersion is not a version range: {exc}",
                    expected=_RANGE_EXPECTED, found=value)
        return None
    return VersionRequirement("cluster", value, alternatives)
