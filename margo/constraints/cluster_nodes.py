"""The node dialect (`cluster.nodes`): "at least N nodes, each Ready and schedulable, matching
a selector, with this much AVAILABLE" (allocatable minus what scheduled pods request);
compiled and checked here.

Counting is all the WFM does: which node runs what stays with the Kubernetes scheduler. A
manifest with only the proposal's `nodeSummary` is read as nodes whose allocatable amounts
stand in for available ones, and explanations say so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

from margo.constraints.capacity import parse_reported_text, reported_bytes
from margo.constraints.cluster_report import NO_CLUSTER, section, unknown_note
from margo.constraints.expressions import Expression, compile_selector
from margo.constraints.pointers import cluster_of, is_object, member, parse_pointer
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure, display_number, is_number, kind_of, show
from margo.constraints.vocabulary import MISSING
from margo.errors import Path, short_repr
from margo.quantity import format_quantity, parse_quantity

__all__ = ["NodeAmount", "NodeRequirement", "compile_node_requirements"]

_LISTED_NODES: Final = 8  # near misses named per failure; the rest are counted
_NAMED_QUALIFIERS: Final = 5
_NODE_FIELDS: Final = ("count", "capacity", "selector")
_NODE_CAPACITY_FIELDS: Final = ("cpu", "memory", "ephemeralStorage", "resources")


def _number_text(amount: Decimal | int | float) -> str:
    if isinstance(amount, Decimal):
        amount = int(amount) if amount == amount.to_integral_value() else float(amount)
    return str(display_number(amount))


@dataclass(frozen=True, slots=True)
class NodeAmount:
    """One per-node capacity clause, compared with what the node has AVAILABLE (allocatable
    minus what scheduled pods already request), never with its raw capacity."""

    field: str  # key in the node's `available` object
    unit: str  # "cores", "memory", "ephemeral storage" or the extended resource name
    quantity: bool  # memory-like byte quantity (else a number of cores or devices)
    required: Decimal | int | float
    shown: str  # "2 cores", "4Gi memory", "1 nvidia.com/gpu"

    def amount(self, node: Mapping[str, Any]) -> Decimal | int | float | None:
        value = member(node.get("available"), self.field)
        if type(value) in (int, float) and not self.quantity:
            plain: int | float = value  # a plain number of cores or devices, as reported
            return plain
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            parsed = reported_bytes(value)  # also reads "1500m" cores
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
    nodes = section(cluster, "resources", "nodes")
    if isinstance(nodes, list | tuple):
        return nodes, ""
    summary = section(cluster, "resources", "nodeSummary")
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
class NodeRequirement:
    """At least `count` distinct nodes each pass the default filters (Ready, schedulable, unless
    the selector tests those itself), the node selector and every per-node capacity clause.
    Counting is all the WFM does: which node runs what stays with the Kubernetes scheduler."""

    stage: str
    index: int
    count: int
    amounts: tuple[NodeAmount, ...]
    selector: tuple[Expression, ...]
    only_ready: bool
    only_schedulable: bool
    required: Mapping[str, Any]  # as written, for reports

    def _qualifies(self, node: Any) -> bool:
        if not is_object(node):
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
            return [f"is {kind_of(node)}, not a node object"]
        reasons = []
        if self.only_ready and node.get("ready") is not True:
            reasons.append("is not Ready" if node.get("ready") is False else "has no Ready status")
        if self.only_schedulable and node.get("schedulable") is not True:
            reasons.append("is not schedulable" if node.get("schedulable") is False
                           else "has no schedulable status")
        for expr in self.selector:
            actual = expr.lookup(node)
            if not expr.test(actual):
                has = "nothing there" if actual is MISSING else show(actual, 60)
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
            return [self._failure(f"{needs}, but {NO_CLUSTER}", None)]
        found = _cluster_nodes(cluster)
        if found is None:
            note = unknown_note(cluster, "node")
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


# --------------------------------------------------------------------------- compilation


def compile_node_requirements(log: ProblemCollector, value: Any,
                              path: Path) -> list[NodeRequirement | None]:
    """`nodes`: every entry a requirement of its own (AND); None where an entry is invalid."""
    if not isinstance(value, list | tuple) or not value:
        log.problem(path, "nodes must be a non-empty list of node requirements",
                    expected="a list such as [{count: 2, capacity: {cpu: 2}}] (AND)",
                    found=value)
        return []
    return [_compile_node_requirement(log, raw, (*path, i), i) for i, raw in enumerate(value)]


def _compile_node_requirement(log: ProblemCollector, value: Any, path: Path,
                              index: int) -> NodeRequirement | None:
    before = len(log.problems)
    doc = log.fields_of(value, path, "a node requirement", _NODE_FIELDS)
    if doc is None:
        return None
    count = doc.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        log.problem((*path, "count"), "count must be a whole number of nodes, at least 1",
                    expected="an integer >= 1", found=count)
    amounts = (_compile_node_capacity(log, doc["capacity"], (*path, "capacity"))
               if "capacity" in doc else ())
    selector = compile_selector(log, doc.get("selector", MISSING), (*path, "selector"),
                                labels=False, extended=True)
    if len(log.problems) != before:
        return None
    tested = {parse_pointer(e.key)[0] for e in selector if e.key}
    required: dict[str, Any] = {"count": count}
    if "capacity" in doc:
        required["capacity"] = doc["capacity"]
    if selector:
        required["selector"] = [e.text for e in selector]
    return NodeRequirement("cluster", index, count, amounts, selector,
                           "ready" not in tested, "schedulable" not in tested, required)


def _compile_node_capacity(log: ProblemCollector, value: Any,
                           path: Path) -> tuple[NodeAmount, ...]:
    doc = log.fields_of(value, path, "node capacity", _NODE_CAPACITY_FIELDS)
    if doc is None:
        return ()
    if not doc:
        log.problem(path, "node capacity is empty",
                    expected="one or more of " + ", ".join(_NODE_CAPACITY_FIELDS))
    amounts: list[NodeAmount | None] = []
    if "cpu" in doc:
        amounts.append(_compile_node_cores(log, doc["cpu"], (*path, "cpu")))
    for field, unit in (("memory", "memory"), ("ephemeralStorage", "ephemeral storage")):
        if field in doc:
            amounts.append(_compile_node_bytes(log, doc[field], (*path, field), field, unit))
    if "resources" in doc:
        amounts += _compile_node_resources(log, doc["resources"], (*path, "resources"))
    return tuple(a for a in amounts if a is not None)


def _compile_node_cores(log: ProblemCollector, value: Any, path: Path) -> NodeAmount | None:
    """Cores as a number (2, 1.5) or a Kubernetes CPU quantity ("1500m")."""
    cores: Decimal | int | float | None = None
    if is_number(value) and math.isfinite(value) and value > 0:
        cores = value
    elif isinstance(value, str):
        parsed = parse_reported_text(value)
        cores = parsed if isinstance(parsed, Decimal) and parsed > 0 else None
    if cores is None:
        log.problem(path, "cpu must be a number of cores greater than 0",
                    expected="e.g. 2, 0.5 or '500m'", found=value)
        return None
    shown = _number_text(cores)
    return NodeAmount("cpu", "cores", False, cores,
                      f"{shown} {'core' if shown == '1' else 'cores'}")


def _compile_node_bytes(log: ProblemCollector, value: Any, path: Path, field: str,
                        unit: str) -> NodeAmount | None:
    try:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ValueError(f"expected a quantity string, found {kind_of(value)}")
        required = parse_quantity(value)
    except ValueError as exc:
        log.problem(path, f"{field} is not a quantity: {exc}",
                    expected="a quantity such as 4Gi or 512Mi", found=value)
        return None
    return NodeAmount(field, unit, True, required, f"{format_quantity(required)} {unit}")


def _compile_node_resources(log: ProblemCollector, value: Any,
                            path: Path) -> list[NodeAmount | None]:
    doc = log.mapping(value, path, "node resources")
    if doc is None:
        return []
    amounts: list[NodeAmount | None] = []
    for name, count in doc.items():
        where = (*path, str(name))
        if not isinstance(name, str) or not name or name in _NODE_CAPACITY_FIELDS or (
                name == "ephemeral-storage"):
            log.problem(where, f"{short_repr(name)} is not an extended resource name "
                        "(cpu, memory and ephemeral storage have their own fields)",
                        expected="e.g. nvidia.com/gpu", found=name)
        elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
            log.problem(where, f"{name} must be a whole number of devices, at least 1",
                        expected="an integer >= 1", found=count)
        else:
            amounts.append(NodeAmount(name, name, False, count, f"{count} {name}"))
    return amounts
