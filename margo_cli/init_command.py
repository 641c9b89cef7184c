"""`margo init [DIR]` and `margo init --chart NAME [DIR]`: a person's starting point.

The first writes a fleet source (`apps/` with one application, `deployments/` with one intent
that places it); the second an application in `DIR/NAME`: its `margo.yaml`, declaring what a
device must offer and the parameters an intent may set, and a Margo-friendly Helm chart in
`charts/NAME` (names from the release, replicas spread across nodes, resource requests:
docs/helm-charts.md). Both are copies of the repository's `templates/`, which the package
carries as `margo_cli/scaffolds` (a link in a checkout, package data in a wheel), with
`__NAME__` in file names and text replaced by NAME.

Nothing is overwritten: a target folder that exists and holds anything is refused (exit 2).
"""

from __future__ import annotations

import argparse
import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from margo_cli.usage import EXIT_OK, UsageError

__all__ = ["PLACEHOLDER", "register", "run", "scaffold"]

PLACEHOLDER = "__NAME__"
#: A chart name that is also a DNS label short enough for Helm's release names (53).
_CHART_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,51}[a-z0-9])?$")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "init", help="scaffold a fleet source, or an application with a Margo-friendly "
                     "Helm chart (--chart NAME)",
        description="Write a fleet source into DIR (default: the current folder), or with "
                    "--chart NAME an application (margo.yaml and charts/NAME) into DIR/NAME. "
                    "Exit 0, or 2 when the target holds anything already or NAME is unusable.")
    parser.add_argument("dir", nargs="?", default=".", metavar="DIR")
    parser.add_argument("--chart", metavar="NAME",
                        help="a chart name: lowercase letters, digits and '-' (at most 53)")
    parser.set_defaults(run=run)


def scaffold(source: Traversable, target: Path, name: str = "") -> list[Path]:
    """Copy the scaffold `source` into `target` (created), with PLACEHOLDER in names and
    text replaced by `name`; the files written, in order. `UsageError` when `target` exists
    and is not an empty folder."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"margo init: {target} already exists and is not empty; "
                         "name a new folder")
    written: list[Path] = []
    _copy(source, target, name, written)
    return written


def _copy(source: Traversable, target: Path, name: str, written: list[Path]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir(), key=lambda e: e.name):
        destination = target / entry.name.replace(PLACEHOLDER, name)
        if entry.is_dir():
            _copy(entry, destination, name, written)
        else:
            text = entry.read_text(encoding="utf-8").replace(PLACEHOLDER, name)
            destination.write_text(text, encoding="utf-8")
            written.append(destination)


def run(args: argparse.Namespace) -> int:
    scaffolds = resources.files("margo_cli") / "scaffolds"
    if args.chart is None:
        written = scaffold(scaffolds / "fleet", Path(args.dir))
        hint = f"next: margo validate {Path(args.dir) / 'apps'}/*/margo.yaml"
    else:
        if not _CHART_NAME.match(args.chart):
            raise UsageError(f"margo init: {args.chart!r} is no chart name: lowercase "
                             "letters, digits and '-', starting with a letter, at most 53")
        target = Path(args.dir) / args.chart
        written = scaffold(scaffolds / "chart", target, args.chart)
        hint = (f"next: margo lint-chart {target / 'charts' / args.chart} "
                f"--app {target / 'margo.yaml'}")
    for path in written:
        print(f"wrote {path}")
    print(hint)
    return EXIT_OK
