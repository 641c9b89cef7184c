"""The size budgets (`tools/budgets.py`, run by `make lint`) catch a module over 700 lines and
a function over 60, excuse what the allowlist names, and refuse an entry that no longer needs
excusing, so the allowlist only shrinks."""

from __future__ import annotations

from pathlib import Path

from tools import budgets


def _package(root: Path) -> None:
    """`pkg/`: a 701-line module, a 61-line method, and small neighbours of both."""
    package = root / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "big.py").write_text("x = 1\n" * 701)
    (package / "fits.py").write_text("x = 1\n" * 700)
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    (package / "long.py").write_text(
        f"class Thing:\n    def long(self):\n{body}\n    def short(self):\n        return 1\n")


def test_a_module_over_700_lines_and_a_function_over_60_are_reported(tmp_path: Path) -> None:
    _package(tmp_path)
    findings = budgets.check(budgets.measure(tmp_path, ("pkg",)), allowed=set())
    assert [(f.key, f.lines, f.stale) for f in findings] == [
        ("pkg/big.py", 701, False), ("pkg/long.py::Thing.long", 61, False)]
    assert budgets.main(["--root", str(tmp_path), "--allowlist", str(tmp_path / "none"),
                         "pkg"]) == 1


def test_an_allowlisted_offender_passes(tmp_path: Path) -> None:
    _package(tmp_path)
    allowlist = tmp_path / "allow.toml"
    allowlist.write_text('[modules]\n"pkg/big.py" = "why"\n'
                         '[functions]\n"pkg/long.py::Thing.long" = "why"\n')
    assert budgets.main(["--root", str(tmp_path), "--allowlist", str(allowlist), "pkg"]) == 0


def test_an_allowlist_entry_within_budget_fails_and_one_gone_is_noted(tmp_path: Path) -> None:
    _package(tmp_path)
    allowed = {"pkg/big.py", "pkg/long.py::Thing.long", "pkg/fits.py",
               "pkg/long.py::Thing.short", "pkg/gone.py"}
    findings = budgets.check(budgets.measure(tmp_path, ("pkg",)), allowed)
    assert sorted(f.key for f in findings if f.stale) == [
        "pkg/fits.py", "pkg/gone.py", "pkg/long.py::Thing.short"]
    assert not [f for f in findings if not f.stale]
    allowlist = tmp_path / "allow.toml"
    allowlist.write_text('[modules]\n"pkg/big.py" = ""\n"pkg/gone.py" = ""\n'
                         '[functions]\n"pkg/long.py::Thing.long" = ""\n')
    assert budgets.main(["--root", str(tmp_path), "--allowlist", str(allowlist), "pkg"]) == 0
    allowlist.write_text(allowlist.read_text() + '"pkg/long.py::Thing.short" = ""\n')
    assert budgets.main(["--root", str(tmp_path), "--allowlist", str(allowlist), "pkg"]) == 1

