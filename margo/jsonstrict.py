"""One strict JSON parser for everything that arrives over the network (request bodies on
the fleet server, manifests on the device).

Python's `json.loads` accepts more than RFC 8259 JSON, and the extras do harm later rather
than at the door: `NaN`, `Infinity` and `-Infinity` literals, and numbers such as `1e999`
that overflow to an infinite float, are stored, then every response that serializes them
(`allow_nan=False`) fails with a 500. So this parser refuses, with a sentence naming the
problem:

- the non-finite literals (`NaN`, `Infinity`, `-Infinity`) and any number whose value is
  not a finite double (`1e999`, `-1e400`); numbers that underflow (`1e-999`) become 0.0,
  which is finite and what every JSON parser does;
- integers of more than :data:`MAX_INTEGER_DIGITS` digits: every accepted integer then
  converts to a finite double wherever a float is needed, and the decimal conversion of a
  huge literal costs nothing noticeable (Python's own limit, 4300 digits, is far above);
- duplicate object keys: RFC 8259 leaves their meaning to the parser, so a signature or
  HMAC checked over the bytes could vouch for a value other than the one we would keep;
- text that is not UTF-8 (RFC 8259 §8.1; a leading byte order mark is ignored, as the RFC
  allows), and nesting too deep for the decoder;
- lone surrogate escapes (`"\\ud800"`, a `\\udc00` without its high half): Python's parser
  takes them, but the string is no Unicode text (RFC 8259 §8.2, RFC 7493 §2.1) and cannot
  be encoded as UTF-8, so the first digest, database row or response holding it failed
  with a 500. A pair (`"\\ud83d\\ude00"`) is one character and accepted.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["MAX_INTEGER_DIGITS", "JsonRefused", "loads"]

#: The most digits an integer literal may have: 308 keeps every integer below 10**308, so
#: converting one to a float never overflows (the largest double is about 1.8e308).
MAX_INTEGER_DIGITS = 308

_BOM = b"\xef\xbb\xbf"


class JsonRefused(ValueError):
    """A JSON text this parser refuses; the message says what is wrong and, where the
    decoder knows it, where. `reason` says the same without quoting the text (no number,
    no key), for receivers whose messages must not echo the body (`wfm.webhooks`)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def _refuse_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a number JSON allows (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise JsonRefused(f"the number {shown} is too large to be a finite double",
                          "a number too large to be a finite double")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INTEGER_DIGITS:
        raise JsonRefused(f"an integer of {digits} digits (at most {MAX_INTEGER_DIGITS} are "
                          "accepted)")
    return int(text)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            shown = key if len(key) <= 60 else key[:57] + "..."
            raise JsonRefused(f"duplicate object key {shown!r}", "a duplicate object key")
        out[key] = value
    return out


#: One decoder, built once (`json.loads` with hooks builds one per call).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float,
                            parse_int=_bounded_int, object_pairs_hook=_unique_pairs)


#: One escape of a JSON string: `\uXXXX` (its code unit in group 1) or `\` and one
#: character. Matched left to right, an escaped backslash is consumed whole: `\\ud800`
#: is a backslash and five letters, not an escape.
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(text: str) -> tuple[int, int] | None:
    """The offset and code unit of the first surrogate that is not half of a pair."""
    raw = _SURROGATE.search(text)  # only a str handed in can hold one unescaped
    if raw is not None:
        return raw.start(), ord(raw.group())
    if "\\u" not in text:
        return None
    high: tuple[int, int] | None = None  # a high surrogate waiting for its low half
    end = -1
    for match in _ESCAPE.finditer(text):
        unit = int(match.group(1), 16) if match.group(1) else -1
        if high is not None:
            if match.start() == end and 0xDC00 <= unit <= 0xDFFF:
                high = None
                continue
            return high
        if 0xD800 <= unit <= 0xDBFF:
            high, end = (match.start(), unit), match.end()
        elif 0xDC00 <= unit <= 0xDFFF:
            return match.start(), unit
    return high


def _refuse_lone_surrogates(text: str) -> None:
    found = _lone_surrogate(text)
    if found is not None:
        at, unit = found
        line = text.count("\n", 0, at) + 1
        column = at - text.rfind("\n", 0, at)
        raise JsonRefused(f"a lone surrogate \\u{unit:04x} at line {line} column {column}: "
                          "strings must be Unicode text", "a lone surrogate in a string")


def loads(data: bytes | bytearray | str) -> Any:
    """Parse one RFC 8259 JSON text strictly (see the module docstring), or raise
    :class:`JsonRefused` with a message fit to show the sender."""
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
        if raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonRefused(f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset "
                              f"{exc.start}") from None
    else:
        text = data
    _refuse_lone_surrogates(text)
    try:
        return _DECODER.decode(text)
    except JsonRefused:
        raise
    except RecursionError:
        raise JsonRefused("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError:  # e.g. int() past Python's own digit limit (not reached: bounded)
        raise JsonRefused("a value Python cannot parse") from None
