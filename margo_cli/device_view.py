"""One device as `margo describe device` prints it (and `margo status --device`, which
shows its deployments, eligibility and history the same way): who it is, what it can run,
what it runs and how that went, where it could run more, its staged rollouts, its branch.

Built from the read API's answers only (`/api/fleet/devices/{id}`, and
`/api/fleet/rollout-members` when the server has it). Error messages are printed whole,
each line cleaned of escape sequences and indented under its deployment: the place to
read what a table cut short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compiler.explain import explanation_lines
from margo.kinds import Kind as DocumentKind
from margo.kinds import Shape
from margo.normalize import normalise
from margo_cli.resources import NODES_LABEL
from margo_cli.selectors import label_text
from margo_cli.tables import ago, cell, clean_lines, counts, table

__all__ = ["capability_lines", "deployment_lines", "device_lines", "eligibility_lines",
           "field_line", "history_lines", "membership_lines"]

#: Reports listed per deployment (the server keeps the last ten).
RECENT_REPORTS = 5
EXTENSION_KEY = "x-margo-gitops-extensions"


def field_line(name: str, value: Any) -> str:
    """`name:` and its value, values aligned in one column."""
    return f"{name:<20}{value}"


def _properties(doc: Mapping[str, Any], shape: str) -> tuple[Mapping[str, Any], Sequence[str]]:
    """rc.3 properties and the Oct-2024 roles of a capabilities document of any shape (the
    document as stored; one the normaliser cannot read shows its raw properties)."""
    try:
        model = normalise(DocumentKind.DEVICE_CAPABILITIES, Shape(shape), doc)
        return model.properties, model.roles
    except (ValueError, KeyError, TypeError, AttributeError):
        properties = doc.get("properties")
        return (properties if isinstance(properties, Mapping) else {}), ()


def _cpus(cpus: Any) -> str:
    if not isinstance(cpus, list) or not cpus:
        return "-"
    cores = sum(float(c.get("cores", 0)) for c in cpus if isinstance(c, Mapping))
    arches = sorted({str(c.get("architecture")) for c in cpus
                     if isinstance(c, Mapping) and c.get("architecture")})
    return f"{cores:g} cores in {len(cpus)} CPU(s)" + (f" ({', '.join(arches)})"
                                                      if arches else "")


def _gpus(properties: Mapping[str, Any]) -> str:
    found = [p for p in properties.get("peripherals") or []
             if isinstance(p, Mapping) and p.get("type") == "gpu"]
    names = [" ".join(str(p[k]) for k in ("manufacturer", "model") if p.get(k)) or "gpu"
             for p in found]
    return f"{len(found)}: {', '.join(sorted(names))}" if found else "none"


def _cluster(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    extension = doc.get(EXTENSION_KEY)
    body = extension.get("cluster") if isinstance(extension, Mapping) else None
    return body if isinstance(body, Mapping) else None


def _node_rows(nodes: list[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for node in nodes:
        allocatable = node.get("allocatable") or {}
        gpus = sum(int(g.get("count", 0)) for g in node.get("gpus") or [])
        ready = "yes" if node.get("ready") is True else "no" if node.get("ready") is False else "?"
        rows.append([cell(node.get("name"), 40), ", ".join(node.get("roles") or []) or "-",
                     ready, str(node.get("architecture") or "-"),
                     str(allocatable.get("cpu", "-")), str(allocatable.get("memory", "-")),
                     str(gpus)])
    return rows


def _node_lines(doc: Mapping[str, Any]) -> list[str]:
    """The nodes of a cluster's capabilities: a table when the client reported them, the
    count its labels carry otherwise."""
    body = _cluster(doc)
    nodes = ((body or {}).get("resources") or {}).get("nodes")
    if isinstance(nodes, list) and nodes:
        rendered = table(_node_rows(nodes), ["NAME", "ROLES", "READY", "ARCH", "CPU",
                                             "MEMORY", "GPUS"])
        return ["  nodes:", *("    " + line for line in rendered.splitlines())]
    count = (doc.get("labels") or {}).get(NODES_LABEL)
    return [field_line("  nodes:", count)] if count is not None else []


def capability_lines(doc: Mapping[str, Any], shape: str) -> list[str]:
    """Resources, deployment types, GPUs, roles and nodes of a capabilities document."""
    properties, roles = _properties(doc, shape)
    lines = ["capabilities:",
             field_line("  cpus:", _cpus(properties.get("cpus"))),
             field_line("  memory:", properties.get("memory", "-")),
             field_line("  storage:", properties.get("storage", "-")),
             field_line("  deployment types:",
                    ", ".join(properties.get("supportedDeploymentTypes") or []) or "-"),
             field_line("  runtimes:", ", ".join(properties.get("supportedRuntimes") or []) or "-"),
             field_line("  gpus:", _gpus(properties))]
    if roles:
        lines.append(field_line("  roles:", ", ".join(roles)))
    return lines + _node_lines(doc)


def _error_lines(error: Mapping[str, Any] | None) -> list[str]:
    if not error:
        return []
    code = f" [{error['code']}]" if error.get("code") else ""
    source = f" (from {error['source']})" if error.get("source") else ""
    message = clean_lines(error.get("message") or "") or ["(no message)"]
    return [f"    error{code}{source}:", *(f"      {line}" for line in message)]


def deployment_lines(deployments: Sequence[Mapping[str, Any]], now: float) -> list[str]:
    """Each deployment: its verdict, components, which bytes the report is about, its
    error in full, its recent reports."""
    if not deployments:
        return ["deployments: none"]
    lines = ["deployments:"]
    for d in deployments:
        applied = d.get("applied") or {}
        about = ("" if not applied else " (reported on the current bytes)"
                 if applied.get("current") else " (reported on previous bytes)")
        lines.append(f"  {d.get('intent') or '?'} ({d.get('applicationId') or '?'}): "
                     f"{d['state']}{about}, reported {ago(d.get('reportedAt'), now)}")
        components = ", ".join(f"{c.get('name')}={c.get('state')}"
                               for c in d.get("components") or [])
        if components:
            lines.append(f"    components: {cell(components, 200)}")
        lines += _error_lines(d.get("error"))
        repaired = d.get("repaired") or {}
        lines += [f"    repaired {cell(k, 60)}: {cell(v, 100)}" for k, v in repaired.items()]
        reports = d.get("statusHistory") or []
        if reports:
            lines.append("    recent reports: " + ", ".join(
                f"{r['state']} {ago(r.get('reportedAt'), now)}"
                for r in reports[:RECENT_REPORTS]))
    return lines


def eligibility_lines(eligibility: Any) -> list[str]:
    """Every intent's verdict on the device, each failing clause under it."""
    if isinstance(eligibility, str):
        return ["eligibility:", f"  {eligibility}"]
    return ["eligibility:", *(f"  {line}" for entry in eligibility
                              for line in explanation_lines(entry))]


