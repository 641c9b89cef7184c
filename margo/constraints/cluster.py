"""Requirements on a Kubernetes cluster (the `x-margo-gitops-extensions.cluster` extension):
nodes with capacity, a version range, API groups, CRDs, a default storage class.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from operator import eq, ge, gt, le, lt
from typing import Any, Final

from margo.constraints.capacity import (
    _CpuCheck,
    _InterfaceCheck,
    _PeripheralCheck,
    _QuantityCheck,
    _reported_bytes,
)
from margo.constraints.operators import _Expression
from margo.constraints.pointers import _get, _is_object, cluster_of
from margo.constraints.results import Failure, _kind, _number, _show
from margo.constraints.vocabulary import _MISSING
from margo.quantity import format_quantity

__all__ = ["Bound", "Version", "parse_version_range"]

_NO_CLUSTER: Final = "the device reported no Kubernetes cluster data"
_LISTED_NODES: Final = 8  # near misses named per failure; the rest are counted
_NAMED_QUALIFIERS: Final = 5

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
_VERSION_TEXT = r"v[0-9]+(?:(?:alpha|beta)[0-9]+)?"
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_API_VERSION = re.compile(_VERSION_TEXT)
_API_GROUP = re.compile(rf"({_DNS_LABEL}(?:\.{_DNS_LABEL})*)(?:/({_VERSION_TEXT}))?")
_CRD_NAME = re.compile(rf"([A-Za-z][A-Za-z0-9]*)\.({_DNS_LABEL}(?:\.{_DNS_LABEL})+)")


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


def _section(cluster: Mapping[str, Any], *keys: str) -> Any:
    """cluster[k1][k2]...; `_MISSING` as soon as a level is absent or not an object."""
    value: Any = cluster
    for key in keys:
        value = _get(value, key)
    return value


def _unknown_note(cluster: Mapping[str, Any], *words: str) -> str:
    """What the cluster said it could not read about a field (RBAC, errors), as a note, so a
    missing section reads as "could not read: forbidden" rather than as "has none"."""
    unknown = cluster.get("unknown")
    if not isinstance(unknown, list | tuple):
        return ""
    notes = []
    for entry in unknown:
        what = str(entry.get("what", "")) if isinstance(entry, Mapping) else ""
        if what and any(word.lower() in what.lower() for word in words):
            reason = entry.get("reason")
            notes.append(f"{what}: {reason}" if reason else what)
    return f" (the cluster could not read {'; '.join(notes)})" if notes else ""


def _number_text(amount: Decimal | int | float) -> str:
    if isinstance(amount, Decimal):
        amount = int(amount) if amount == amount.to_integral_value() else float(amount)
    return str(_number(amount))


@dataclass(frozen=True, slots=True)
class _NodeAmount:
    """One per-node capacity clause, compared with what the node has AVAILABLE (allocatable
    minus what scheduled pods already request), never with its raw capacity."""

    field: str  # key in the node's `available` object
    unit: str  # "cores", "memory", "ephemeral storage" or the extended resource name
    quantity: bool  # memory-like byte quantity (else a number of cores or devices)
    required: Decimal | int | float
    shown: str  # "2 cores", "4Gi memory", "1 nvidia.com/gpu"

    def amount(self, node: Mapping[str, Any]) -> Decimal | int | float | None:
        value = _get(node.get("available"), self.field)
        if type(value) in (int, float) and not self.quantity:
            return value
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            parsed = _reported_bytes(value)  # also reads "1500m" cores
            return parsed if isinstance(parsed, Decimal) else None
        return None

    def ok(self, node: Mapping[str, Any]) -> bool:
        amount = self.amount(node)
        return amount is not None and amount >= self.required

    def has(self, node: Mapping[str, Any]) -> str:
        amount = self.amount(node)
        if amount is None:
            return f"no {self.unit}"
        if self.quantity:
            return f"{format_quantity(Decimal(amount))} {self.unit}"
        shown = _number_text(amount)
        return f"{shown} {'core' if self.unit == 'cores' and shown == '1' else self.unit}"


def _node_name(node: Any, index: int) -> str:
    name = node.get("name") if isinstance(node, Mapping) else None
    return name if isinstance(name, str) and name else f"node {index}"


def _summary_nodes(summary: list[Any] | tuple[Any, ...]) -> list[dict[str, Any]]:
    """Nodes of a manifest carrying only the proposal's `nodeSummary`. The proposal defines it
    as the allocatable resources of Ready nodes for "does a single node fit" questions and
    reports no requests, so allocatable stands in for available (said in explanations)."""
    nodes = []
    for index, entry in enumerate(summary):
        if not isinstance(entry, Mapping):
            continue
        amounts: dict[str, Any] = {}
        if "allocatableCpu" in entry:
            amounts["cpu"] = entry["allocatableCpu"]
        if "allocatableMemory" in entry:
            amounts["memory"] = entry["allocatableMemory"]
        for key in ("allocatableGpu", "allocatableExtendedResources"):
            if isinstance(entry.get(key), Mapping):
                amounts.update(entry[key])
        nodes.append({"name": f"nodeSummary[{index}]", "architecture": entry.get("architecture"),
                      "ready": True, "schedulable": True, "allocatable": amounts,
                      "available": amounts})
    return nodes


_SUMMARY_ORIGIN: Final = " (from nodeSummary: allocatable amounts, the cluster reports no requests)"


def _cluster_nodes(cluster: Mapping[str, Any]) -> tuple[list[Any] | tuple[Any, ...], str] | None:
    """The cluster's node objects and a note on where they came from; None if it has none."""
    nodes = _section(cluster, "resources", "nodes")
    if isinstance(nodes, list | tuple):
        return nodes, ""
    summary = _section(cluster, "resources", "nodeSummary")
    if isinstance(summary, list | tuple):
        return _summary_nodes(summary), _SUMMARY_ORIGIN
    return None


