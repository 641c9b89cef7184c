"""Canonical serialization: the same data always becomes the same bytes.

Digests, Git trees, ETags and bundles are computed over serialized documents, so the
serializers here are deterministic by construction:

* `canonical_json`: RFC 8785 (JCS) style — keys sorted by UTF-16 code units, no
  whitespace, ECMAScript number formatting, UTF-8. Integers are printed exactly even past
  2^53 (manifest versions are uint64), which is the one deliberate deviation from JCS.
* `pretty_json`: sorted keys, two-space indent, trailing newline — for files people read.
* `canonical_yaml`: block style, two-space indent, keys in the order given (documents are
  built in a fixed field order; free-form maps are sorted by `sorted_tree`), no line
  folding, and any string that a YAML 1.1 *or* 1.2 reader would take for another type is
  quoted. `serialize(parse(serialize(x)))` is byte-identical.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

import yaml

from margo.loading import load_document

__all__ = ["canonical_json", "canonical_yaml", "format_number", "pretty_json", "sorted_tree"]


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


_BaseDumper: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _CanonicalDumper(_BaseDumper):  # type: ignore[misc,valid-type]
    """SafeDumper that also quotes strings a YAML 1.2 core-schema reader would retype."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


# Plain scalars matching any of these are quoted on output (YAML 1.2 core additions to the
# 1.1 resolvers PyYAML already applies).
_CanonicalDumper.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"))
_CanonicalDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


def _represent_float(dumper: yaml.SafeDumper, value: float) -> yaml.ScalarNode:
    if not math.isfinite(value):
        raise ValueError(f"{value!r} cannot be represented in JSON-compatible YAML")
    text = repr(value)
    if "." not in text and "e" not in text:
        text += ".0"
    return dumper.represent_scalar("tag:yaml.org,2002:float", text)


_CanonicalDumper.add_representer(float, _represent_float)


def canonical_yaml(value: Any) -> bytes:
    """Deterministic block-style YAML bytes, ending in exactly one newline."""
    text = yaml.dump(
        value,
        Dumper=_CanonicalDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        indent=2,
        width=1_000_000,
        explicit_start=False,
    )
    return text.encode("utf-8")


def parse_canonical_yaml(data: bytes) -> Any:
    """Inverse of `canonical_yaml` (through the safe loader), for round-trip checks."""
    return load_document(data).value
