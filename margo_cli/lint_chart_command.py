"""`margo lint-chart CHART [--app margo.yaml] [--json]`: is a Helm chart fit for Margo?

The checks live in `authoring.chartlint`; this module only reads the inputs, prints and picks
the exit status, with the same conventions as `margo validate` so CI scripts can treat both
alike: 0 clean or warnings only, 1 any error, 2 unusable input (a chart or application that
cannot be read at all).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from authoring.chartlint import AppInput, ChartUnusableError, Finding, lint_chart, open_chart
from margo.errors import DocumentError, Problem
from margo.kinds import Kind
from margo.loading import LoadedDocument, load_path
from margo.validation import validate_loaded
from margo_cli.usage import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE, UsageError

__all__ = ["EXIT_ERRORS", "UnusableInputError", "load_app", "register", "run"]

EXIT_ERRORS = EXIT_FAILED


class UnusableInputError(UsageError):
    """Input that cannot be linted at all; carries the findings that say why (printed as
    JSON with `--json`, which is why this command catches it itself)."""

    def __init__(self, findings: list[Finding]):
        super().__init__("\n".join(f.format() for f in findings))
        self.findings = findings


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "lint-chart", help="check a Helm chart against Margo's chart rules",
        description="Lint a Helm chart (directory or .tgz) with the real Helm engine: "
                    "apiVersion v2, no lookup, hooks (helm test ones too) or CRDs, no node "
                    "names, replicas spread across nodes, resource requests and a memory "
                    "limit on every container, object names from the release, and (with "
                    "--app) every parameter pointer defined by the "
                    "chart. Exit 0 when clean or only warnings, 1 on errors, 2 when the "
                    "chart or application cannot be read.")
    parser.add_argument("chart", metavar="CHART", help="chart directory or .tgz archive")
    parser.add_argument("--app", metavar="MARGO_YAML",
                        help="ApplicationDescription whose helm components use this chart")
    parser.add_argument("--json", action="store_true",
                        help='print [{"file", "line", "level", "rule", "message"}]')
    parser.set_defaults(run=run)


def _problem_finding(problem: Problem, file: str) -> Finding:
    return Finding(problem.file or file, problem.line, "error", "app-invalid",
                   f"{problem.json_path}: {problem.message}")


def _locator(loaded: LoadedDocument) -> Any:
    def locate(path: tuple[str | int, ...]) -> int | None:
        position = loaded.source.value_position(path)
        return position[0] if position else None
    return locate


def load_app(path: str) -> AppInput:
    """Read and validate an ApplicationDescription; UnusableInputError when it cannot be
    used (unreadable, not YAML, not a valid description)."""
    try:
        loaded = load_path(path)
    except OSError as exc:
        raise UnusableInputError([Finding(path, None, "error", "app-invalid",
                                          f"cannot read: {exc.strerror or exc}")]) from None
    except DocumentError as exc:
        raise UnusableInputError([_problem_finding(p, path) for p in exc.problems]) from None
    report = validate_loaded(loaded, expect=Kind.APPLICATION_DESCRIPTION)
    if not report.valid:
        raise UnusableInputError([_problem_finding(p, path) for p in report.problems])
    return AppInput(report.model, path, _locator(loaded))


def _lint(args: argparse.Namespace) -> list[Finding]:
    app = load_app(args.app) if args.app else None
    try:
        with open_chart(args.chart) as chart:
            return lint_chart(chart, app)
    except ChartUnusableError as exc:
        raise UnusableInputError([Finding(args.chart, None, "error", "chart-unusable",
                                          str(exc).removeprefix(f"{args.chart}: "))]) from None


def _print(findings: list[Finding], as_json: bool, chart: str) -> None:
    if as_json:
        print(json.dumps([f.to_json() for f in findings], indent=2, ensure_ascii=False))
        return
    for finding in findings:
        print(finding.format())
    counts = {level: sum(f.level == level for f in findings) for level in ("error", "warning")}
    print(f"{chart}: {counts['error']} error(s), {counts['warning']} warning(s)")


def run(args: argparse.Namespace) -> int:
    try:
        findings = _lint(args)
    except UnusableInputError as exc:
        if args.json:
            _print(exc.findings, True, args.chart)
        else:
            for finding in exc.findings:
                print(finding.format(), file=sys.stderr)
        return EXIT_UNUSABLE
    _print(findings, args.json, args.chart)
    return EXIT_ERRORS if any(f.level == "error" for f in findings) else EXIT_OK