def _qualifying_text(names: list[str]) -> str:
    if not names:
        return "no node qualifies"
    shown = ", ".join(names[:_NAMED_QUALIFIERS])
    if len(names) > _NAMED_QUALIFIERS:
        shown += f", and {len(names) - _NAMED_QUALIFIERS} more"
    verb = "node qualifies" if len(names) == 1 else "nodes qualify"
    return f"{len(names)} {verb} ({shown})"


@dataclass(frozen=True, slots=True)
class _NodeRequirement:
    """At least `count` distinct nodes each pass the default filters (Ready, schedulable, unless
    the selector tests those itself), the node selector and every per-node capacity clause.
    Counting is all the WFM does: which node runs what stays with the Kubernetes scheduler."""

    stage: str
    index: int
    count: int
    amounts: tuple[_NodeAmount, ...]
    selector: tuple[_Expression, ...]
    only_ready: bool
    only_schedulable: bool
    required: Mapping[str, Any]  # as written, for reports

    def _qualifies(self, node: Any) -> bool:
        if not _is_object(node):
            return False
        if self.only_ready and node.get("ready") is not True:
            return False
        if self.only_schedulable and node.get("schedulable") is not True:
            return False
        for expr in self.selector:
            if not expr.test(expr.lookup(node)):
                return False
        return all(amount.ok(node) for amount in self.amounts)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cluster = cluster_of(properties)
        found = None if cluster is None else _cluster_nodes(cluster)
        if found is None:
            return False
        qualifying = 0
        for node in found[0]:
            if self._qualifies(node):
                qualifying += 1
                if qualifying >= self.count:
                    return True
        return False

    def wanted(self) -> str:
        text = f"{self.count} {'node' if self.count == 1 else 'nodes'}"
        if self.selector:
            text += " matching " + " and ".join(e.text for e in self.selector)
        if self.amounts:
            text += " with >= " + " and ".join(a.shown for a in self.amounts) + " available"
        return text

    def misses(self, node: Any) -> list[str]:
        """Why one node does not qualify, every reason (empty when it does)."""
        if not isinstance(node, Mapping):
            return [f"is {_kind(node)}, not a node object"]
        reasons = []
        if self.only_ready and node.get("ready") is not True:
            reasons.append("is not Ready" if node.get("ready") is False else "has no Ready status")
        if self.only_schedulable and node.get("schedulable") is not True:
            reasons.append("is not schedulable" if node.get("schedulable") is False
                           else "has no schedulable status")
        for expr in self.selector:
            actual = expr.lookup(node)
            if not expr.test(actual):
                has = "nothing there" if actual is _MISSING else _show(actual, 60)
                reasons.append(f"fails {expr.text} (has {has})")
        short = [amount for amount in self.amounts if not amount.ok(node)]
        if short:
            reasons.append("has " + " and ".join(a.has(node) for a in short) + " available")
        return reasons

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        needs = f"needs {self.wanted()}"
        cluster = cluster_of(properties)
        if cluster is None:
            return [self._failure(f"{needs}, but {_NO_CLUSTER}", None)]
        found = _cluster_nodes(cluster)
        if found is None:
            note = _unknown_note(cluster, "node")
            return [self._failure(f"{needs}, but the cluster reported no nodes{note}", None)]
        nodes, origin = found
        qualifying: list[str] = []
        misses: dict[str, list[str]] = {}
        for index, node in enumerate(nodes):
            reasons = self.misses(node)
            if reasons:
                misses[_node_name(node, index)] = reasons
            else:
                qualifying.append(_node_name(node, index))
        message = f"{needs}{origin}; {_qualifying_text(qualifying)}"
        if not nodes:
            message += " (the cluster reported no nodes)"
        listed = list(misses.items())[:_LISTED_NODES]
        message += "".join(f"; {name} {', '.join(reasons)}" for name, reasons in listed)
        if len(misses) > len(listed):
            message += f"; and {len(misses) - len(listed)} more nodes do not qualify"
        return [self._failure(message, {"qualifying": qualifying, "nodes": misses})]

    def _failure(self, message: str, actual: Any) -> Failure:
        return Failure(self.stage, f"cluster.nodes[{self.index}]", ">=", dict(self.required),
                       actual, None, message)


