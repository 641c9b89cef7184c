"""`margo rollout status|pause|resume|abort`: a server's staged rollouts, for people at a
terminal (the read API's `/api/fleet/rollouts`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from margo_cli import completion
from margo_cli.fleetclient import add_server_options, call
from margo_cli.usage import UsageError

__all__ = ["register", "run"]

SPARK = " ▁▂▃▄▅▆▇█"


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "rollout", help="show, pause, resume or abort a server's staged rollouts",
        description="status [INTENT]: every rollout, or one in detail. pause INTENT: no "
                    "further wave opens. resume INTENT. abort INTENT: roll back every "
                    "device the rollout moved.")
    parser.add_argument("action", choices=["status", "pause", "resume", "abort"])
    intent = parser.add_argument("intent", nargs="?", metavar="INTENT")
    completion.complete_with(intent, completion.intent_names)
    add_server_options(parser)
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    parser.set_defaults(run=run)


def _request(args: argparse.Namespace, method: str, path: str) -> Any:
    return call(args.url, path, token_file=args.token_file, method=method)


def _ago(when: float | None, now: float) -> str:
    if when is None:
        return "-"
    seconds = max(0, int(now - when))
    return f"{seconds // 60}m{seconds % 60:02d}s ago" if seconds >= 60 else f"{seconds}s ago"


def spark(history: list[list[float]], total: int) -> str:
    """Installed devices over time, as one line of block characters."""
    if not history or total <= 0:
        return ""
    points = [int(p[1]) for p in history[-40:]]
    return "".join(SPARK[round(min(p, total) / total * (len(SPARK) - 1))] for p in points)


def describe(view: dict[str, Any], now: float) -> list[str]:
    """One rollout: its state, then a line per wave."""
    total = sum(w["devices"] for w in view["waves"])
    # (.get: a server from before maxUnavailable sends neither field.)
    capped = view.get("maxUnavailable")
    head = (f"{view['intent']}: {view['status']} (revision {view['revision'][:19]}, wave "
            f"{view['openWave'] + 1} of {len(view['waves'])} open, failure budget "
            f"{view['failureBudget']}"
            + (f", max unavailable {capped}, {view.get('unavailable', 0)} unavailable"
               if capped is not None else "") + ")")
    lines = [head]
    if view.get("reason"):
        lines.append(f"  reason: {view['reason']}")
    if view.get("blocked"):
        lines.append(f"  waits: {view['blocked']}")
    if view.get("superseded"):
        lines.append(f"  superseded revision {view['superseded'][:19]}")
    for index, wave in enumerate(view["waves"]):
        state = "open" if wave["openedAt"] is not None else "closed"
        lines.append(
            f"  {index + 1}. {wave['name']:<12} {state:<6} devices {wave['devices']:>4}  "
            f"moved {wave['moved']:>4}  installed {wave['installed']:>4}  failed "
            f"{wave['failed']:>3}  stale {wave['stale']:>3}  pending {wave['pending']:>3}  "
            + (f"waiting {wave.get('waiting', 0):>4}  " if capped is not None else "")
            + f"held {wave['held']:>4}  opened {_ago(wave['openedAt'], now)}")
    line = spark(view.get("history", []), total)
    if line:
        lines.append(f"  installed over time: {line}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "status":
            path = "/api/fleet/rollouts" + (f"/{args.intent}" if args.intent else "")
            found = _request(args, "GET", path)
            views = [found] if args.intent else found["rollouts"]
        else:
            if not args.intent:
                raise UsageError(f"margo rollout {args.action}: name the INTENT")
            views = [_request(args, "POST", f"/api/fleet/rollouts/{args.intent}/{args.action}")]
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        raise UsageError(f"margo rollout {args.action}: {exc}") from None
    if args.json:
        print(json.dumps(views if args.action == "status" and not args.intent else views[0],
                         indent=2))
        return 0
    now = time.time()
    out = [line for view in views for line in describe(view, now)]
    print("\n".join(out) if out else "no rollouts")
    return 0
