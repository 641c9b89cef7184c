"""`margo explain --intent NAME` / `--app ID`: one intent's (or application's) verdict on
every device of the fleet, with each device's failing clauses, and counts per verdict.

The per-device reasoning is `compiler.explain.explain_device`, unchanged; this module only
runs it over the fleet and shapes the result (the same JSON from a snapshot on disk and from
a running server's `GET /api/fleet/explain`, so the command prints both the same way).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

from compiler.explain import explain_device, reasons
from compiler.secrets import FleetKey
from compiler.snapshot import Snapshot
from compiler.source import FleetSource

__all__ = ["explain_fleet", "fleet_lines", "select_statuses"]


def explain_fleet(source: FleetSource, snapshot: Snapshot, *, intent: str | None = None,
                  application: str | None = None,
                  placed_of: Callable[[str], Collection[str] | Mapping[str, bytes] | None] = (
                      lambda device: None),
                  now: float | None = None,
                  fleet_key: FleetKey | None = None) -> dict[str, Any]:
    """Every device's explanation of the intents matching `intent` or `application`
    (KeyError(intent) for an intent the source does not define). `placed_of(device)`: the
    intents that device's tree holds, or them and their files (capacity accounting counts
    them first; with the files, an upgrade that does not fit is explained as held)."""
    devices: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    names = None if application is None else {
        name for name, found in source.intents.items() if found.application_id == application}
    for device_id in sorted(snapshot.devices):
        explanations = [e for e in explain_device(source, snapshot, device_id,
                                                  intent_name=intent,
                                                  placed=placed_of(device_id), now=now,
                                                  fleet_key=fleet_key)
                        if names is None or e.intent in names]
        if not explanations:
            continue
        counts.update(e.status for e in explanations)
        devices.append({"device": device_id, "intents": [e.to_json() for e in explanations]})
    return {"intent": intent, "application": application,
            "counts": dict(sorted(counts.items())), "devices": devices}


def fleet_lines(result: dict[str, Any]) -> list[str]:
    """People's form of `explain_fleet`'s JSON: counts, then one line per device and intent
    with its failing clauses indented under it."""
    what = (f"intent {result['intent']}" if result.get("intent")
            else f"application {result['application']}")
    counts = ", ".join(f"{n} {status}" for status, n in result["counts"].items())
    out = [f"{what}: {counts or 'no device'}"]
    for entry in result["devices"]:
        for explanation in entry["intents"]:
            profile = f", profile {explanation['profile']}" if explanation.get("profile") else ""
            name = "" if result.get("intent") else f" {explanation['intent']}"
            out.append(f"  {entry['device']}:{name} {explanation['status']}{profile}")
            out += [f"    - {line}" for line in reasons(explanation, assigned=False)]
    return out


def select_statuses(result: dict[str, Any], statuses: Collection[str]) -> dict[str, Any]:
    """`explain_fleet`'s result listing only the explanations whose status is one of
    `statuses`; `counts` stay those of the whole fleet, and `hidden` says how many
    explanations were left out."""
    devices: list[dict[str, Any]] = []
    hidden = 0
    for entry in result["devices"]:
        kept = [e for e in entry["intents"] if e["status"] in statuses]
        hidden += len(entry["intents"]) - len(kept)
        if kept:
            devices.append({**entry, "intents": kept})
    return {**result, "devices": devices, "hidden": hidden}
