"""`margo get KIND`: a server's devices, deployments, applications, intents or rollouts,
as a table, JSON or YAML, filtered by label selectors, and with `--watch` followed as they
change.

A watch re-polls the read API every `--interval` seconds and prints what changed since the
last answer: in a table, the changed rows (a row that only aged is not a change), a gone
one marked `<deleted>`; as JSON or YAML, one event per change (`ADDED`, `MODIFIED`,
`DELETED` with the object), JSON one per line. It ends on Ctrl-C with exit 0; a poll that
fails is reported on stderr and the watch goes on (a restarting server is no reason to
stop watching it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import yaml

from margo_cli import completion
from margo_cli.fleetclient import add_server_options, call
from margo_cli.resources import KINDS, Kind, kind_named
from margo_cli.selectors import Requirement, SelectorError, matches, parse_selector
from margo_cli.tables import column_widths, row_line, table
from margo_cli.usage import UsageError

__all__ = ["Printer", "register", "run"]

OUTPUTS = ("table", "json", "yaml")


def register(commands: Any) -> None:
    names = [k.name for k in KINDS]
    parser = commands.add_parser(
        "get", help="list a server's devices, deployments, apps, intents or rollouts",
        description="List one kind of a server's objects (" + ", ".join(names) + "), "
                    "optionally only those named, as a table, JSON or YAML.")
    kind = parser.add_argument("kind", metavar="KIND",
                               choices=[n for k in KINDS for n in (k.name, *k.aliases)],
                               help=" | ".join(names))
    completion.complete_with(kind, completion.choices(names))
    only = parser.add_argument("names", nargs="*", metavar="NAME",
                               help="only these (device ids, intent names...)")
    completion.complete_with(only, completion.names_of_kind)
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                        help="table (default), json or yaml")
    parser.add_argument("-l", "--selector", metavar="SELECTOR", default="",
                        help="label selector, Kubernetes syntax: key=value, key!=value, key, "
                             "!key, key in (a,b), key notin (a,b), comma-separated")
    parser.add_argument("-w", "--watch", action="store_true",
                        help="after the list, print changes until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between polls with --watch (default 2)")
    add_server_options(parser)
    parser.set_defaults(run=run)


def fetch(args: argparse.Namespace, kind: Kind, requirements: tuple[Requirement, ...]
          ) -> dict[str, Mapping[str, Any]]:
    """The kind's objects the selector and the names keep, by key, in the server's order."""
    answer = call(args.url, kind.path, token_file=args.token_file, timeout=30)
    items = answer.get(kind.items) if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise RuntimeError(f"{kind.path}: the answer has no {kind.items!r} list")
    found = {kind.key(i): i for i in items if matches(requirements, kind.labels(i))}
    return {k: v for k, v in found.items() if not args.names or k in args.names}


class Printer:
    """Prints a first listing, then (watching) the changes between two listings."""

    def __init__(self, kind: Kind, output: str, *, watching: bool):
        self.kind, self.output, self.watching = kind, output, watching
        self.widths = list(map(len, kind.headers))
        self.shown: dict[str, tuple[str, ...]] = {}  # key -> the stable cells printed

    def _rows(self, items: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
        now = time.time()
        return {key: self.kind.row(item, now) for key, item in items.items()}

    def first(self, items: Mapping[str, Mapping[str, Any]]) -> None:
        rows = self._rows(items)
        self.shown = {k: self.kind.stable(r) for k, r in rows.items()}
        if self.watching and self.output != "table":
            for item in items.values():
                self._event("ADDED", item)
        elif self.output == "json":
            _emit(json.dumps({"items": list(items.values())}, indent=2))
        elif self.output == "yaml":
            _emit(yaml.safe_dump({"items": list(items.values())}, sort_keys=False).rstrip())
        elif rows or self.watching:
            self.widths = column_widths(list(rows.values()), self.kind.headers)
            _emit(table(list(rows.values()), self.kind.headers))
        else:
            print(f"no {self.kind.name} found", file=sys.stderr)

    def changes(self, items: Mapping[str, Mapping[str, Any]]) -> None:
        rows = self._rows(items)
        for key, row in rows.items():
            stable = self.kind.stable(row)
            if self.shown.get(key) != stable:
                event = "MODIFIED" if key in self.shown else "ADDED"
                self.shown[key] = stable
                self._changed(event, items[key], row)
        for key in [k for k in self.shown if k not in rows]:
            del self.shown[key]
            gone = [key, "<deleted>", *["-"] * (len(self.kind.headers) - 2)]
            self._changed("DELETED", {"key": key}, gone)

    def _changed(self, event: str, item: Mapping[str, Any], row: list[str]) -> None:
        if self.output == "table":
            _emit(row_line(row, self.widths))
        else:
            self._event(event, item)

    def _event(self, event: str, item: Mapping[str, Any]) -> None:
        change = {"event": event, "object": item}
        if self.output == "json":
            _emit(json.dumps(change, separators=(",", ":")))
        else:
            _emit("---\n" + yaml.safe_dump(change, sort_keys=False).rstrip())


def _emit(text: str) -> None:
    """Print and flush: a watch's reader (a pipe, `grep`) sees each change at once."""
    print(text, flush=True)


def _polls(interval: float) -> Iterator[None]:
    while True:
        time.sleep(interval)
        yield None


def _watch(args: argparse.Namespace, kind: Kind, requirements: tuple[Requirement, ...],
           printer: Printer) -> None:
    """Print changes until interrupted; a failed poll is said once per failure spell."""
    failing = False
    for _ in _polls(args.interval):
        try:
            items = fetch(args, kind, requirements)
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            if not failing:
                print(f"margo get: {exc} (still watching)", file=sys.stderr, flush=True)
            failing = True
            continue
        failing = False
        printer.changes(items)


def run(args: argparse.Namespace) -> int:
    kind = kind_named(args.kind)
    if kind is None:  # argparse's choices hold only kinds
        raise UsageError(f"margo get: unknown kind {args.kind!r}")
    try:
        requirements = parse_selector(args.selector)
    except SelectorError as exc:
        raise UsageError(f"margo get: -l: {exc}") from None
    if not (args.interval > 0 and math.isfinite(args.interval)):
        raise UsageError("margo get: --interval must be a positive number of seconds")
    try:
        _list(args, kind, requirements)
    except KeyboardInterrupt:  # how a watch ends; a plain listing cut short is not a success
        return 0 if args.watch else 130
    return 0


def _list(args: argparse.Namespace, kind: Kind, requirements: tuple[Requirement, ...]) -> None:
    try:
        items = fetch(args, kind, requirements)
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        raise UsageError(f"margo get {kind.name}: {exc}") from None
    printer = Printer(kind, args.output, watching=args.watch)
    printer.first(items)
    if args.watch:
        _watch(args, kind, requirements, printer)
