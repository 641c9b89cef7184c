"""Which of our deployments a cluster's report already counts, and by how much.

A cluster reports what is *available* on each node: allocatable minus the requests of the pods
scheduled there. Once a deployment's pods are scheduled, the report has already subtracted
them, so the WFM must not subtract the deployment again (docs/intents.md, "Capacity
accounting"). Our device client says which pods are whose: every node entry lists, under
`workloads`, the requests of the scheduled pods of each of our deployments
(`{deployment, pods, requested}`). A report without `workloads` on its nodes (another
vendor's client, an older one, or RBAC that hid the owners) says nothing about ownership,
and `workload_requests` returns None: the WFM then counts its deployments in full.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from margo.cluster import EXTENSION_KEY, exact_binary, is_gpu_resource, placement_properties
from margo.constraints import Usage
from margo.quantity import parse_quantity

__all__ = ["NodeRequests", "usage_of", "with_workload_released", "workload_requests"]

#: Node name -> what one deployment's scheduled pods request there (node resource shape:
#: cpu in cores, memory/ephemeralStorage as quantities, extended resources as counts).
NodeRequests = dict[str, dict[str, Any]]


def _nodes(body: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    resources = body.get("resources")
    nodes = resources.get("nodes") if isinstance(resources, Mapping) else None
    return [n for n in nodes if isinstance(n, Mapping)] if isinstance(nodes, list) else None


def workload_requests(body: Mapping[str, Any] | None) -> dict[str, NodeRequests] | None:
    """Deployment id -> node -> requests of its scheduled pods; None when the report does
    not attribute pods (some node without `workloads`, or no per-node facts at all)."""
    nodes = None if body is None else _nodes(body)
    if not nodes or any(not isinstance(n.get("workloads"), list) for n in nodes):
        return None
    out: dict[str, NodeRequests] = {}
    for node in nodes:
        for entry in node["workloads"]:
            if isinstance(entry, Mapping) and isinstance(entry.get("deployment"), str):
                requested = entry.get("requested")
                out.setdefault(entry["deployment"], {})[str(node.get("name"))] = (
                    dict(requested) if isinstance(requested, Mapping) else {})
    return out


def _amount(value: Any) -> Decimal:
    if isinstance(value, bool):
        return Decimal(0)
    if isinstance(value, int | float):
        return Decimal(str(value))
    try:
        return parse_quantity(str(value))
    except ValueError:
        return Decimal(0)


def usage_of(requests: NodeRequests | None) -> Usage:
    """The report's count of one deployment, summed over nodes (as `Demand.minus` takes it)."""
    if not requests:
        return Usage()
    cores = memory = storage = Decimal(0)
    gpus = 0
    for amounts in requests.values():
        cores += _amount(amounts.get("cpu", 0))
        memory += _amount(amounts.get("memory", 0))
        storage += _amount(amounts.get("ephemeralStorage", 0))
        gpus += sum(int(_amount(v)) for k, v in amounts.items() if is_gpu_resource(k))
    return Usage(cores, memory, storage, gpus)


def _shifted(amounts: dict[str, Any], requested: Mapping[str, Any], sign: int) -> None:
    """`amounts` plus (sign 1) or minus (sign -1) `requested`, in the node resource shape;
    never below zero."""
    for key, value in requested.items():
        total = max(Decimal(0), _amount(amounts.get(key, 0)) + sign * _amount(value))
        if key == "cpu":
            amounts[key] = int(total) if total == total.to_integral_value() else float(total)
        elif key in ("memory", "ephemeralStorage"):
            amounts[key] = exact_binary(total)
        else:
            amounts[key] = int(total)


def _release_node(node: dict[str, Any], mine: Mapping[str, Any] | None,
                  deployment: str | None) -> None:
    """One node as if the deployment's pods were not scheduled there: their requests back in
    `available`, out of `requested`, and its entry gone from `workloads`."""
    if mine:
        if isinstance(node.get("available"), dict):
            _shifted(node["available"], mine, 1)
        if isinstance(node.get("requested"), dict):
            _shifted(node["requested"], mine, -1)
    workloads = node.get("workloads")
    if deployment is not None and isinstance(workloads, list):
        node["workloads"] = [w for w in workloads if not (
            isinstance(w, Mapping) and w.get("deployment") == deployment)]


def _released_resources(resources: Mapping[str, Any], requests: NodeRequests,
                        deployment: str | None) -> dict[str, Any]:
    """The `resources` section with the deployment's pods released from every node, and
    from the per-GPU list (`gpus[].allocatedTo`)."""
    out = copy.deepcopy(dict(resources))
    nodes = out.get("nodes")
    for node in nodes if isinstance(nodes, list) else ():
        if isinstance(node, dict):
            _release_node(node, requests.get(str(node.get("name"))), deployment)
    gpus = out.get("gpus")
    for gpu in gpus if isinstance(gpus, list) and deployment is not None else ():
        if isinstance(gpu, dict) and gpu.get("allocatedTo") == deployment:
            del gpu["allocatedTo"]
    return out


def with_workload_released(view: Mapping[str, Any], body: Mapping[str, Any],
                           requests: NodeRequests,
                           deployment: str | None = None) -> dict[str, Any]:
    """The matching view as if one deployment's scheduled pods were not there: its requests
    given back to the nodes that hold them (`available` up, `requested` down, its
    `workloads` entries and GPU holds gone when `deployment`, its id, is given), and
    everything derived from the nodes worked out again: the placement properties (`cpus`,
    `memory`, `storage`, GPU `peripherals`), the view's `resources` section, and the cluster
    body under `x-margo-gitops-extensions.cluster` that cluster clauses and node-level
    requirements read (`margo.constraints.pointers.cluster_of`).

    Why: a deployment that is running is checked again on every compile, against a report
    from which its own pods are already subtracted; it must see what it had before it ran,
    in every clause, or it would make itself ineligible (and be removed, and come back: a
    flapping fleet)."""
    released = dict(body)
    resources = body.get("resources")
    if isinstance(resources, Mapping):
        released["resources"] = _released_resources(resources, requests, deployment)
    out = dict(view)
    out.update(placement_properties(released))
    if "resources" in released and "resources" in out:
        out["resources"] = released["resources"]
    extension = out.get(EXTENSION_KEY)
    if isinstance(extension, Mapping):
        out[EXTENSION_KEY] = {**extension, "cluster": released}
    return out
