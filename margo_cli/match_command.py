"""`margo match`: is a device eligible for a deployment profile, and if not, why not?

Single mode takes a capabilities document and either a bare `deviceConstraints` object or
a whole ApplicationDescription (then `--profile` picks the profile). Batch mode reads JSON
lines `{"capabilities": {...}, "deviceConstraints": {...}}` and answers one line each, in
order; identical constraint objects are compiled once, so thousands of lines are cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from margo.canonical import canonical_json
from margo.constraints import CompiledConstraints, compile_constraints, matching_view
from margo.errors import DocumentError
from margo.kinds import Kind
from margo.loading import load_path
from margo.models import ApplicationDescription, DeviceCapabilities
from margo.validation import validate_loaded, validate_value
from margo_cli.usage import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["BadInput", "BatchMatcher", "register", "run"]

EXIT_ELIGIBLE, EXIT_NOT_ELIGIBLE = EXIT_OK, EXIT_FAILED


class BadInput(Exception):
    """Input that cannot be matched at all: a batch line's error answer; in `run`, the
    shared `UsageError` (exit 2)."""


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "match", help="evaluate deviceConstraints against a device's capabilities",
        description="Exit 0 when eligible, 1 when not eligible, 2 on bad input.")
    parser.add_argument("--capabilities", metavar="CAPS", help="DeviceCapabilitiesManifest file")
    parser.add_argument("--constraints", metavar="FILE",
                        help="deviceConstraints object or ApplicationDescription (YAML/JSON)")
    parser.add_argument("--profile", metavar="ID", help="profile id (default: the first)")
    parser.add_argument("--batch", metavar="FILE.jsonl",
                        help="JSON lines of {capabilities, deviceConstraints}; '-' for stdin")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)


def _load_capabilities(path: str) -> DeviceCapabilities:
    report = validate_loaded(_load(path), expect=Kind.DEVICE_CAPABILITIES)
    if not report.valid:
        raise BadInput("\n".join(p.format() for p in report.problems))
    model: DeviceCapabilities = report.model
    return model


def _load(path: str) -> Any:
    try:
        return load_path(path)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror or exc}") from None
    except DocumentError as exc:
        raise BadInput(str(exc)) from None


def _load_constraints(path: str, profile_id: str | None) -> CompiledConstraints:
    loaded = _load(path)
    doc = loaded.value
    if isinstance(doc, dict) and "deploymentProfiles" in doc:
        report = validate_loaded(loaded, expect=Kind.APPLICATION_DESCRIPTION)
        if not report.valid:
            raise BadInput("\n".join(p.format() for p in report.problems))
        description: ApplicationDescription = report.model
        profile = (description.profile(profile_id) if profile_id
                   else description.profiles[0])
        if profile is None:
            known = ", ".join(str(p.id) for p in description.profiles)
            raise BadInput(f"{path}: no deployment profile {profile_id!r} (profiles: {known})")
        return compile_constraints(profile.device_constraints,
                                   required_resources=profile.required_resources)
    if profile_id:
        raise BadInput("--profile only applies to an ApplicationDescription")
    if isinstance(doc, dict) and set(doc) == {"deviceConstraints"}:
        doc = doc["deviceConstraints"]
    if not isinstance(doc, dict):
        raise BadInput(f"{path}: expected a deviceConstraints object")
    try:
        return compile_constraints(doc)
    except DocumentError as exc:
        raise BadInput("\n".join(loaded.locate(p).format() for p in exc.problems)) from None


def _print_result(result: Any, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(result.to_json(), ensure_ascii=False), file=out)
        return
    if result.eligible:
        print("eligible", file=out)
        return
    print("not eligible:", file=out)
    for failure in result.failures:
        print(f"  - [{failure.stage}] {failure.message}", file=out)


def _run_single(args: argparse.Namespace) -> int:
    if not args.capabilities or not args.constraints:
        raise BadInput("give --capabilities and --constraints, or --batch")
    caps = _load_capabilities(args.capabilities)
    constraints = _load_constraints(args.constraints, args.profile)
    result = constraints.evaluate(matching_view(caps.properties, caps.extensions), caps.labels)
    _print_result(result, args.json, sys.stdout)
    return EXIT_ELIGIBLE if result.eligible else EXIT_NOT_ELIGIBLE


class BatchMatcher:
    """Answers batch lines; caches compiled constraints by their canonical bytes."""

    def __init__(self) -> None:
        self._compiled: dict[bytes, CompiledConstraints | str] = {}

    def _constraints(self, raw: Any) -> CompiledConstraints:
        if not isinstance(raw, dict):
            raise BadInput("deviceConstraints must be an object")
        key = canonical_json(raw)
        cached = self._compiled.get(key)
        if cached is None:
            try:
                cached = compile_constraints(raw, path=("deviceConstraints",))
            except DocumentError as exc:
                cached = "; ".join(f"{p.json_path}: {p.message}" for p in exc.problems)
            self._compiled[key] = cached
        if isinstance(cached, str):
            raise BadInput(cached)
        return cached

    def answer(self, line: str) -> dict[str, Any]:
        try:
            item = json.loads(line)
            if not isinstance(item, Mapping) or "capabilities" not in item:
                raise BadInput("expected an object with capabilities and deviceConstraints")
            constraints = self._constraints(item.get("deviceConstraints") or {})
            caps: DeviceCapabilities = validate_value(item["capabilities"],
                                                      expect=Kind.DEVICE_CAPABILITIES)
            view = matching_view(caps.properties, caps.extensions)
            return constraints.evaluate(view, caps.labels).to_json()
        except json.JSONDecodeError as exc:
            return {"error": f"invalid JSON: {exc.msg} at column {exc.colno}"}
        except DocumentError as exc:
            return {"error": "; ".join(f"capabilities {p.json_path}: {p.message}"
                                       for p in exc.problems)}
        except (BadInput, RecursionError) as exc:
            return {"error": str(exc) or "input nested too deeply"}


def _run_batch(path: str) -> int:
    matcher = BatchMatcher()
    try:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror or exc}") from None
    write = sys.stdout.write
    with stream:
        try:
            for line in stream:
                if line.strip():
                    write(json.dumps(matcher.answer(line), ensure_ascii=False) + "\n")
        except UnicodeDecodeError as exc:
            raise BadInput(f"{path}: not valid UTF-8: {exc.reason}") from None
    return EXIT_ELIGIBLE


def run(args: argparse.Namespace) -> int:
    try:
        if args.batch:
            return _run_batch(args.batch)
        return _run_single(args)
    except BadInput as exc:
        raise UsageError(f"margo match: {exc}") from None
