"""Where each member of a JSON object lies in its text, without decoding the members into
one value: what lets a keyed capability file be read device by device, each document
decoded and checked on its own and located in the whole file (`compiler.snapshot`), the
documents of one the compiler's state trusts only when used (`LazyDevices`), and a memo
remember each device's span."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Mapping
from typing import Any

from margo.loading import Limits, SourceMap, strict_json_value

__all__ = ["Lines", "MemberPositions", "MemberRefused", "json_text", "member_spans",
           "member_value", "members_of"]


def json_text(data: bytes) -> str:
    """The text of JSON bytes (UTF-8, a byte order mark dropped)."""
    return data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def member_spans(text: str) -> dict[str, tuple[int, int]] | None:
    """(start, end) of each member's value of the JSON object that is the whole `text`;
    None if it is not one (ValueError for malformed JSON inside)."""
    decoder = json.JSONDecoder()
    position = _JSON_SPACE.match(text).end()  # type: ignore[union-attr]
    if text[position:position + 1] != "{":
        return None
    position = _JSON_SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
    spans: dict[str, tuple[int, int]] = {}
    if text[position:position + 1] == "}":
        return spans if not text[position + 1:].strip(" \t\n\r") else None
    while True:
        if text[position:position + 1] != '"':
            return None
        name, position = json.decoder.scanstring(  # type: ignore[attr-defined]
            text, position + 1)
        position = _JSON_SPACE.match(text, position).end()  # type: ignore[union-attr]
        if text[position:position + 1] != ":" or name in spans:
            return None
        start = _JSON_SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
        _, end = decoder.raw_decode(text, start)
        spans[name] = (start, end)
        position = _JSON_SPACE.match(text, end).end()  # type: ignore[union-attr]
        separator = text[position:position + 1]
        if separator == "}":
            return spans if not text[position + 1:].strip(" \t\n\r") else None
        if separator != ",":
            return None
        position = _JSON_SPACE.match(text, position + 1).end()  # type: ignore[union-attr]


class MemberRefused(ValueError):
    """A member that fails a check the whole document would fail (`member_value`): read
    the whole the ordinary way, which locates the fault."""


def members_of(data: bytes, limits: Limits,
               spans: Mapping[str, tuple[int, int]] | None = None,
               ) -> tuple[str, Mapping[str, tuple[int, int]]] | None:
    """The text of a JSON object's bytes and where each member's value lies in it (`spans`
    when already known for these exact bytes); None for bytes that `margo.loading` must
    read whole to refuse or locate (over `limits`, not UTF-8, a NUL, not one JSON object,
    malformed, a duplicate key at the top)."""
    if len(data) > limits.max_bytes:
        return None
    try:
        text = json_text(data)
        if "\x00" in text:
            return None
        found = spans if spans is not None else member_spans(text)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    return None if found is None else (text, found)


def member_value(text: str, span: tuple[int, int], limits: Limits) -> Any:
    """One member's value, decoded and checked as the whole object's decoding checks it
    (`margo.loading.strict_json_value`; its depth counted from the object's)."""
    start, end = span
    try:
        return strict_json_value(text[start:end], max_depth=limits.max_depth - 1)
    except ValueError as exc:
        raise MemberRefused(str(exc)) from None


class Lines:
    """Line and column of offsets in one large text, each counted from the nearest offset
    counted before. Why: a keyed file with many broken documents is then counted through
    about once, where counting from its start for each document would be quadratic."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._offsets = [0]  # sorted; with the line and the offset that line starts at
        self._found = [(1, 0)]

    def at(self, offset: int) -> tuple[int, int]:
        """(line, column), both 1-based, of the character at `offset`."""
        index = bisect.bisect_right(self._offsets, offset) - 1
        base = self._offsets[index]
        line, line_start = self._found[index]
        newlines = self._text.count("\n", base, offset)
        if newlines:
            line, line_start = line + newlines, self._text.rfind("\n", base, offset) + 1
        self._offsets.insert(index + 1, offset)
        self._found.insert(index + 1, (line, line_start))
        return line, offset - line_start + 1


class MemberPositions:
    """Where the parts of one member lie in the whole text: a source map of the member's
    own text (built on its first problem, never the whole file's), shifted to its start."""

    def __init__(self, lines: Lines, text: str, span: tuple[int, int]) -> None:
        self._lines, self._text, self._span = lines, text, span
        self._map: SourceMap | None = None

    def _shifted(self, position: tuple[int, int] | None) -> tuple[int, int] | None:
        if position is None:
            return None
        first_line, first_column = self._lines.at(self._span[0])
        line, column = position
        return (line + first_line - 1, column + first_column - 1 if line == 1 else column)

    def _source(self) -> SourceMap:
        if self._map is None:
            self._map = SourceMap(self._text[self._span[0]:self._span[1]])
        return self._map

    def value_position(self, path: tuple[Any, ...]) -> tuple[int, int] | None:
        return self._shifted(self._source().value_position(path))

    def key_position(self, path: tuple[Any, ...]) -> tuple[int, int] | None:
        return self._shifted(self._source().key_position(path))
