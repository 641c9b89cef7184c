"""A non-editable install carries what the packages read at run time: the JSON Schemas,
the commit-message template and the dashboard's templates and stylesheet (package data),
and every package of the project."""

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
                     "wfm/templates/dashboard/base.html", "wfm/templates/dashboard/style.css",
                     "margo/schemas/ApplicationDescription.rc.3.schema.json"):
        assert expected in names, sorted(n for n in names if "templates" in n or "schemas" in n)
    packages = {name.split("/", 1)[0] for name in names if name.endswith(".py")}
    assert packages >= {"margo", "margo_cli", "compiler", "wfm", "reconciler", "conformance",
                        "authoring"}
