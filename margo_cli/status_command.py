"""`margo status`: the fleet server's read API as tables, for people at a terminal."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from margo_cli.fleetclient import call
from margo_cli.usage import UsageError

__all__ = ["register", "run"]


def register(commands: Any) -> None:
    parser = commands.add_parser("status", help="show devices and deployments of a server")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    parser.add_argument("--token-file", metavar="FILE", help="operator token, if required")
    parser.add_argument("--device", metavar="ID", help="one device in detail")
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    parser.set_defaults(run=run)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _get(args: argparse.Namespace, path: str) -> Any:
    return call(args.url, path, token_file=args.token_file, timeout=30)


def _device(args: argparse.Namespace) -> str:
    detail = _get(args, f"/api/fleet/devices/{args.device}")
    if args.json:
        return json.dumps(detail, indent=2)
    out = [f"device {detail['deviceId']} (client {detail['clientId']}, {detail['shape']} "
           f"capabilities)", ""]
    out.append(_table([[d["intent"] or "?", d["applicationId"] or "?", d["state"],
                        ", ".join(f"{c['name']}={c['state']}" for c in d["components"]) or "-",
                        (d["error"] or {}).get("message", "")] for d in detail["deployments"]],
                      ["INTENT", "APPLICATION", "STATE", "COMPONENTS", "ERROR"]))
    eligibility = detail["eligibility"]
    out += ["", "eligibility:"]
    if isinstance(eligibility, str):
        out.append(f"  {eligibility}")
    else:
        for entry in eligibility:
            out.append(f"  {entry['intent']}: {entry['status']}")
            for failure in entry["targeting"]:
                out.append(f"    - {failure['message']}")
            for attempt in entry["attempts"]:
                out += [f"    - profile {attempt['profile']}: {f['message']}"
                        for f in attempt["failures"]]
    out += ["", "history:"] + [f"  {c['commit'][:10]} {c['message'].splitlines()[0]}"
                               for c in detail["history"]]
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


def _ago(when: float | None, now: float) -> str:
    """`12s ago`, `5m ago`, `3h ago`, `2d ago` (a server older than freshness: `-`)."""
    if when is None:
        return "-"
    seconds = max(0, int(now - when))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


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
    counts = _get(args, "/api/fleet/deployments")
    source = _optional(args, "/api/fleet/source")
    if args.json:
        return json.dumps({"source": source, "devices": devices, "deployments": counts},
                          indent=2)
    now = time.time()
    rows = [[d["deviceId"], d["clientId"], _freshness(d.get("freshness")),
             _ago(d.get("freshness", {}).get("lastSeen"), now), str(d["deployments"]),
             ", ".join(f"{k}={v}" for k, v in d["states"].items()) or "-"] for d in devices]
    out = [*_source_lines(source),
           _table(rows, ["DEVICE", "CLIENT", "FRESHNESS", "LAST SEEN", "DEPLOYMENTS", "STATES"]),
           ""]
    failures = [f"  {d['deviceId']}: {e['intent'] or e['deploymentId']}: "
                f"{e.get('message') or 'failed (no message)'}"
                + (f" [{e['code']}]" if e.get("code") else "")
                for d in devices for e in d.get("errors", [])]
    if failures:
        out += ["errors:", *failures, ""]
    rows = [[name, ", ".join(f"{k}={v}" for k, v in states.items())]
            for name, states in counts["byApplication"].items()]
    out.append(_table(rows, ["APPLICATION", "STATES"]))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        print(_device(args) if args.device else _fleet(args))
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        raise UsageError(f"margo status: {exc}") from None
    return 0
