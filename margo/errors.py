"""Located problems: the one error vocabulary every layer of margo-gitops reports in.

A `Problem` says where (file, line, column, JSON path), what was expected and what was
found. Validation collects many of them; code that must stop raises `DocumentError`
carrying the list, so callers can print every problem at once instead of the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["DocumentError", "Path", "Problem", "format_path", "short_repr"]

#: A location inside a document: mapping keys (str) and sequence indices (int).
Path = tuple[str | int, ...]


def format_path(path: Sequence[str | int]) -> str:
    """Render a path as `$.a.b[0]`, quoting keys that are not plain identifiers."""
    out = ["$"]
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif part and (part[0].isalpha() or part[0] == "_") and all(
            c.isalnum() or c in "_-" for c in part
        ):
            out.append(f".{part}")
        else:
            escaped = part.replace("\\", "\\\\").replace("'", "\\'")
            out.append(f"['{escaped}']")
    return "".join(out)


def short_repr(value: Any, limit: int = 80) -> str:
    """A bounded, human-friendly rendering of a found value for messages."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, dict):
        text = "an object" if value else "an empty object"
    elif isinstance(value, list):
        text = f"a list of {len(value)} item(s)" if value else "an empty list"
    elif isinstance(value, int) and value.bit_length() > 256:
        text = f"an integer of {value.bit_length()} bits"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a document, with enough context to fix it without guessing."""

    path: Path
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    expected: str | None = None
    found: str | None = None

    @property
    def json_path(self) -> str:
        return format_path(self.path)

    def located(self, *, file: str | None, line: int | None, column: int | None) -> Problem:
        return replace(self, file=file, line=line, column=column)

    def format(self) -> str:
        """`file:line:col: path: message`, the form editors and CI annotators understand."""
        where = f"{self.file or '<input>'}:{self.line or 0}:{self.column or 0}"
        return f"{where}: {self.json_path}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "path": self.json_path,
            "message": self.message,
            "expected": self.expected,
            "found": self.found,
        }


class DocumentError(ValueError):
    """Raised when a document cannot be used; carries every problem found, never just one."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: list[Problem] = list(problems)
        if not self.problems:
            raise ValueError("DocumentError needs at least one problem")
        super().__init__("\n".join(p.format() for p in self.problems))