def _cluster_failure(stage: str, key: str, operator: str, required: Any, actual: Any,
                     message: str) -> list[Failure]:
    return [Failure(stage, f"cluster.{key}", operator, required, actual, None, message)]


@dataclass(frozen=True, slots=True)
class _VersionRequirement:
    """The cluster's Kubernetes version (metadata.kubernetesVersion) is in a range; patch and
    distribution suffixes (`+k3s1`, `-gke.100`) are ignored."""

    stage: str
    text: str
    alternatives: tuple[tuple[Bound, ...], ...]

    @staticmethod
    def _reported(cluster: Mapping[str, Any] | None) -> Any:
        return _MISSING if cluster is None else _section(cluster, "metadata", "kubernetesVersion")

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
            message = f"{needs}, but {_NO_CLUSTER}"
        elif raw is _MISSING:
            message = (f"{needs}, but the cluster reported no Kubernetes version"
                       f"{_unknown_note(cluster, 'kubernetesVersion')}")
        elif self._version(raw) is None:
            message = f"{needs}, but the cluster reports {_show(raw)}, not MAJOR.MINOR[.PATCH]"
        else:
            message = f"{needs}, but the cluster runs {raw}"
        return _cluster_failure(self.stage, "kubernetesVersion", "In", self.text,
                                None if raw is _MISSING else raw, message)


def _serves(groups: list[Any] | tuple[Any, ...], group: str, version: str | None) -> bool:
    for entry in groups:
        if _get(entry, "name") == group:
            versions = _get(entry, "versions")
            if version is None or (isinstance(versions, list | tuple) and version in versions):
                return True
    return False


