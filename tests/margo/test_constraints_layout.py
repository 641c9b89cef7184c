"""The layout of `margo.constraints`: nothing private crosses a module border (issue 30).

Each dialect module (capacity, legacy requiredResources, matchExpressions, eligibility rules,
draft characteristics, each cluster requirement) holds its compilation next to its checks and
shares only public names with the small core (results, compiled constraints, the problem
collector). A leading underscore promises "only this module uses it"; this guard keeps the
promise checked, so the package cannot drift back into one class spread over many files.

A name crosses a border when a module of the package

* imports it from another module of the package (`from margo.constraints.x import _y`,
  `from .x import _y`), or
* reads a private attribute (`something._y`) that the module does not define itself: a
  private method or field of another module's class, or `x._y` of an imported module.

Run it as a script to list the crossings of a tree:

    .venv/bin/python tests/margo/test_constraints_layout.py [package dir] [package name]
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "margo" / "constraints"
PACKAGE = "margo.constraints"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, assignments (module, class and
    `self.x = ...` targets), annotated fields and parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _imports_package(node: ast.ImportFrom, package: str) -> bool:
    return bool(node.level) or (node.module or "").split(".")[:len(package.split("."))] == (
        package.split("."))


def crossings_in(path: Path, package: str) -> list[str]:
    """Private names that cross into the module at `path`, one line each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = _defined_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _imports_package(node, package):
            source = "." * node.level + (node.module or "")
            found += [f"{path.name}:{node.lineno}: imports {alias.name} from {source}"
                      for alias in node.names if _is_private(alias.name)]
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
              and node.attr not in defined):
            found.append(f"{path.name}:{node.lineno}: uses .{node.attr}, defined elsewhere")
    return found


def private_crossings(package_dir: Path, package: str) -> list[str]:
    """Every private name that crosses a module border inside the package at `package_dir`."""
    found: list[str] = []
    for path in sorted(package_dir.glob("*.py")):
        found += crossings_in(path, package)
    return found


def test_no_private_name_crosses_a_module_border() -> None:
    crossings = private_crossings(PACKAGE_DIR, PACKAGE)
    assert crossings == [], "\n".join(crossings)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package_dir = root / "pkg"
    package_dir.mkdir()
    for name, text in files.items():
        (package_dir / name).write_text(textwrap.dedent(text))
    return package_dir


def test_the_guard_reports_a_private_import_and_a_private_attribute(tmp_path: Path) -> None:
    package_dir = _write_package(tmp_path, {
        "__init__.py": "",
        "core.py": """
            class Check:
                def _ok(self) -> bool:
                    return True

            _HIDDEN = 1
            """,
        "dialect.py": """
            from pkg.core import _HIDDEN, Check
            from .core import _HIDDEN as again

            def use(check: Check) -> bool:
                return check._ok() and _HIDDEN == again
            """,
    })
    assert private_crossings(package_dir, "pkg") == [
        "dialect.py:2: imports _HIDDEN from pkg.core",
        "dialect.py:3: imports _HIDDEN from .core",
        "dialect.py:6: uses ._ok, defined elsewhere",
    ]


def test_the_guard_passes_private_names_kept_at_home(tmp_path: Path) -> None:
    package_dir = _write_package(tmp_path, {
        "__init__.py": "",
        "core.py": """
            from dataclasses import dataclass

            from pkg.words import PUBLIC

            _LIMIT = PUBLIC

            @dataclass
            class Check:
                _cache: int = 0

                def _ok(self) -> bool:
                    return self._cache < _LIMIT

                def passes(self) -> bool:
                    return self._ok() and self.__class__ is Check
            """,
        "words.py": "PUBLIC = 3\n",
    })
    assert private_crossings(package_dir, "pkg") == []


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR
    lines = private_crossings(directory, sys.argv[2] if len(sys.argv) > 2 else PACKAGE)
    print("\n".join(lines))
    print(f"{len(lines)} private names cross a module border in {directory}")
