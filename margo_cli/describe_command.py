"""`margo describe device ID | intent NAME`: one object of a server in full, for a person
working out why it is as it is (`margo get` lists; this explains).

A device: capabilities (resources, nodes, GPUs, roles), every deployment with its error
message whole, freshness, its eligibility for every intent with each failing clause, the
staged rollouts it is in, its branch's recent history (`margo_cli.device_view`). An
intent: what it deploys where and how, its deployments per state, its rollout, and its
verdict on every device (`/api/fleet/explain`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import httpx

from compiler.explain_fleet import fleet_lines
from margo_cli import completion
from margo_cli.device_view import device_lines, field_line
from margo_cli.fleetclient import add_server_options, call
from margo_cli.resources import target_summary
from margo_cli.rollout_command import describe as rollout_lines
from margo_cli.tables import clean_lines, counts
from margo_cli.usage import UsageError

__all__ = ["register", "run"]

KINDS = ("device", "intent")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "describe", help="one device or intent of a server in full",
        description="device ID: capabilities, deployments with their errors, freshness, "
                    "eligibility per intent, rollouts, history. intent NAME: what it "
                    "deploys where, its deployments, rollout and verdict on every device.")
    kind = parser.add_argument("kind", choices=KINDS, metavar="KIND", help="device | intent")
    completion.complete_with(kind, completion.choices(KINDS))
    name = parser.add_argument("name", metavar="NAME", help="the device id or intent name")
    completion.complete_with(name, completion.names_of_kind)
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text (default) or json (what the read API answered)")
    add_server_options(parser)
    parser.set_defaults(run=run)


def _get(args: argparse.Namespace, path: str, *, optional: bool = False) -> Any:
    """`path`'s JSON; with `optional`, None from a server too old to have it (404)."""
    try:
        return call(args.url, path, token_file=args.token_file, timeout=60)
    except RuntimeError as exc:
        if optional and ": 404 " in str(exc):
            return None
        raise


def _device(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    device_id = quote(args.name, safe="")
    detail = _get(args, f"/api/fleet/devices/{device_id}")
    members = _get(args, f"/api/fleet/rollout-members?device={device_id}", optional=True)
    rollouts = None if members is None else members.get("rollouts")
    return ({**detail, "rollouts": rollouts},
            device_lines(detail, rollouts, time.time()))


def _intent_head(intent: Mapping[str, Any]) -> list[str]:
    application = intent.get("application") or {}
    profile = intent.get("profile") or {}
    return [
        field_line("intent:", intent["name"]), field_line("file:", intent.get("file") or "-"),
        field_line("description:", intent.get("description") or "-"),
        field_line("labels:", ", ".join(f"{k}={v}" for k, v in (intent.get("labels") or {})
                                    .items()) or "-"),
        field_line("application:", f"{application.get('id')}"
               + (f" version {application['version']}" if application.get("version")
                  else " (newest version)")),
        field_line("profile:", profile.get("id") or profile.get("type") or "any that fits"),
        field_line("namespace:", intent.get("namespace") or "-"),
        field_line("targets:", target_summary(intent.get("targets"))),
        field_line("priority:", intent.get("priority", 0)),
        field_line("grace period:", f"{intent.get('gracePeriodSeconds', 0)}s"),
        field_line("parameters:", ", ".join(intent.get("parameters") or []) or "-"),
        field_line("output shape:", intent.get("outputShape") or "-")]


def _intent(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    intents = _get(args, "/api/fleet/intents")["intents"]
    intent = next((i for i in intents if i["name"] == args.name), None)
    if intent is None:
        raise RuntimeError(f"no intent {args.name!r} in the fleet source")
    rollout = (_get(args, f"/api/fleet/rollouts/{quote(args.name, safe='')}", optional=True)
               if intent.get("rolloutStatus") else None)
    lines = ([field_line("intent:", intent["name"]), field_line("file:", intent.get("file")),
              "problems:", *(f"  {line}" for p in intent.get("problems") or []
                             for line in clean_lines(p))]
             if intent.get("broken") else _intent_head(intent))
    lines += [field_line("deployments:", counts(intent.get("deployments"))), ""]
    if rollout is not None:
        lines += ["rollout:", *(f"  {line}" for line in rollout_lines(rollout, time.time())),
                  ""]
    explained = None
    if not intent.get("broken"):
        explained = _get(args, f"/api/fleet/explain?intent={quote(args.name, safe='')}")
        lines += ["devices:", *(f"  {line}" for line in fleet_lines(explained))]
    return {**intent, "rollout": rollout, "explanation": explained}, lines


DESCRIBERS: dict[str, Callable[[argparse.Namespace], tuple[dict[str, Any], list[str]]]] = {
    "device": _device, "intent": _intent}


def run(args: argparse.Namespace) -> int:
    try:
        found, lines = DESCRIBERS[args.kind](args)
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        raise UsageError(f"margo describe {args.kind} {args.name}: {exc}") from None
    print(json.dumps(found, indent=2) if args.output == "json" else "\n".join(lines))
    return 0