@dataclass(frozen=True, slots=True)
class _ApiGroupsRequirement:
    """Every listed API group (at the listed version, if one is given) is served."""

    stage: str
    entries: tuple[tuple[str, str, str | None], ...]  # (as written, group, version or None)

    @staticmethod
    def _served(properties: Mapping[str, Any]) -> dict[str, list[Any]] | None:
        cluster = cluster_of(properties)
        groups = _MISSING if cluster is None else _section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return None
        served: dict[str, list[Any]] = {}
        for group in groups:
            if isinstance(group, Mapping) and isinstance(group.get("name"), str):
                versions = group.get("versions")
                served.setdefault(group["name"], []).extend(
                    versions if isinstance(versions, list | tuple) else [])
        return served

    def _missing(self, served: dict[str, list[Any]]) -> list[str]:
        missing = []
        for text, group, version in self.entries:
            if group not in served:
                missing.append(f"{text} (group not served)")
            elif version is not None and version not in served[group]:
                missing.append(f"{text} (served: {', '.join(map(str, served[group])) or 'none'})")
        return missing

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cluster = cluster_of(properties)
        groups = _MISSING if cluster is None else _section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return False
        return all(_serves(groups, group, version) for _, group, version in self.entries)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        served = self._served(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs API {'group' if len(required) == 1 else 'groups'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif served is None:
            message = (f"{needs}, but the cluster reported no API groups"
                       f"{_unknown_note(cluster, 'apiGroups', 'api groups', 'discovery')}")
        else:
            missing = self._missing(served)
            if not missing:
                return []
            message = f"{needs}, but the cluster lacks {'; '.join(missing)}"
        return _cluster_failure(self.stage, "apiGroups", "ContainsAll", required,
                                None if served is None else sorted(served), message)


def _crd_matches(entry: Mapping[str, Any], text: str, resource: str, group: str) -> bool:
    """`plural.group` or `Kind.group` against a reported CRD. The proposal reports kinds, not
    plurals, so a plural is recognised as the lower-cased kind plus s / es / y->ies (or an
    explicit `name`/`plural` field when the reporter adds one)."""
    if entry.get("group") != group:
        return False
    if entry.get("name") == text or entry.get("plural") == resource:
        return True
    kind = entry.get("kind")
    if not isinstance(kind, str) or not kind:
        return False
    if resource[0].isupper():
        return kind == resource
    lower = kind.lower()
    plurals = {lower, lower + "s", lower + "es"}
    if lower.endswith("y"):
        plurals.add(lower[:-1] + "ies")
    return resource in plurals


@dataclass(frozen=True, slots=True)
class _CrdRequirement:
    """Every listed CustomResourceDefinition is installed."""

    stage: str
    entries: tuple[tuple[str, str, str], ...]  # (as written, plural or Kind, group)

    @staticmethod
    def _reported(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        crds = (_MISSING if cluster is None
                else _section(cluster, "apiSurface", "customResourceDefinitions"))
        if not isinstance(crds, list | tuple):
            return None
        return [crd for crd in crds if isinstance(crd, Mapping)]

    def _missing(self, crds: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
        return [(text, group) for text, resource, group in self.entries
                if not any(_crd_matches(crd, text, resource, group) for crd in crds)]

    def passes(self, properties: Mapping[str, Any]) -> bool:
        crds = self._reported(properties)
        return crds is not None and not self._missing(crds)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        crds = self._reported(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs {'CRD' if len(required) == 1 else 'CRDs'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif crds is None:
            note = _unknown_note(cluster, "customResourceDefinitions", "crd")
            message = f"{needs}, but the cluster reported no CRDs{note}"
        else:
            missing = self._missing(crds)
            if not missing:
                return []
            details = []
            for text, group in missing:
                kinds = sorted({str(c.get("kind")) for c in crds if c.get("group") == group})
                details.append(f"{text} (group {group} has {', '.join(kinds)})" if kinds
                               else f"{text} (no CRD of group {group})")
            message = f"{needs}, but the cluster lacks {'; '.join(details)}"
        actual = None if crds is None else [f"{c.get('kind')}.{c.get('group')}" for c in crds]
        return _cluster_failure(self.stage, "customResourceDefinitions", "ContainsAll", required,
                                actual, message)


@dataclass(frozen=True, slots=True)
class _StorageClassRequirement:
    """The cluster has a default StorageClass (`name` None), or `name` is the default."""

    stage: str
    name: str | None

    @staticmethod
    def _classes(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        classes = _MISSING if cluster is None else _section(cluster, "capabilities",
                                                            "storageClasses")
        if not isinstance(classes, list | tuple):
            return None
        return [c for c in classes if isinstance(c, Mapping)]

    def _ok(self, classes: list[Mapping[str, Any]]) -> bool:
        return any(c.get("isDefault") is True and (self.name is None or c.get("name") == self.name)
                   for c in classes)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        classes = self._classes(properties)
        return classes is not None and self._ok(classes)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        classes = self._classes(properties)
        needs = ("needs a default storage class" if self.name is None
                 else f"needs {self.name!r} as the default storage class")
        cluster = cluster_of(properties)
        defaults = [str(c.get("name")) for c in classes or () if c.get("isDefault") is True]
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif classes is None:
            note = _unknown_note(cluster, "storageClasses", "storage")
            message = f"{needs}, but the cluster reported no storage classes{note}"
        elif self._ok(classes):
            return []
        elif defaults:
            message = f"{needs}, but the default is {', '.join(map(repr, defaults))}"
        else:
            names = ", ".join(repr(str(c.get("name"))) for c in classes) or "none"
            message = f"{needs}, but no storage class is the default (classes: {names})"
        return _cluster_failure(self.stage, "defaultStorageClass", "In",
                                True if self.name is None else self.name, defaults or None,
                                message)


_Check = (_CpuCheck | _QuantityCheck | _PeripheralCheck | _InterfaceCheck | _NodeRequirement
          | _VersionRequirement | _ApiGroupsRequirement | _CrdRequirement
          | _StorageClassRequirement)
