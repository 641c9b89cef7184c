"""Where each member of a JSON object lies in its text, without decoding the members into
one value: what lets a keyed capability file the compiler's state trusts be read device by
device (`compiler.snapshot.LazyDevices`), and a memo remember each device's span."""

from __future__ import annotations

import json
import re

__all__ = ["json_text", "member_spans"]


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
