"""Exported JSON Schemas for every Margo document kind and spec shape, and their validators.

The `.schema.json` files beside this module are generated from `source.py` (run
`python -m margo.schemas`) and shipped so that other tools can validate Margo documents
without importing this package.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

import fastjsonschema
from jsonschema import Draft202012Validator

from margo.schemas.source import BUILDERS, file_name

__all__ = ["KINDS_AND_SHAPES", "fast_check_for", "hot_gate", "load_schema", "python_patterns",
           "shown_pattern", "validator_for"]

#: Every (kind, shape) pair that has an exported schema, oldest shape first per kind.
KINDS_AND_SHAPES: tuple[tuple[str, str], ...] = tuple(BUILDERS)


@cache
def load_schema(kind: str, shape: str) -> dict[str, Any]:
    """The exported schema document (read from the shipped JSON file)."""
    text = resources.files(__package__).joinpath(file_name(kind, shape)).read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


# An end anchor not escaped: what fastjsonschema also rewrites to ``\Z``.
_DOLLAR = re.compile(r"(?<!\\)\$")


def python_patterns(schema: Any) -> Any:
    """A copy of `schema` whose ``pattern`` values and ``patternProperties`` keys mean in
    Python's `re` what they mean in ECMA-262, the regex dialect of JSON Schema.

    Why: ``$`` ends an ECMA pattern only at the end of the string, but Python's also before
    a final newline, so ``jsonschema`` (which searches with `re`) takes ``"demo\\n"`` as a
    valid ``^[a-z0-9-]+$`` name while the fastjsonschema gate rejects it. Every validator
    built here from a schema goes through this, so the explaining validator agrees with the
    gate and a trailing newline is an error in both.
    """
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                out[key] = _DOLLAR.sub(r"\\Z", value)
            elif key == "patternProperties" and isinstance(value, dict):
                out[key] = {_DOLLAR.sub(r"\\Z", k): python_patterns(v) for k, v in value.items()}
            else:
                out[key] = python_patterns(value)
        return out
    if isinstance(schema, list):
        return [python_patterns(item) for item in schema]
    return schema


def shown_pattern(pattern: str) -> str:
    """A pattern as its schema spells it (undoes `python_patterns`), for messages."""
    return pattern.replace("\\Z", "$")


@cache
def validator_for(kind: str, shape: str) -> Draft202012Validator:
    """A compiled validator with format checking (formats need jsonschema[format-nongpl])."""
    schema = python_patterns(load_schema(kind, shape))
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def _format_checker(name: str) -> Any:
    checker = Draft202012Validator.FORMAT_CHECKER
    return lambda value: checker.conforms(value, name)


@cache
def fast_check_for(kind: str, shape: str) -> Any:
    """A compiled yes/no check (fastjsonschema, ~20x faster) for the common valid case.

    It is only a gate: when it says no, `validator_for` produces the located problems, so
    messages never depend on it. `tests/margo/test_schemas.py` checks the two agree.
    """
    schema = dict(load_schema(kind, shape))
    # fastjsonschema speaks draft-07; the exported schemas use no keyword whose meaning
    # differs between draft-07 and 2020-12 (items is always a single schema, no prefixItems).
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    return fastjsonschema.compile(
        schema, formats={"uri-reference": _format_checker("uri-reference")})



#: A kind is "hot" once this many documents of it were validated within `HOT_WINDOW` seconds.
HOT_COUNT = 32
HOT_WINDOW = 60.0


class _Heat:
    """How many documents of one (kind, shape) this process validated in the current window."""

    __slots__ = ("count", "since")

    def __init__(self) -> None:
        self.count = 0
        self.since = time.monotonic()

    def warm(self) -> bool:
        """Count one more document; True once the window holds `HOT_COUNT` of them."""
        now = time.monotonic()
        if now - self.since > HOT_WINDOW:
            self.count, self.since = 0, now
        self.count += 1
        return self.count >= HOT_COUNT


_heat: dict[tuple[str, str], _Heat] = {}
_hot: set[tuple[str, str]] = set()


def hot_gate(kind: str, shape: str) -> Callable[[Any], Any] | None:
    """The compiled gate of `(kind, shape)` once this process validates that kind in bulk,
    None before (validate with `validator_for` alone).

    Why: compiling a gate costs 20 to 50 ms and its code stays resident (about 8 MiB for an
    rc.3 ApplicationDeployment, more than the interpreter's whole schema validator), which
    pays back only after some 50 documents (`validator_for` takes 0.1 to 1.7 ms a document,
    the gate 0.01 to 0.1 ms). A compiler, a fleet server under load or a bulk `margo validate`
    reaches `HOT_COUNT` documents within `HOT_WINDOW` seconds at once; a device validating
    its few deployments a cycle never does, and keeps the memory. Both checks accept and
    refuse the same documents (`tests/margo/test_schemas.py`), so no answer depends on heat.
    """
    key = (kind, shape)
    if key not in _hot:
        if not _heat.setdefault(key, _Heat()).warm():
            return None
        _hot.add(key)
    gate: Callable[[Any], Any] = fast_check_for(kind, shape)
    return gate
