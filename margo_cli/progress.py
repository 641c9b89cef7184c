"""Progress bars for the CLI's long operations (tqdm, on stderr).

A bar is drawn only when stderr is a terminal and the work is long enough to be worth one
(`minimum` items); a pipe, a log file, a CI job or `--json` output never sees one, and
what a command prints on stdout comes out as without a bar (`Bar.write` prints above it).
Where: compiling a fleet (`margo compile`, `margo plan`), `margo secrets rotate-key` and
`margo secrets check` over a source's intents, `margo conformance wfm` over its steps.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

__all__ = ["Bar", "bar", "iterate"]

T = TypeVar("T")


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def write(self, text: str) -> None: ...


class _NoBar:
    """What a command gets when no bar is drawn: counting does nothing, lines print."""

    def update(self, n: int = 1) -> object:
        return None

    def write(self, text: str) -> None:
        print(text, flush=True)


class _TqdmBar:
    def __init__(self, bar: Any):
        self._bar = bar

    def update(self, n: int = 1) -> object:
        return self._bar.update(n)

    def write(self, text: str) -> None:
        self._bar.write(text, file=sys.stdout)


def _wanted(total: int | None, minimum: int, enabled: bool) -> bool:
    return enabled and sys.stderr.isatty() and (total is None or total >= minimum)


@contextmanager
def bar(total: int | None, desc: str, *, minimum: int = 1, enabled: bool = True,
        unit: str = "it") -> Iterator[Bar]:
    """A bar of `total` steps (None: unknown) while the block runs, or a `_NoBar`."""
    if not _wanted(total, minimum, enabled):
        yield _NoBar()
        return
    from tqdm import tqdm  # only when a bar is drawn

    with tqdm(total=total, desc=desc, leave=False, file=sys.stderr, unit=unit) as drawn:
        yield _TqdmBar(drawn)


def iterate(items: Iterable[T], total: int, desc: str, *, minimum: int = 20,
            unit: str = "it") -> Iterable[T]:
    """`items`, advancing a bar as each is taken (`items` itself when no bar is drawn)."""
    if not _wanted(total, minimum, True):
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, leave=False, file=sys.stderr, unit=unit)
