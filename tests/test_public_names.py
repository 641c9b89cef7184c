"""Each package's exported names are pinned: a module's `__all__` may change only together
with tests/public_names.json, so an API change is always a deliberate, reviewed one.

    MARGO_PIN_PUBLIC_NAMES=1 .venv/bin/python -m pytest tests/test_public_names.py

rewrites the file after an intended change. Every module of the project's packages must
declare `__all__` (package `__init__` files without definitions excepted), and every name it
lists must exist.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("margo", "margo_cli", "compiler", "wfm", "reconciler", "conformance", "authoring")
PINNED = Path(__file__).with_name("public_names.json")


def modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            found.append((".".join(parts), path))
    return found


def _defines_anything(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(not isinstance(node, ast.Expr | ast.Import | ast.ImportFrom)
               for node in tree.body)


def exported() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, path in modules():
        if name.endswith("__main__"):
            continue
        if path.name == "__init__.py" and not _defines_anything(path):
            continue
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        assert names is not None, f"{name} declares no __all__"
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
        out[name] = sorted(names)
    return out


def test_every_package_exports_exactly_the_pinned_names() -> None:
    current = exported()
    if os.environ.get("MARGO_PIN_PUBLIC_NAMES") == "1":
        PINNED.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(PINNED.read_text())
    changed = {m: {"added": sorted(set(current.get(m, [])) - set(pinned.get(m, []))),
                   "removed": sorted(set(pinned.get(m, [])) - set(current.get(m, [])))}
               for m in sorted(set(current) | set(pinned)) if current.get(m) != pinned.get(m)}
    assert not changed, ("exported names changed; if intended, run with "
                         f"MARGO_PIN_PUBLIC_NAMES=1: {changed}")
