"""Canonical serialization: the same data always becomes the same bytes.

Digests, Git trees, ETags and bundles are computed over serialized documents, so the
serializers here are deterministic by construction:

* `canonical_json`: RFC 8785 (JCS) style — keys sorted by UTF-16 code units, no
  whitespace, ECMAScript number formatting, UTF-8. Integers are printed exactly even past
  2^53 (manifest versions are uint64), which is the one deliberate deviation from JCS.
* `pretty_json`: sorted keys, two-space indent, trailing newline — for files people read.
* `canonical_yaml`: block style, two-space indent, keys in the order given (documents are
  built in a fixed field order; free-form maps are sorted by `sorted_tree`), one line per
  scalar, and any string that a YAML 1.1 *or* 1.2 reader could take for another type is
  double-quoted. `serialize(parse(serialize(x)))` is byte-identical. A small emitter of our
  own (rather than PyYAML's) because it is ~10x faster and its output is easy to specify.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from functools import lru_cache
from typing import Any

import yaml

from margo.loading import load_document, resolve_plain_scalar

__all__ = ["Cached", "Slot", "YamlTemplate", "canonical_json", "canonical_yaml",
           "format_number", "pretty_json", "sorted_tree", "yaml_template"]


def format_number(value: int | float) -> str:
    """ECMAScript Number::toString for floats (as JCS requires); exact for integers."""
    if isinstance(value, bool):
        raise TypeError("booleans are not numbers")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"{value!r} cannot be represented in JSON")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    digits_tuple = Decimal(repr(abs(value))).as_tuple()
    digits = "".join(map(str, digits_tuple.digits)).rstrip("0") or "0"
    exponent = int(digits_tuple.exponent)
    # value == 0.digits * 10**n  with n = number of integer digits
    n = len("".join(map(str, digits_tuple.digits))) + exponent
    k = len(digits)
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        text = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + text


def _jcs(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, (int, float)):
        out.append(format_number(value))
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, dict):
        out.append("{")
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        for index, key in enumerate(keys):
            if not isinstance(key, str):
                raise TypeError(f"object keys must be strings, found {key!r}")
            if index:
                out.append(",")
            out.append(json.dumps(key, ensure_ascii=False))
            out.append(":")
            _jcs(value[key], out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _jcs(item, out)
        out.append("]")
    else:
        raise TypeError(f"cannot serialize {type(value).__name__} as JSON")


def canonical_json(value: Any) -> bytes:
    """JCS-style canonical JSON bytes (for digests, ETags and signatures)."""
    out: list[str] = []
    _jcs(value, out)
    return "".join(out).encode("utf-8")


def pretty_json(value: Any) -> str:
    """Stable, readable JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def sorted_tree(value: Any) -> Any:
    """A copy of `value` with every mapping's keys sorted (for free-form user maps)."""
    if isinstance(value, dict):
        return {key: sorted_tree(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [sorted_tree(item) for item in value]
    return value


_PLAIN_CANDIDATE = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./@+~:=, -]*\Z")
_NEEDS_ESCAPE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff\ud800-\udfff]")
_YAML11 = yaml.resolver.Resolver()


#: Lower-case hyphenated UUIDs: never anything but a string to a YAML 1.1 or 1.2 reader (no
#: dot, colon or leading sign; hyphens only between digit groups, never a date's 4-2-2), so
#: plain. Deployment ids are one per (intent, device): checked here rather than filling the
#: cache below with strings seen once.
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def _yaml_string(text: str) -> str:
    """A string as a YAML scalar (see `_yaml_string_slow`)."""
    if _UUID.match(text):
        return text
    return _yaml_string_slow(text)


@lru_cache(maxsize=65536)
def _yaml_string_slow(text: str) -> str:
    """A string as a YAML scalar: plain when no YAML 1.1 or 1.2 reader could mistake it for
    anything else, double-quoted (JSON escapes, valid YAML) otherwise."""
    if (
        _PLAIN_CANDIDATE.match(text)
        and not text.endswith((" ", ":", ","))
        and ": " not in text
        and not text.startswith(("...", "---"))
        and isinstance(resolve_plain_scalar_safe(text), str)
        and _YAML11.resolve(  # type: ignore[no-untyped-call]
            yaml.ScalarNode, text, (True, False)) == "tag:yaml.org,2002:str"
    ):
        return text
    quoted = json.dumps(text, ensure_ascii=False)
    return _NEEDS_ESCAPE.sub(lambda m: f"\\u{ord(m.group()):04x}", quoted)


def resolve_plain_scalar_safe(text: str) -> Any:
    try:
        return resolve_plain_scalar(text)
    except ValueError:  # .nan / .inf: not a string either
        return None


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be represented in JSON-compatible YAML")
        # YAML 1.1 readers (PyYAML) need a "." in the mantissa to see a float.
        mantissa, e, exponent = repr(value).partition("e")
        if "." not in mantissa:
            mantissa += ".0"
        return mantissa + e + exponent
    if isinstance(value, str):
        return _yaml_string(value)
    raise TypeError(f"cannot serialize {type(value).__name__} as YAML")


