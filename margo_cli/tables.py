"""Text for people at a terminal, shared by the commands that show a server's state
(`margo status`, `margo get`, `margo describe`): aligned tables whose every cell is one
line, relative times and state counts.

A device reports what it likes as an error message: Compose progress output, a Helm
stack trace, escape sequences. In a table cell it is cut to its first line and a width,
with what could move the cursor removed, so one row stays one row (`cell`); where a
message is the subject (`margo describe`), `clean_lines` keeps every line, cleaned alike.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ELLIPSIS", "TEXT_WIDTH", "age", "ago", "cell", "clean_lines", "column_widths",
           "counts", "row_line", "table"]

ELLIPSIS = "…"
#: The widest a free-text cell (an error message, a reason) is shown in a table.
TEXT_WIDTH = 60
#: ANSI escape sequences (colour, cursor movement) and OSC strings (terminal titles).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.?")


def _printable(line: str) -> str:
    """`line` without escape sequences and control or format characters (a tab is a
    space): nothing left in it can move the cursor or change the terminal."""
    text = _ESCAPES.sub("", line).replace("\t", " ")
    return "".join(c for c in text if unicodedata.category(c) not in ("Cc", "Cf"))


def clean_lines(text: Any) -> list[str]:
    """Every non-blank line of `text`, each printable (see `_printable`)."""
    lines = (_printable(line).rstrip() for line in str(text).splitlines())
    return [line for line in lines if line.strip()]


def cell(text: Any, width: int = TEXT_WIDTH) -> str:
    """`text` as one table cell: its first non-blank line, printable, at most `width`
    characters; an ellipsis ends it when anything was cut (a later line, or the rest of a
    long one). None and blank text are `-`."""
    if text is None:
        return "-"
    lines = clean_lines(text)
    if not lines:
        return "-"
    first = " ".join(lines[0].split())
    if len(first) > width or len(lines) > 1:
        return first[:max(1, width - 1)].rstrip() + ELLIPSIS
    return first


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """Rows under headers, columns padded to their widest cell (cells must be one line:
    pass free text through `cell`)."""
    widths = column_widths(rows, headers)
    return "\n".join(row_line(r, widths) for r in [headers, *rows])


def column_widths(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> list[int]:
    return [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]


def row_line(row: Sequence[Any], widths: Sequence[int]) -> str:
    """One row padded to `widths` (a cell wider than its column pushes the rest along)."""
    return "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()


def ago(when: float | None, now: float) -> str:
    """`12s ago`, `5m ago`, `3h ago`, `2d ago`; `-` for an unknown time."""
    if when is None:
        return "-"
    seconds = max(0, int(now - when))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def age(when: float | None, now: float) -> str:
    """`ago` without the `ago`: an AGE column's cell."""
    return ago(when, now).removesuffix(" ago")


def counts(by_state: Mapping[str, Any] | None) -> str:
    """`failed=1, installed=3` (`-` when there is none)."""
    return ", ".join(f"{k}={v}" for k, v in (by_state or {}).items()) or "-"
