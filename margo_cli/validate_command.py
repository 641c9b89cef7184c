"""`margo validate PATH...`: detect each document's kind and shape, report every problem."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from margo.validation import ValidationReport, validate_file

__all__ = ["register", "run"]

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "validate", help="validate Margo documents (any kind, any spec shape)",
        description="Validate Margo documents. Exit 0 when all are valid, 1 when any is "
                    "invalid, 2 when any cannot be read.")
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--json", action="store_true",
                        help='print [{"path", "kind", "valid", "errors": [...]}]')
    parser.set_defaults(run=run)


def _describe(report: ValidationReport) -> str:
    return f"{report.kind} ({report.shape} shape)" if report.kind else "unknown document"


def _unreadable_json(path: str, exc: OSError) -> dict[str, Any]:
    message = f"cannot read: {exc.strerror or exc}"
    return {"path": path, "kind": None, "shape": None, "valid": False,
            "errors": [{"file": path, "line": None, "column": None, "path": "$",
                        "message": message, "expected": None, "found": None}]}


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    reports: list[ValidationReport] = []
    unreadable = False
    for path in args.paths:
        try:
            report = validate_file(path)
        except OSError as exc:
            unreadable = True
            print(f"{path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            results.append(_unreadable_json(path, exc))
            continue
        reports.append(report)
        results.append(report.to_json())
        if not args.json:
            if report.valid:
                print(f"{report.file}: valid {_describe(report)}")
            for problem in report.problems:
                print(problem.format())
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
    if unreadable:
        return EXIT_UNREADABLE
    return EXIT_OK if all(r.valid for r in reports) else EXIT_INVALID
