"""`python -m margo.schemas [--check]`: write (or check) the exported schema files."""

from __future__ import annotations

import sys
from pathlib import Path

from margo.canonical import pretty_json
from margo.schemas.source import BUILDERS, build, file_name


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    stale = []
    for kind, shape in BUILDERS:
        target = here / file_name(kind, shape)
        text = pretty_json(build(kind, shape))
        if target.exists() and target.read_text("utf-8") == text:
            continue
        stale.append(target.name)
        if "--check" not in argv:
            target.write_text(text, "utf-8")
    if stale and "--check" in argv:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
