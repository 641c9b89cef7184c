"""A non-editable install carries what the packages read at run time: the JSON Schemas,
the commit-message template, the dashboard's templates and stylesheet and `margo init`'s
scaffolds (templates/, as margo_cli/scaffolds) as package data, and every package of the
project."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_package_data(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = tmp_path.glob("margo_gitops-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("compiler/templates/commit-message.txt.j2",
                     "wfm/http/templates/dashboard/base.html",
                     "wfm/http/templates/dashboard/style.css",
                     "margo/schemas/ApplicationDescription.rc.3.schema.json"):
        assert expected in names, sorted(n for n in names if "templates" in n or "schemas" in n)
    scaffolds = {"margo_cli/scaffolds/" + p.relative_to(ROOT / "templates").as_posix()
                 for p in (ROOT / "templates").rglob("*") if p.is_file()}
    assert scaffolds and scaffolds <= names, sorted(scaffolds - names)
    packages = {name.split("/", 1)[0] for name in names if name.endswith(".py")}
    assert packages >= {"margo", "margo_cli", "compiler", "wfm", "reconciler", "conformance",
                        "authoring"}
