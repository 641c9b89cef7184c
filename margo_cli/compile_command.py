"""`margo compile`, `margo plan`, `margo explain`: the fleet compiler's commands.

All three take the same inputs: `--source` (a fleet directory, or a Git repository with
`--ref`), `--capabilities` (a directory of capability documents or one keyed file) and
`--repos` (where `fleet-state.git` and the compiler's state live).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from compiler.compilation import CompileReport, DeviceResult, compile_fleet
from compiler.explain import STATUSES, IntentExplanation, explain_device, explanation_lines
from compiler.explain_fleet import explain_fleet, fleet_lines, select_statuses
from compiler.gcpause import release_frozen
from compiler.gitstore import DeviceCommit, DeviceStore, GitStoreError
from compiler.plandiff import commit_diff
from compiler.secrets import FleetKey, SecretError
from compiler.snapshot import SnapshotError, load_snapshot
from compiler.source import SourceError, load_source
from compiler.state import CompilerState
from margo_cli import completion, progress
from margo_cli.fleetclient import call
from margo_cli.usage import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["STATE_FILE", "register", "run_compile", "run_explain", "run_plan"]

STATE_FILE = "compiler-state.sqlite"


def _inputs(parser: argparse.ArgumentParser, *, repos_required: bool = True,
            inputs_required: bool = True) -> None:
    parser.add_argument("--source", required=inputs_required, metavar="SRC",
                        help="fleet source directory, or Git repository (see --ref)")
    parser.add_argument("--ref", help="Git ref to read the source from (default: the "
                                      "directory as it is; HEAD for bare repositories)")
    parser.add_argument("--capabilities", required=inputs_required, metavar="CAPS",
                        help="directory of capability documents, or one file keyed by id")
    parser.add_argument("--repos", required=repos_required, metavar="DIR",
                        help="where fleet-state.git and the compiler state live")
    parser.add_argument("--fleet-key", metavar="FILE",
                        help="the fleet key (age identity file, mode 600) that opens the "
                             "intents' secrets (docs/secrets.md)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def register(commands: Any) -> None:
    compile_parser = commands.add_parser(
        "compile", help="compile the fleet into per-device desired state in Git",
        description="Exit 0, or 1 when any device or source file had errors (the other "
                    "devices are still committed), 2 on unusable input.")
    _inputs(compile_parser)
    compile_parser.add_argument("--watch", action="store_true",
                                help="recompile whenever SRC or CAPS change")
    compile_parser.set_defaults(run=run_compile)
    plan_parser = commands.add_parser(
        "plan", help="show what a compile would change per device, writing nothing")
    _inputs(plan_parser)
    plan_parser.add_argument("--diff", action="store_true",
                             help="also print the unified diff of every file that would "
                                  "change (in --json: a 'diff' list per device)")
    plan_parser.set_defaults(run=run_plan)
    explain_parser = commands.add_parser(
        "explain", help="why each intent does or does not deploy on a device, or one "
                        "intent's or application's verdict on every device",
        description="With --device: every intent (or --intent NAME) on that device. Without "
                    "it: --intent NAME or --app ID on every device, listing every verdict but "
                    "'not targeted' (counted, not listed, unless --all). Inputs: --source and "
                    "--capabilities, or --url of a running server (its reports).")
    _inputs(explain_parser, repos_required=False, inputs_required=False)
    completion.complete_with(explain_parser.add_argument(
        "--device", metavar="ID", help="one device: why each intent does or does not deploy "
                                       "on it"), completion.device_ids)
    completion.complete_with(explain_parser.add_argument(
        "--intent", metavar="NAME", help="one intent (fleet-wide without --device)"),
        completion.intent_names)
    explain_parser.add_argument("--app", metavar="ID", help="an application id (fleet-wide)")
    explain_parser.add_argument("--url", help="a running server to ask (GET /api/fleet/...)")
    explain_parser.add_argument("--token-file", metavar="FILE",
                                help="the server's operator token, if it requires one")
    shown = explain_parser.add_mutually_exclusive_group()
    shown.add_argument("--status", metavar="LIST",
                       help="list only these verdicts, comma-separated: "
                            + ", ".join(s.replace(" ", "-") for s in STATUSES))
    shown.add_argument("--all", action="store_true",
                       help="fleet-wide, also list the devices the intent does not target")
    explain_parser.set_defaults(run=run_explain)


def _open(args: argparse.Namespace, *, trusted: dict[str, str] | None = None) -> tuple[Any, Any]:
    """The fleet source and the capability snapshot; unusable ones are a `UsageError`."""
    try:
        return (load_source(args.source, ref=args.ref),
                load_snapshot(args.capabilities, trusted=trusted))
    except (SourceError, SnapshotError) as exc:
        raise UsageError(f"margo {args.command}: {exc}") from None


def _fleet_key(args: argparse.Namespace) -> FleetKey | None:
    """The fleet key named by `--fleet-key`; an unusable one is a `UsageError`."""
    path = getattr(args, "fleet_key", None)
    if path is None:
        return None
    try:
        return FleetKey.load(Path(path))
    except (OSError, SecretError) as exc:
        raise UsageError(f"margo {args.command}: --fleet-key: {exc}") from None


def _store(args: argparse.Namespace) -> tuple[DeviceStore, CompilerState]:
    repos = Path(args.repos)
    repos.mkdir(parents=True, exist_ok=True)
    return DeviceStore(repos), CompilerState(repos / STATE_FILE)


def _progress(items: Iterable[Any], total: int) -> Iterable[Any]:
    """A progress bar on a terminal for long compiles; nothing otherwise."""
    return progress.iterate(items, total, "compiling", unit="device")


def _print_errors(report: CompileReport) -> None:
    for device, problem in report.errors:
        prefix = f"[{device}] " if device else ""
        print(f"error: {prefix}{problem.format()}", file=sys.stderr)


def _summary(report: CompileReport, elapsed: float) -> str:
    return (f"{report.devices} devices, {report.deployments} deployments, {report.commits} "
            f"commits, {report.unchanged} unchanged, {len(report.errors)} errors "
            f"({elapsed:.2f}s, source {report.revision})")


def _compile_once(args: argparse.Namespace, *, dry_run: bool,
                  diffs: dict[str, list[str]] | None = None) -> tuple[CompileReport, float]:
    """One compile; with `diffs` (a dry run), each device's diff of what it would commit.
    A store that cannot be used is a `UsageError`, as unusable inputs are."""
    start = time.monotonic()
    try:
        return _compile_in(args, dry_run=dry_run, diffs=diffs, start=start)
    except GitStoreError as exc:
        raise UsageError(f"margo {args.command}: {exc}") from None


def _compile_in(args: argparse.Namespace, *, dry_run: bool, diffs: dict[str, list[str]] | None,
                start: float) -> tuple[CompileReport, float]:
    store, state = _store(args)

    def collect(commit: DeviceCommit) -> None:
        if diffs is not None:
            diffs[commit.device_id] = commit_diff(store, commit)

    try:
        state.bind(store.identity)
        source, snapshot = _open(args, trusted=state.trusted_digests())
        report = compile_fleet(source, snapshot, store, state, dry_run=dry_run,
                               progress=_progress, fleet_key=_fleet_key(args),
                               on_dry_commit=collect if diffs is not None else None)
    finally:
        state.close()
    return report, time.monotonic() - start


def run_compile(args: argparse.Namespace) -> int:
    report, elapsed = _compile_once(args, dry_run=False)
    _print_compile(args, report, elapsed)
    if args.watch:
        return _watch(args)
    return EXIT_FAILED if report.errors else EXIT_OK


def _print_compile(args: argparse.Namespace, report: CompileReport, elapsed: float) -> None:
    if args.json:
        print(json.dumps(report.to_json(), ensure_ascii=False), flush=True)
        return
    _print_errors(report)
    for result in report.results:
        if result.status == "committed":
            actions = ", ".join(f"{c.action} {c.intent}" for c in result.changes) or "created"
            print(f"{result.device_id}: {actions}")
        for note in result.notes:
            print(f"{result.device_id}: {note}")
    print(_summary(report, elapsed), flush=True)


def _watch(args: argparse.Namespace) -> int:
    from watchfiles import watch

    print(f"watching {args.source} and {args.capabilities} (Ctrl-C to stop)", flush=True)
    try:
        for _changes in watch(args.source, args.capabilities, debounce=200, step=20):
            _recompile(args)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _recompile(args: argparse.Namespace) -> None:
    """One compile of the watch loop, its failure reported, not raised. What the compile
    froze goes back to the collector afterwards, as the fleet server does (see
    `compiler.gcpause`): a process compiling again and again otherwise keeps the few
    cycles of every compile (pygit2's Repository and its collections), and what they hold
    (libgit2's caches: ~15 MB a compile at 10,000 devices)."""
    try:
        report, elapsed = _compile_once(args, dry_run=False)
        _print_compile(args, report, elapsed)
    except UsageError as exc:
        print(exc, file=sys.stderr, flush=True)
    finally:
        release_frozen()


def _still_waiting(args: argparse.Namespace, report: CompileReport) -> dict[str, list[str]]:
    """Per device this plan did not compile (nothing there changed), notes on the intents
    that wait for capacity or whose change is held for it: the state remembers them;
    `margo explain` gives their numbers."""
    compiled = {r.device_id for r in report.results}
    state = CompilerState(Path(args.repos) / STATE_FILE)
    try:
        waiting, held = state.waiting(), state.waiting(held=True)
    finally:
        state.close()
    out: dict[str, list[str]] = {}
    for found, verb in ((waiting, "wait{s} for capacity"), (held, "{is} held for capacity")):
        for device_id, names in found.items():
            if device_id not in compiled:
                what = verb.format(s="s" if len(names) == 1 else "",
                                   **{"is": "is" if len(names) == 1 else "are"})
                out.setdefault(device_id, []).append(
                    f"{', '.join(names)}: {what} (margo explain --device {device_id} says why)")
    return dict(sorted(out.items()))


def run_plan(args: argparse.Namespace) -> int:
    diffs: dict[str, list[str]] | None = {} if args.diff else None
    report, _ = _compile_once(args, dry_run=True, diffs=diffs)
    for device_id, notes in _still_waiting(args, report).items():
        report.results.append(DeviceResult(device_id, "unchanged", notes=notes))
    changed = [r for r in report.results if r.changes or r.status == "committed" or r.notes]
    if args.json:
        print(json.dumps({
            "devices": [{"device": r.device_id,
                         "changes": [{"file": c.file, "intent": c.intent, "action": c.action,
                                      "reasons": list(c.reasons)} for c in r.changes],
                         "notes": list(r.notes),
                         **({"diff": diffs.get(r.device_id, [])} if diffs is not None
                            else {})}
                        for r in changed],
            **{k: v for k, v in report.to_json().items() if k == "errors"},
        }, ensure_ascii=False))
    else:
        _print_errors(report)
        for result in changed:
            print(f"{result.device_id}:")
            for change in result.changes:
                reasons = f" ({'; '.join(change.reasons)})" if change.reasons else ""
                print(f"  {change.action:<11} {change.file}{reasons}")
            if not result.changes and result.status == "committed":
                print("  create     (empty desired state)")
            for note in result.notes:  # intents that wait for capacity, grace periods
                print(f"  {'note':<11} {note}")
            for line in (diffs or {}).get(result.device_id, []):
                print(f"    {line}")
        if not changed:
            print("no changes")
    return EXIT_FAILED if report.errors else EXIT_OK


def run_explain(args: argparse.Namespace) -> int:
    if args.device is None and not (args.intent or args.app):
        raise UsageError("margo explain: name a --device, or an --intent or --app to explain "
                         "on every device")
    if args.url is None and not (args.source and args.capabilities):
        raise UsageError("margo explain: give --source and --capabilities, or --url of a "
                         "server")
    if args.device is None:
        return _explain_fleet(args)
    statuses = _statuses(args, fleet_wide=False)
    if args.url is not None:
        intents = _server_device_explanation(args)
    else:
        intents = [e.to_json() for e in _local_device_explanation(args)]
    if statuses is not None:
        intents = [e for e in intents if e["status"] in statuses]
    if args.json:
        print(json.dumps({"device": args.device, "intents": intents}, ensure_ascii=False))
    else:
        print(f"device {args.device}:")
        for explanation in intents:
            for line in explanation_lines(explanation):
                print(f"  {line}")
    return EXIT_OK


def _statuses(args: argparse.Namespace, *, fleet_wide: bool) -> frozenset[str] | None:
    """The verdicts to list (None: every one): `--status`, or fleet-wide without `--all`
    every verdict but "not targeted" (a fleet's other devices would swamp the answer)."""
    if args.status:
        wanted = {s.strip().replace("-", " ").replace("_", " ").lower()
                  for s in args.status.split(",") if s.strip()}
        unknown = sorted(wanted - set(STATUSES))
        if unknown or not wanted:
            raise UsageError(f"margo explain: --status: unknown verdict {', '.join(unknown)!r}; "
                             "the verdicts are " + ", ".join(
                                 s.replace(" ", "-") for s in STATUSES))
        return frozenset(wanted)
    if fleet_wide and not args.all:
        return frozenset(STATUSES) - {"not targeted"}
    return None


def _server_device_explanation(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every intent's explanation on the device as a running server gives it (the
    `eligibility` of `GET /api/fleet/devices/{id}`), or only `--intent`'s."""
    try:
        detail = call(args.url, f"/api/fleet/devices/{quote(args.device, safe='')}",
                      token_file=args.token_file, timeout=300)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        raise UsageError(f"margo explain: {exc}") from None
    eligibility = detail.get("eligibility")
    if isinstance(eligibility, str):
        raise UsageError(f"margo explain: the server cannot explain device {args.device!r}: "
                         f"{eligibility}")
    intents: list[dict[str, Any]] = eligibility or []
    if args.intent is not None:
        intents = [e for e in intents if e["intent"] == args.intent]
        if not intents:
            raise UsageError(f"margo explain: no intent {args.intent!r} in the server's "
                             "fleet source")
    return intents


def _local_device_explanation(args: argparse.Namespace) -> list[IntentExplanation]:
    """Every intent's explanation on the device from --source and --capabilities."""
    source, snapshot = _open(args)
    placements = None
    if args.repos and (Path(args.repos) / STATE_FILE).exists():
        state = CompilerState(Path(args.repos) / STATE_FILE)
        placements = state.placements_for(args.device)
        state.close()
    try:
        explanations = explain_device(source, snapshot, args.device, intent_name=args.intent,
                                      placements=placements,
                                      placed=_placed_files(_branches(args), args.device),
                                      now=time.time(), fleet_key=_fleet_key(args))
    except KeyError as exc:
        what = "device" if exc.args[0] == args.device else "intent"
        raise UsageError(f"margo explain: no {what} {exc.args[0]!r} in the inputs") from None
    return explanations


def _branches(args: argparse.Namespace) -> DeviceStore | None:
    """The device branches of `--repos`, if it has any (never created here)."""
    try:
        return DeviceStore(args.repos, create=False) if args.repos else None
    except GitStoreError:
        return None


def _placed_files(store: DeviceStore | None, device_id: str) -> dict[str, bytes] | None:
    """Intent -> the file the device's branch holds (None without a branch): explain then
    decides held upgrades as the compiler does."""
    files = None if store is None else store.read_files(device_id)
    return None if files is None else {
        name.removesuffix(".yaml"): data for name, data in files.items()
        if name.endswith(".yaml")}


def _explain_fleet(args: argparse.Namespace) -> int:
    """One intent's or application's verdict on every device, from the inputs or a server."""
    statuses = _statuses(args, fleet_wide=True)
    if args.url is not None:
        try:
            result = _server_explanation(args)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            raise UsageError(f"margo explain: {exc}") from None
    else:
        source, snapshot = _open(args)
        store = _branches(args)
        try:
            result = explain_fleet(
                source, snapshot, intent=args.intent, application=args.app, now=time.time(),
                placed_of=lambda device: _placed_files(store, device),
                fleet_key=_fleet_key(args))
        except KeyError as exc:
            raise UsageError(f"margo explain: no intent {exc.args[0]!r} in the source") from None
    if statuses is not None:
        result = select_statuses(result, statuses)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return EXIT_OK
    print("\n".join(fleet_lines(result)))
    if result.get("hidden"):
        what = ("not targeted not listed; --all lists them" if not args.status
                else "with other verdicts not listed")
        print(f"  ({result['hidden']} {what})")
    return EXIT_OK


def _server_explanation(args: argparse.Namespace) -> dict[str, Any]:
    params = {k: v for k, v in (("intent", args.intent), ("app", args.app)) if v}
    result: dict[str, Any] = call(args.url, "/api/fleet/explain", token_file=args.token_file,
                                  params=params, timeout=300)
    return result
