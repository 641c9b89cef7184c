"""The kinds `margo get` lists: where the read API has them, what identifies one, its
labels, and its table row.

Each kind's columns are fixed (scripts may cut them); a column whose cell changes only
because time passes (AGE) is `volatile`, so `--watch` does not reprint a row for it. Free
text (errors, reasons, problems) goes through `tables.cell`: one line per row, whatever a
device reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from margo_cli.tables import age, cell, counts

__all__ = ["KINDS", "Kind", "kind_named", "target_summary"]

#: The label a cluster device's capabilities carry (margo.cluster's vocabulary).
NODES_LABEL = "k8s.margo-gitops.dev/nodes"

Row = Callable[[Mapping[str, Any], float], list[str]]


@dataclass(frozen=True)
class Kind:
    """`path`: the read API's list; `items`: the key holding the list in its answer."""

    name: str
    aliases: tuple[str, ...]
    path: str
    items: str
    key: Callable[[Mapping[str, Any]], str]
    headers: tuple[str, ...]
    row: Row
    volatile: frozenset[str] = frozenset({"AGE"})

    def labels(self, item: Mapping[str, Any]) -> Mapping[str, Any]:
        labels = item.get("labels")
        return labels if isinstance(labels, Mapping) else {}

    def stable(self, row: list[str]) -> tuple[str, ...]:
        """The row without its volatile cells: what `--watch` compares."""
        return tuple(c for h, c in zip(self.headers, row, strict=True)
                     if h not in self.volatile)


def _first_error(errors: list[Mapping[str, Any]] | None) -> str:
    """A device's first failed deployment and its message, and how many more failed."""
    if not errors:
        return "-"
    first = errors[0]
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    message = first.get("message") or "failed (no message)"
    return cell(f"{first.get('intent') or first.get('deploymentId')}: {message}") + more


def _device_row(d: Mapping[str, Any], now: float) -> list[str]:
    kind = "cluster" if NODES_LABEL in (d.get("labels") or {}) else "device"
    return [d["deviceId"], d["clientId"], str(d.get("generation") or d.get("shape") or "-"),
            kind, str(d["deployments"]), counts(d.get("states")),
            str((d.get("freshness") or {}).get("state", "-")), age(d.get("reportedAt"), now),
            _first_error(d.get("errors"))]


def _error_text(error: Mapping[str, Any] | None) -> str:
    if not error:
        return "-"
    code = f" [{error['code']}]" if error.get("code") else ""
    return cell(error.get("message") or "(no message)") + code


def _deployment_row(d: Mapping[str, Any], now: float) -> list[str]:
    applied = d.get("applied")
    current = "-" if not applied else ("current" if applied.get("current") else "previous")
    components = ", ".join(f"{c.get('name')}={c.get('state')}" for c in d.get("components")
                           or []) or "-"
    return [d["deviceId"], d.get("intent") or "?", d.get("applicationId") or "?", d["state"],
            cell(components, 40), current, age(d.get("reportedAt"), now),
            _error_text(d.get("error"))]


def _problems(item: Mapping[str, Any]) -> str:
    problems = item.get("problems") or []
    if not problems:
        return "broken" if item.get("broken") else "-"
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return cell(problems[0]) + more


def _total(by_state: Mapping[str, Any] | None) -> str:
    return str(sum(int(n) for n in (by_state or {}).values()))


def _app_row(a: Mapping[str, Any], now: float) -> list[str]:
    versions = a.get("versions") or []
    profiles = sorted({p["type"] for v in versions for p in v.get("profiles", [])})
    return [a["id"], cell(a.get("name"), 30),
            cell(", ".join(v["version"] for v in versions) or "-", 30),
            ", ".join(profiles) or "-", str(len(a.get("intents") or [])),
            _total(a.get("deployments")), counts(a.get("deployments")), _problems(a)]


def _selector_text(selector: Mapping[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    parts += [f"{e.get('key')} {e.get('operator')}"
              + (f" ({','.join(str(v) for v in e['values'])})" if e.get("values") else "")
              for e in selector.get("matchExpressions") or []]
    return ", ".join(parts) or "any"


def target_summary(targets: Mapping[str, Any] | None) -> str:
    """An intent's `targets` in one short line: `all devices`, the devices it names, its
    selectors."""
    if not targets:
        return "all devices"
    parts = []
    devices = targets.get("devices") or []
    if devices:
        parts.append(", ".join(devices) if len(devices) <= 2 else f"{len(devices)} devices")
    for rule in targets.get("selectors") or []:
        parts += [f"{kind.removesuffix('Selector')}: {_selector_text(selector)}"
                  for kind, selector in rule.items() if isinstance(selector, Mapping)]
    return "; ".join(parts) or "all devices"


def _intent_row(i: Mapping[str, Any], now: float) -> list[str]:
    if i.get("broken"):
        return [i["name"], "-", "-", "-", _total(i.get("deployments")),
                counts(i.get("deployments")), i.get("rolloutStatus") or "-", _problems(i)]
    application = i["application"]
    profile = i.get("profile") or {}
    return [i["name"], application["id"] + (f"@{application['version']}"
                                            if application.get("version") else ""),
            profile.get("type") or profile.get("id") or "any",
            cell(target_summary(i.get("targets")), 40), _total(i.get("deployments")),
            counts(i.get("deployments")), i.get("rolloutStatus") or "-", _problems(i)]


def _rollout_row(r: Mapping[str, Any], now: float) -> list[str]:
    waves = r.get("waves") or []
    total = {k: sum(int(w.get(k, 0)) for w in waves)
             for k in ("devices", "installed", "failed", "pending")}
    return [r["intent"], r["status"], f"{int(r.get('openWave', 0)) + 1}/{len(waves)}",
            str(total["devices"]), str(total["installed"]), str(total["failed"]),
            str(total["pending"]), age(r.get("startedAt"), now), cell(r.get("reason"))]


KINDS = (
    Kind("devices", ("device", "dev"), "/api/fleet/devices", "devices",
         lambda d: str(d["deviceId"]),
         ("ID", "CLIENT", "GENERATION", "KIND", "DEPLOYMENTS", "STATES", "FRESHNESS", "AGE",
          "ERROR"), _device_row),
    Kind("deployments", ("deployment", "deploy"), "/api/fleet/deployment-list", "deployments",
         lambda d: str(d["deploymentId"]),
         ("DEVICE", "INTENT", "APPLICATION", "STATE", "COMPONENTS", "APPLIED", "AGE", "ERROR"),
         _deployment_row),
    Kind("apps", ("app", "applications", "application"), "/api/fleet/applications",
         "applications", lambda a: str(a["id"]),
         ("ID", "NAME", "VERSIONS", "PROFILES", "INTENTS", "DEPLOYMENTS", "STATES", "PROBLEMS"),
         _app_row),
    Kind("intents", ("intent",), "/api/fleet/intents", "intents", lambda i: str(i["name"]),
         ("NAME", "APPLICATION", "PROFILE", "TARGETS", "DEPLOYMENTS", "STATES", "ROLLOUT",
          "PROBLEMS"), _intent_row),
    Kind("rollouts", ("rollout",), "/api/fleet/rollouts", "rollouts",
         lambda r: str(r["intent"]),
         ("INTENT", "STATUS", "WAVE", "DEVICES", "INSTALLED", "FAILED", "PENDING", "AGE",
          "REASON"), _rollout_row),
)


def kind_named(name: str) -> Kind | None:
    """The kind called `name` or one of its aliases (`device`, `app`...)."""
    return next((k for k in KINDS if name == k.name or name in k.aliases), None)
