"""The problems of one compile: every dialect's compile step records into the same
`ProblemCollector`, so a document with five mistakes reports five located `Problem`s at once
instead of stopping at the first.

It also holds the structural checks every dialect repeats (an object where one is expected,
no unknown fields, a list of items): a typo in a field name must be an error, never a clause
that silently drops out and so widens matching.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from margo.constraints.vocabulary import MISSING
from margo.errors import Path, Problem, short_repr

__all__ = ["ProblemCollector"]

_EXTENSION_KEY = re.compile(r"x-[a-z][a-z0-9-]*-extensions")


class ProblemCollector:
    """Collects located problems while constraints compile; `problems` in document order."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def problem(self, path: Path, message: str, *, expected: str | None = None,
                found: Any = MISSING) -> None:
        shown = None if found is MISSING else short_repr(found)
        self.problems.append(Problem(path=path, message=message, expected=expected, found=shown))

    def mapping(self, value: Any, path: Path, what: str) -> Mapping[str, Any] | None:
        """`value` if it is an object, else None with a problem recorded."""
        if isinstance(value, Mapping):
            return value
        self.problem(path, f"{what} must be an object", expected="an object", found=value)
        return None

    def fields_of(self, value: Any, path: Path, what: str, allowed: tuple[str, ...], *,
                  extensions: bool = False) -> Mapping[str, Any] | None:
        """`value` as an object of `allowed` fields: None when it is no object, a problem for
        every unknown field (the object is still returned, so its known fields are checked)."""
        doc = self.mapping(value, path, what)
        if doc is not None:
            self.known_fields(doc, allowed, path, what, extensions=extensions)
        return doc

    def known_fields(self, doc: Mapping[str, Any], allowed: tuple[str, ...], path: Path,
                     what: str, *, extensions: bool = False) -> None:
        """Unknown fields are errors: a typo must not silently drop (and so widen) a clause."""
        for field in doc:
            if field in allowed:
                continue
            if extensions and isinstance(field, str) and _EXTENSION_KEY.fullmatch(field):
                continue
            close = difflib.get_close_matches(str(field), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            where = field if isinstance(field, str | int) else str(field)
            self.problem((*path, where), f"unknown field {field!r} in {what}{hint}",
                         expected="one of " + ", ".join(allowed), found=field)

    def items(self, doc: Mapping[str, Any], field: str, path: Path) -> list[tuple[int, Any]]:
        """The indexed entries of the list `doc[field]` (none when absent or not a list)."""
        if field not in doc:
            return []
        value = doc[field]
        if not isinstance(value, list | tuple):
            self.problem((*path, field), f"{field} must be a list", expected="a list",
                         found=value)
            return []
        return list(enumerate(value))

    def string_list(self, value: Any, path: Path, what: str,
                    example: str) -> list[tuple[int, str]]:
        """The indexed non-empty strings of a non-empty list; a problem for every other entry."""
        if not isinstance(value, list | tuple) or not value:
            self.problem(path, f"{what} must be a non-empty list", expected=example, found=value)
            return []
        good = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item:
                good.append((i, item))
            else:
                self.problem((*path, i), f"an entry of {what} must be a non-empty string",
                             expected=example, found=item)
        return good
