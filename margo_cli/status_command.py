"""`margo status`: the fleet server's read API as tables, for people at a terminal."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from margo_cli import completion
from margo_cli.device_view import eligibility_lines, history_lines
from margo_cli.fleetclient import add_server_options, call
from margo_cli.tables import ago, cell, counts, table
from margo_cli.usage import UsageError

__all__ = ["register", "run"]


def register(commands: Any) -> None:
    parser = commands.add_parser("status", help="show devices and deployments of a server")
    add_server_options(parser)
    device = parser.add_argument("--device", metavar="ID", help="one device in detail")
    completion.complete_with(device, completion.device_ids)
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    parser.set_defaults(run=run)


def _get(args: argparse.Namespace, path: str) -> Any:
    return call(args.url, path, token_file=args.token_file, timeout=30)


def _device(args: argparse.Namespace) -> str:
    detail = _get(args, f"/api/fleet/devices/{args.device}")
    if args.json:
        return json.dumps(detail, indent=2)
    out = [f"device {detail['deviceId']} (client {detail['clientId']}, {detail['shape']} "
           f"capabilities)", ""]
    out.append(table([[d["intent"] or "?", d["applicationId"] or "?", d["state"],
                       ", ".join(f"{c['name']}={c['state']}" for c in d["components"]) or "-",
                       cell((d["error"] or {}).get("message"))] for d in detail["deployments"]],
                     ["INTENT", "APPLICATION", "STATE", "COMPONENTS", "ERROR"]))
    out += ["", *eligibility_lines(detail["eligibility"]), "",
            *history_lines(detail["history"])]
    return "\n".join(out)


def _source_lines(source: dict[str, Any] | None) -> list[str]:
    """The fleet source's condition: one line, then its problems (so a push that compiled
    with errors, or could not be read, is seen where people look first)."""
    if source is None:
        return []
    revision = f" at {source['revision']}" if source.get("revision") else ""
    lines = [f"source ({source['kind']}): {source['state']}{revision}"
             + (f" - {source['message']}" if source.get("message") else "")]
    lines += [f"  {problem}" for problem in source.get("problems", [])]
    hidden = source.get("problemCount", 0) - len(source.get("problems", []))
    if hidden > 0:
        lines.append(f"  ... and {hidden} more")
    return [*lines, ""]


def _freshness(freshness: dict[str, Any] | None) -> str:
    return "-" if not freshness else str(freshness["state"])


def _optional(args: argparse.Namespace, path: str) -> Any:
    """`path`'s JSON, or None from a server too old to have it."""
    try:
        return _get(args, path)
    except RuntimeError as exc:
        if ": 404 " in str(exc):
            return None
        raise


def _fleet(args: argparse.Namespace) -> str:
    devices = _get(args, "/api/fleet/devices")["devices"]
    by_state = _get(args, "/api/fleet/deployments")
    source = _optional(args, "/api/fleet/source")
    if args.json:
        return json.dumps({"source": source, "devices": devices, "deployments": by_state},
                          indent=2)
    now = time.time()
    rows = [[d["deviceId"], d["clientId"], _freshness(d.get("freshness")),
             ago(d.get("freshness", {}).get("lastSeen"), now), str(d["deployments"]),
             counts(d["states"])] for d in devices]
    out = [*_source_lines(source),
           table(rows, ["DEVICE", "CLIENT", "FRESHNESS", "LAST SEEN", "DEPLOYMENTS", "STATES"]),
           ""]
    failures = [f"  {d['deviceId']}: {e['intent'] or e['deploymentId']}: "
                f"{cell(e.get('message'), 100) if e.get('message') else 'failed (no message)'}"
                + (f" [{e['code']}]" if e.get("code") else "")
                for d in devices for e in d.get("errors", [])]
    if failures:
        out += ["errors:", *failures, ""]
    rows = [[name, counts(states)] for name, states in by_state["byApplication"].items()]
    out.append(table(rows, ["APPLICATION", "STATES"]))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        print(_device(args) if args.device else _fleet(args))
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        raise UsageError(f"margo status: {exc}") from None
    return 0