class Cached(dict):  # type: ignore[type-arg]
    """A mapping whose YAML text is memoised under `key` (per indentation).

    For documents that repeat a large identical section (every device's deployment of one
    application profile): the text is produced by the same emitter the first time and
    reused after, so the output is byte-identical to serializing it afresh. `key` must
    identify the content (e.g. a digest of its source).
    """

    __slots__ = ("key",)

    def __init__(self, key: Any, content: dict[str, Any]):
        super().__init__(content)
        self.key = key


_FRAGMENTS: dict[tuple[Any, str], list[str]] = {}
_FRAGMENT_LIMIT = 4096


def _emit_cached(value: Cached, indent: str, out: list[str]) -> None:
    key = (value.key, indent)
    lines = _FRAGMENTS.get(key)
    if lines is None:
        lines = []
        _emit(dict(value), indent, lines)
        if len(_FRAGMENTS) >= _FRAGMENT_LIMIT:
            _FRAGMENTS.clear()
        _FRAGMENTS[key] = lines
    out.extend(lines)


def _emit(value: Any, indent: str, out: list[str]) -> None:
    """Append the block-style lines of a non-empty collection at `indent`."""
    if type(value) is Cached:
        _emit_cached(value, indent, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"mapping keys must be strings, found {key!r}")
            head = f"{indent}{_yaml_string(key)}:"
            if isinstance(item, (dict, list, tuple)) and item:
                out.append(head + "\n")
                _emit(item, indent + "  ", out)
            elif type(item) is Slot:
                out.extend((head + " ", item, "\n"))  # type: ignore[arg-type]  # a Slot
            else:
                out.append(f"{head} {_inline(item)}\n")
    else:
        for item in value:
            if isinstance(item, (dict, list, tuple)) and item:
                # The first line of a nested collection shares the "- " line.
                nested: list[str] = []
                _emit(item, indent + "  ", nested)
                out.append(f"{indent}- {nested[0][len(indent) + 2:]}")
                out.extend(nested[1:])
            elif type(item) is Slot:
                out.extend((f"{indent}- ", item, "\n"))  # type: ignore[arg-type]  # a Slot
            else:
                out.append(f"{indent}- {_inline(item)}\n")


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _yaml_scalar(value)


def canonical_yaml(value: Any) -> bytes:
    """Deterministic block-style YAML bytes, ending in exactly one newline.

    Mappings keep the given key order; sequences are indented under their key; strings are
    plain unless that could change their type in a YAML 1.1 or 1.2 reader.
    """
    if isinstance(value, (dict, list, tuple)) and value:
        out: list[str] = []
        _emit(value, "", out)
        return "".join(out).encode("utf-8")
    return (_inline(value) + "\n").encode("utf-8")


class Slot:
    """A string scalar left open in a `yaml_template`, named so `YamlTemplate.fill` can
    give it a value."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class YamlTemplate:
    """The canonical YAML of a document with some string scalars left open.

    For thousands of documents that differ only in a few strings (one application's
    deployment to every device differs in its id and device id): the document is
    serialized once, and each fill formats only the open strings. A string scalar's text
    does not depend on where it stands, so a fill is byte-identical to `canonical_yaml` of
    the document with those strings in place.
    """

    __slots__ = ("_parts", "slots")

    def __init__(self, lines: list[str | Slot]):
        parts: list[bytes | str] = []
        text: list[str] = []
        for line in lines:
            if type(line) is Slot:
                parts.append("".join(text).encode("utf-8"))
                parts.append(line.name)
                text = []
            else:
                text.append(line)  # type: ignore[arg-type]
        parts.append("".join(text).encode("utf-8"))
        self._parts = tuple(parts)  # static bytes at even positions, slot names at odd ones
        self.slots = tuple(parts[1::2])

    def fill(self, values: dict[str, str]) -> bytes:
        """The document's bytes with every slot given its value (a string)."""
        parts = self._parts
        out = [parts[0]]
        for index in range(1, len(parts), 2):
            value = values[parts[index]]  # type: ignore[index]
            if not isinstance(value, str):
                raise TypeError(f"slot {parts[index]!r} needs a string, found {value!r}")
            out.append(_yaml_string(value).encode("utf-8"))
            out.append(parts[index + 1])
        return b"".join(out)  # type: ignore[arg-type]


def yaml_template(value: dict[str, Any] | list[Any]) -> YamlTemplate:
    """A `YamlTemplate` of a non-empty collection in which some scalars are `Slot`s."""
    if not isinstance(value, (dict, list, tuple)) or not value:
        raise TypeError("a YAML template needs a non-empty mapping or sequence")
    lines: list[Any] = []
    _emit(value, "", lines)
    return YamlTemplate(lines)


def parse_canonical_yaml(data: bytes) -> Any:
    """Inverse of `canonical_yaml` (through the safe loader), for round-trip checks."""
    return load_document(data).value
