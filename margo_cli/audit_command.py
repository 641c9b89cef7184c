"""`margo audit`: the server's audit trail (docs/operations.md, "Audit trail"): who changed
what through the operator surface, when, from where, and how it ended.

Read from the store beside the server (`--data`, `--database`), or from a running server's
read API (`--url` with an admin's `--token-file`). `--since` takes an ISO 8601 time (UTC
unless it says) or an age (`90s`, `30m`, `1h`, `7d`, `2w`); `--actor` one actor's entries.
Printed as a table, as one JSON document (`--json`) or as JSON lines (`--jsonl`, for export).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import time
from typing import Any

import httpx

from margo_cli.datastore import data_options, opened_store
from margo_cli.fleetclient import call
from margo_cli.usage import UsageError

__all__ = ["parse_since", "register"]

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def register(commands: Any) -> None:
    audit = commands.add_parser(
        "audit", help="the server's audit trail: who changed what, when, from where",
        description="Entries oldest first. Local (--data/--database) or from a running "
                    "server (--url, with an admin's --token-file).")
    audit.add_argument("--since", metavar="WHEN",
                       help="an ISO 8601 time (UTC unless it says) or an age: 30m, 1h, 7d")
    audit.add_argument("--actor", metavar="NAME",
                       help="only this actor's entries (an operator's name, oidc:..., "
                            "admin-token, local:<user>)")
    audit.add_argument("--limit", type=int, metavar="N", help="only the newest N entries")
    shape = audit.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="one JSON document")
    shape.add_argument("--jsonl", action="store_true", help="one JSON entry per line")
    audit.add_argument("--url", metavar="URL", help="read a running server's trail instead")
    audit.add_argument("--token-file", metavar="FILE", help="an admin's token (with --url)")
    data_options(audit)
    audit.set_defaults(run=run)


def parse_since(text: str, now: float | None = None) -> float:
    """`--since` as Unix time; ValueError saying what is accepted."""
    age = _AGE.match(text.strip())
    if age:
        return (time.time() if now is None else now) - float(age[1]) * _UNIT[age[2]]
    try:
        moment = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: an ISO 8601 time (2026-12-05T10:00:00Z) or an "
                         "age (90s, 30m, 1h, 7d, 2w)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _entries(args: argparse.Namespace, since: float | None) -> list[dict[str, Any]]:
    if args.url:
        params = {k: v for k, v in (("since", None if since is None else repr(since)),
                                    ("actor", args.actor),
                                    ("limit", None if args.limit is None else str(args.limit)))
                  if v is not None}
        try:
            found: list[dict[str, Any]] = call(args.url, "/api/fleet/audit",
                                               token_file=args.token_file,
                                               params=params)["entries"]
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            raise UsageError(f"margo audit: {exc}") from None
        return found
    from wfm.fleet.audit import entries

    with opened_store(args) as db:
        return [e.to_json() for e in entries(db, since=since, actor=args.actor,
                                             limit=args.limit)]


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError("margo audit: --limit must be at least 1")
    try:
        since = None if args.since is None else parse_since(args.since)
    except ValueError as exc:
        raise UsageError(f"margo audit: {exc}") from None
    found = _entries(args, since)
    if args.json:
        print(json.dumps(found, indent=2))
    elif args.jsonl:
        for entry in found:
            print(json.dumps(entry, separators=(",", ":")))
    else:
        for e in found:
            detail = (e.get("detail") or "").replace("\n", " ")
            print("\t".join([e["at"], e["actor"], e["role"], e["action"], e["target"],
                             e["outcome"], e.get("address") or "-", detail]).rstrip())
    return 0
