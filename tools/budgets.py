"""The size budgets `make lint` holds the product packages to: at most 700 lines per module
and 60 lines per function (issue 30, "Guards in make lint").

Ruff counts complexity and statements, not lines, and knows no module size; the budgets are
the rule the design states ("small modules, short functions"), checked here so that growth
shows up in review as one failing line instead of a slow drift. A function's lines run from
its `def` (decorators excluded) to its last line, docstring and comments included: that is
what a reader has to hold. Methods and nested functions count on their own.

Today's offenders are listed, each with the part of the issue that removes it, in
`tools/budgets.toml`. An entry there excuses its module or function whatever its size; an
entry no longer over budget is an error too, so the list only ever shrinks. An entry whose
module or function is gone excuses nothing and is only noted (while code moves, the list may
name a module at its old and its new place).

Run: `python -m tools.budgets` (exit 1 on any finding) from the repository's root.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FUNCTION_LINES", "MODULE_LINES", "PACKAGES", "Finding", "check", "main",
           "measure"]

MODULE_LINES = 700
FUNCTION_LINES = 60
PACKAGES = ("margo", "margo_cli", "compiler", "wfm", "reconciler", "conformance", "authoring")
ALLOWLIST = Path(__file__).with_name("budgets.toml")


@dataclass(frozen=True)
class Finding:
    """One line of the report: `key` is `path` or `path::Qualified.name`."""

    key: str
    lines: int
    limit: int
    stale: bool = False  # an allowlist entry that is within budget, or gone (limit 0)

    def format(self) -> str:
        if self.stale and not self.limit:
            return f"note: {self.key}: allowed, but gone: remove it from tools/{ALLOWLIST.name}"
        if self.stale:
            return (f"{self.key}: allowed, but {self.lines} lines are within the budget of "
                    f"{self.limit}: remove it from tools/{ALLOWLIST.name}")
        return f"{self.key}: {self.lines} lines, over the budget of {self.limit}"


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function and method under `tree`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            yield name, (node.end_lineno or node.lineno) - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def measure(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[int, int]]:
    """Every module's and function's key -> (lines, its budget), under `root`."""
    sizes: dict[str, tuple[int, int]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            text = path.read_text(encoding="utf-8")
            sizes[relative] = (len(text.splitlines()), MODULE_LINES)
            for name, lines in _functions(ast.parse(text, filename=relative)):
                sizes[f"{relative}::{name}"] = (lines, FUNCTION_LINES)
    return sizes


def check(sizes: dict[str, tuple[int, int]], allowed: set[str]) -> list[Finding]:
    """What is over budget and not allowed, then what is allowed but no longer needs it."""
    over = [Finding(key, lines, limit) for key, (lines, limit) in sizes.items()
            if lines > limit and key not in allowed]
    stale = [Finding(key, *sizes.get(key, (0, 0)), stale=True) for key in sorted(allowed)
             if key not in sizes or sizes[key][0] <= sizes[key][1]]
    return over + stale


def load_allowlist(path: Path) -> set[str]:
    """The keys of the allowlist file (`[modules]` and `[functions]` tables)."""
    table = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return set(table.get("modules", {})) | set(table.get("functions", {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.budgets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd())
    parser.add_argument("--allowlist", type=Path, default=ALLOWLIST)
    parser.add_argument("packages", nargs="*", default=list(PACKAGES))
    args = parser.parse_args(argv)
    findings = check(measure(args.root, tuple(args.packages)), load_allowlist(args.allowlist))
    for finding in findings:
        print(finding.format(), file=sys.stderr)
    return 1 if any(finding.limit for finding in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
