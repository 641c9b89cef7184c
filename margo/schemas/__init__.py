"""Exported JSON Schemas for every Margo document kind and spec shape, and their validators.

The `.schema.json` files beside this module are generated from `source.py` (run
`python -m margo.schemas`) and shipped so that other tools can validate Margo documents
without importing this package.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import fastjsonschema
from jsonschema import Draft202012Validator

from margo.schemas.source import BUILDERS, file_name

__all__ = ["KINDS_AND_SHAPES", "fast_check_for", "load_schema", "validator_for"]

#: Every (kind, shape) pair that has an exported schema, oldest shape first per kind.
KINDS_AND_SHAPES: tuple[tuple[str, str], ...] = tuple(BUILDERS)


@cache
def load_schema(kind: str, shape: str) -> dict[str, Any]:
    """The exported schema document (read from the shipped JSON file)."""
    text = resources.files(__package__).joinpath(file_name(kind, shape)).read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@cache
def validator_for(kind: str, shape: str) -> Draft202012Validator:
    """A compiled validator with format checking (formats need jsonschema[format-nongpl])."""
    schema = load_schema(kind, shape)
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
