"""`margo device plan --config FILE [--json]`: what the next cycle would do with the desired
state this device has adopted, and which telemetry variables each container gets
(`reconciler.preview`). Nothing is fetched, applied or written; exit 0, or 2 when the
configuration, the state file or the engine cannot be used."""

from __future__ import annotations

import argparse
import json
from typing import Any

from margo_cli.device_config import device_config
from margo_cli.usage import EXIT_OK, UsageError

__all__ = ["format_preview", "register", "run"]


def register(verbs: Any) -> None:
    """Add `plan` to the `margo device` verbs."""
    sub = verbs.add_parser("plan", help="show what the next cycle would do with the adopted "
                           "state, and the telemetry each container gets (changes nothing)")
    sub.add_argument("--config", required=True, metavar="FILE")
    sub.add_argument("--json", action="store_true", help="print the plan as JSON")
    sub.set_defaults(run=run)


def format_preview(preview: Any) -> str:
    """The plan for people: one line per component, its containers below it."""
    if preview.version is None and not preview.components:
        return "nothing adopted yet: the device has not fetched its desired state"
    lines = [f"adopted desired state: {preview.version}"]
    if preview.variables:
        lines.append("telemetry injected where the workload does not set it: " + ", ".join(
            f"{k}={v}" for k, v in preview.variables.items()))
    else:
        lines.append("telemetry: none configured (nothing is injected)")
    for item in preview.components:
        step = item.step
        lines.append(f"  {step.action:<11} {step.deployment_id[:8]} {step.component}: "
                     f"{step.reason}")
        for where, added, kept in item.injection:
            parts = ([f"+ {', '.join(added)}"] if added else []) + (
                [f"its own {', '.join(kept)}"] if kept else [])
            lines.append(f"      {where}: {'; '.join(parts) or 'nothing to inject'}")
        if item.problem:
            lines.append(f"      (telemetry not shown: {item.problem})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from reconciler.errors import ApplyError
    from reconciler.preview import preview
    from reconciler.state import StateError

    config = device_config(args.config)
    try:
        found = preview(config)
    except (StateError, ApplyError) as exc:
        raise UsageError(f"{args.config}: {exc}") from None
    print(json.dumps(found.to_json(), indent=2) if args.json else format_preview(found))
    return EXIT_OK
