"""`margo validate PATH...`: detect each document's kind and shape, report every problem.

A PATH is a file, a fleet source directory (`apps/`, `deployments/`: checked as the compiler
reads it, `compiler.context.source_problems`, the check the hosted source runs on a push), or
any other directory (every YAML and JSON file under it). A file that is a DeploymentIntent
(`apiVersion: margo-gitops.dev/v1alpha1`, `kind: DeploymentIntent`) is checked as the
compiler checks it (`compiler.intents.load_intent`), and, when it lies in the `deployments/`
directory of a fleet source, also against the application it names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.context import source_problems
from compiler.intents import INTENT_API_VERSION, load_intent
from compiler.source import SourceError, load_source
from margo.errors import DocumentError, Problem
from margo.loading import LoadedDocument, load_path
from margo.validation import validate_loaded

__all__ = ["register", "run"]

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2
INTENT_KIND = "DeploymentIntent"
_DOCUMENT_SUFFIXES = (".yaml", ".yml", ".json")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "validate", help="validate Margo documents, deployment intents and fleet sources",
        description="Validate files (any Margo kind and spec shape, or a DeploymentIntent), "
                    "fleet source directories (apps/*/margo.yaml and deployments/*.yaml, as "
                    "the compiler reads them) and directories of documents. Exit 0 when all "
                    "are valid, 1 when any is invalid, 2 when any cannot be read.")
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--json", action="store_true",
                        help='print [{"path", "kind", "valid", "errors": [...]}]')
    parser.set_defaults(run=run)


class _Unreadable(Exception):
    """A PATH that cannot be validated at all (missing, unreadable, no documents)."""


@dataclass
class _FileResult:
    """What `margo validate` prints for one file."""

    file: str
    kind: str | None
    shape: str | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        if self.kind is None:
            return "unknown document"
        return f"{self.kind} ({self.shape} shape)" if self.shape else self.kind

    def to_json(self) -> dict[str, Any]:
        return {"path": self.file, "kind": self.kind, "shape": self.shape,
                "valid": self.valid, "errors": [p.to_json() for p in self.problems]}


def _is_intent(document: Any) -> bool:
    return isinstance(document, dict) and (document.get("kind") == INTENT_KIND
                                           or document.get("apiVersion") == INTENT_API_VERSION)


def _in_source(path: str) -> tuple[Path, str] | None:
    """The fleet source an intent file lies in, and its path there: `ROOT/deployments/X`
    with a sibling `apps/` directory."""
    file = Path(path)
    if file.parent.name == "deployments" and (file.parent.parent / "apps").is_dir():
        return file.parent.parent, f"deployments/{file.name}"
    return None


def _sorted(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line or 0, p.column or 0, p.json_path))


def _intent_result(path: str, loaded: LoadedDocument) -> _FileResult:
    """An intent checked as the compiler checks it; in a fleet source, with everything the
    source check finds in this file (its application, parameters and literal values)."""
    where = _in_source(path)
    if where is not None:
        root, rel = where
        try:
            found = source_problems(load_source(root))
        except SourceError as exc:
            raise _Unreadable(str(exc)) from None
        return _FileResult(path, INTENT_KIND, problems=_sorted(
            [dataclasses.replace(p, file=path) for p in found if p.file == rel]))
    try:
        load_intent(loaded)
    except DocumentError as exc:
        return _FileResult(path, INTENT_KIND, problems=_sorted(list(exc.problems)))
    return _FileResult(path, INTENT_KIND)


def _validate_file(path: str) -> _FileResult:
    """One file; `OSError` propagates (unreadable is not the same as invalid)."""
    try:
        loaded = load_path(path)
    except DocumentError as exc:
        return _FileResult(path, None, problems=list(exc.problems))
    if _is_intent(loaded.value):
        return _intent_result(path, loaded)
    report = validate_loaded(loaded)
    return _FileResult(path, str(report.kind) if report.kind else None,
                      str(report.shape) if report.shape else None, report.problems)


def _is_source(root: Path) -> bool:
    return (root / "apps").is_dir() or (root / "deployments").is_dir()


def _source_results(path: str) -> list[_FileResult]:
    """Every file the compiler reads in the fleet source `path`, with the problems the
    source check locates in it (paths as given: `path/deployments/web.yaml`)."""
    try:
        source = load_source(path)
    except SourceError as exc:
        raise _Unreadable(str(exc)) from None
    results: dict[str, _FileResult] = {}

    def result(rel: str) -> _FileResult:
        if rel not in results:
            kind = "ApplicationDescription" if rel.startswith("apps/") else INTENT_KIND
            results[rel] = _FileResult(os.path.normpath(os.path.join(path, rel)), kind)
        return results[rel]

    for versions in source.applications.values():
        for app in versions.values():
            result(app.file).shape = str(app.description.shape)
    for intent in source.intents.values():
        result(intent.file)
    for problem in source_problems(source):
        found = result(problem.file or "")
        found.problems.append(dataclasses.replace(problem, file=found.file))
    for found in results.values():
        found.problems = _sorted(found.problems)
    return [results[rel] for rel in sorted(results)]


def _documents_in(root: Path) -> list[str]:
    """The YAML and JSON files under `root`, in order; hidden directories and files are
    skipped (`.git`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [os.path.join(dirpath, name) for name in sorted(filenames)
                  if name.endswith(_DOCUMENT_SUFFIXES) and not name.startswith(".")]
    return found


def _validate_path(path: str) -> list[_FileResult]:
    """The results for one PATH; `_Unreadable` (or `OSError`) when it cannot be validated."""
    root = Path(path)
    if not root.is_dir():
        return [_validate_file(path)]
    if _is_source(root):
        return _source_results(path)
    files = _documents_in(root)
    if not files:
        raise _Unreadable(f"{path}: no YAML or JSON documents in this directory")
    return [_validate_file(file) for file in files]


def _unreadable_json(path: str, message: str) -> dict[str, Any]:
    return {"path": path, "kind": None, "shape": None, "valid": False,
            "errors": [{"file": path, "line": None, "column": None, "path": "$",
                        "message": message, "expected": None, "found": None}]}


def _print(result: _FileResult) -> None:
    if result.valid:
        print(f"{result.file}: valid {result.describe()}")
    for problem in result.problems:
        print(problem.format())


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    invalid = unreadable = False
    for path in args.paths:
        try:
            found = _validate_path(path)
        except OSError as exc:
            unreadable = True
            message = f"cannot read: {exc.strerror or exc}"
            print(f"{path}: {message}", file=sys.stderr)
            results.append(_unreadable_json(path, message))
            continue
        except _Unreadable as exc:
            unreadable = True
            print(exc, file=sys.stderr)
            results.append(_unreadable_json(path, str(exc)))
            continue
        if not found and not args.json:
            print(f"{path}: valid fleet source (no applications, no intents)")
        for result in found:
            invalid = invalid or not result.valid
            results.append(result.to_json())
            if not args.json:
                _print(result)
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
    if unreadable:
        return EXIT_UNREADABLE
    return EXIT_INVALID if invalid else EXIT_OK
