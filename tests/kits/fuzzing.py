"""How many examples the costly property tests run: a quick count on every `make test`,
the deep one with ``MARGO_FUZZ=deep`` (`make fuzz`).

Why two counts: the property tests that drive a real server (Git smart HTTP, the intake of
identifiers, JSON numbers and request bodies) cost 0.2-0.5 s per example, so their deep
counts alone took minutes of the suite's 15. The quick count still runs every strategy on
every `make test` (and hypothesis replays any failure it saved in ``.hypothesis/`` first);
`make fuzz` runs the deep count before a release or after changing an input path.
Cheap property tests (pure functions, milliseconds per example) keep one count.
"""

from __future__ import annotations

import os

__all__ = ["DEEP", "examples"]

#: Whether this run is the deep one (``MARGO_FUZZ=deep``).
DEEP = os.environ.get("MARGO_FUZZ", "").strip().lower() == "deep"


def examples(quick: int, deep: int) -> int:
    """`deep` in a deep run, else `quick` (the count for `hypothesis.settings`)."""
    if not 0 < quick <= deep:
        raise ValueError(f"examples: need 0 < quick ({quick}) <= deep ({deep})")
    return deep if DEEP else quick
