"""Each guard `make lint` runs besides the size budgets fails on a deliberately broken example,
under the repository's own settings (pyproject.toml): ruff's complexity and statement rules,
the import-cycle contract and the strict type check (issue 30, "Guards in make lint")."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SETTINGS = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(*command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_refuses_a_function_too_complex_or_too_long(tmp_path: Path) -> None:
    limit = SETTINGS["tool"]["ruff"]["lint"]["mccabe"]["max-complexity"]
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(limit))
    statements = "".join(f"    y{i} = {i}\n" for i in range(51))
    (tmp_path / "broken.py").write_text(
        f'"""Broken on purpose."""\n\n\ndef tangled(x: int) -> int:\n{branches}    return -1\n'
        f"\n\ndef sprawling() -> None:\n{statements}")
    done = _run(str(BIN / "ruff"), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                "--output-format", "concise", "broken.py", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"C901 `tangled` is too complex ({limit + 1} > {limit})" in done.stdout
    assert "PLR0915 Too many statements (51 > 50)" in done.stdout


def test_the_cycle_contract_refuses_two_modules_importing_each_other(tmp_path: Path) -> None:
    """The repository's acyclic contract, pointed at a package whose two modules import each
    other; one where only one imports the other passes."""
    contract = next(c for c in SETTINGS["tool"]["importlinter"]["contracts"]
                    if c["type"] == "acyclic_siblings")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from pkg import a\n")
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.importlinter]\nroot_packages = ["pkg"]\n\n[[tool.importlinter.contracts]]\n'
        f'name = "{contract["name"]}"\ntype = "{contract["type"]}"\nancestors = ["pkg"]\n')
    lint = (str(BIN / "lint-imports"), "--no-cache", "--no-logo")
    broken = _run(*lint, cwd=tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "No cycles are allowed in pkg" in broken.stdout
    (package / "b.py").write_text("")
    kept = _run(*lint, cwd=tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr


def test_the_type_check_is_strict_and_refuses_an_ill_typed_module(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(
        '"""Broken on purpose."""\n\n\ndef count(x: int) -> str:\n    return x\n\n\n'
        "def untyped(x):\n    return x\n")
    done = _run(str(BIN / "mypy"), "--config-file", str(ROOT / "pyproject.toml"),
                "--cache-dir", str(tmp_path / "cache"), "broken.py", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Incompatible return value type (got "int", expected "str")' in done.stdout
    assert "Function is missing a type annotation" in done.stdout  # strict


def test_no_module_is_excused_from_the_type_check() -> None:
    """Every package type-checks strict with no module excused (issue 30 fixed the last
    ones): an `ignore_errors` override would hide a module from `make lint`'s mypy."""
    excused = [o for o in SETTINGS["tool"]["mypy"].get("overrides", [])
               if o.get("ignore_errors")]
    assert excused == [], excused