def membership_lines(rollouts: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The staged rollouts the device is in; nothing from a server that cannot tell."""
    if rollouts is None:
        return []
    if not rollouts:
        return ["rollouts: none"]
    return ["rollouts:", *(
        f"  {r['intent']}: {r['status']}, wave {int(r['wave']) + 1}"
        + (f" ({r['waveName']})" if r.get("waveName") else "")
        + (", moved" if r.get("moved") else ", not moved yet") for r in rollouts)]


def history_lines(history: Sequence[Mapping[str, Any]], now: float | None = None) -> list[str]:
    """The branch's commits, newest first: id, (age,) first line of the message."""
    return ["history:", *(
        f"  {c['commit'][:10]} " + (f"{ago(c.get('time'), now)}  " if now else "")
        + cell(c["message"], 100) for c in history)]


def _labels(labels: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={label_text(v)}" for k, v in labels.items()) or "-"


def device_lines(detail: Mapping[str, Any], rollouts: Sequence[Mapping[str, Any]] | None,
                 now: float) -> list[str]:
    """The whole description (`detail`: the read API's `/api/fleet/devices/{id}`)."""
    doc: Mapping[str, Any] = detail.get("capabilities") or {}
    freshness = detail.get("freshness") or {}
    found = doc.get("properties")
    properties: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    kind = "cluster" if NODES_LABEL in (detail.get("labels") or {}) else "device"
    head = [field_line("device:", detail["deviceId"]), field_line("client:", detail["clientId"]),
            field_line("generation:", detail.get("generation") or detail.get("shape") or "-"),
            field_line("kind:", kind),
            field_line("vendor:", " ".join(str(properties.get(k)) for k in (
                "vendor", "modelNumber", "serialNumber") if properties.get(k)) or "-"),
            field_line("labels:", _labels(detail.get("labels") or {})),
            field_line("capabilities:", f"reported {ago(detail.get('reportedAt'), now)}"),
            field_line("freshness:", f"{freshness.get('state', '-')} (last seen "
                                 f"{ago(freshness.get('lastSeen'), now)})"),
            field_line("deployments:", f"{len(detail.get('deployments') or [])} "
                                   f"({counts(detail.get('states'))})")]
    return [*head, "", *capability_lines(doc, str(detail.get("shape") or "rc.3")), "",
            *deployment_lines(detail.get("deployments") or [], now), "",
            *eligibility_lines(detail.get("eligibility", [])), "",
            *membership_lines(rollouts), *([""] if rollouts is not None else []),
            *history_lines(detail.get("history") or [], now)]
