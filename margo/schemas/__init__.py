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

from jsonschema import Draft202012Validator

from margo.schemas.source import BUILDERS, file_name

__all__ = ["KINDS_AND_SHAPES", "load_schema", "validator_for"]

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
