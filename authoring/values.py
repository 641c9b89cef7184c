"""Which value paths a Helm chart defines: in its `values.yaml` (`values_define`) or its
`values.schema.json` (`schema_allows`), and the key next to a missing one
(`suggest_key`). Pure functions over the parsed files, for `authoring.chartlint`'s check
that every parameter pointer of an application names a value the chart reads.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["as_list", "dig", "schema_allows", "suggest_key", "values_define"]


def dig(node: Any, *keys: str) -> Any:
    """`node[k1][k2]...`, or None when any step is missing or not a mapping."""
    for key in keys:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def as_list(value: Any) -> list[Any]:
    """`value` when it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def values_define(values: Any, path: tuple[str | int, ...]) -> bool:
    """Does values.yaml define `path`? Below a key whose default is null or an empty map or
    list (`resources: {}`, `nodeSelector: {}`), anything is allowed: that is how charts
    declare free-form settings."""
    node = values
    for depth, part in enumerate(path):
        if depth and (node is None or node == {} or node == []):
            return True
        if isinstance(part, int):
            if not isinstance(node, list) or not node:
                return False
            node = node[part] if part < len(node) else node[0]
        else:
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
    return True


def _resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """Follow local `$ref`s (`#/definitions/x`, `#/$defs/x`), a bounded number of times."""
    for _ in range(32):
        ref = schema.get("$ref") if isinstance(schema, Mapping) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            node = dig(node, part.replace("~1", "/").replace("~0", "~"))
        schema = node
    return schema


def _schema_children(schema: Mapping[str, Any], part: str | int) -> list[Any]:
    """Subschemas that explicitly allow `part` below `schema`."""
    if isinstance(part, int):
        items = schema.get("items")
        prefix = as_list(schema.get("prefixItems"))
        return [prefix[part]] if part < len(prefix) else [items] if items is not None else []
    out = []
    properties = schema.get("properties")
    if isinstance(properties, Mapping) and part in properties:
        out.append(properties[part])
    patterns = schema.get("patternProperties")
    if isinstance(patterns, Mapping):
        out.extend(sub for pattern, sub in patterns.items() if _matches(pattern, part))
    additional = schema.get("additionalProperties")
    if isinstance(additional, Mapping) or additional is True:
        out.append(additional)
    return out


def _matches(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def schema_allows(schema: Any, path: tuple[str | int, ...], root: Mapping[str, Any] | None = None,
                  depth: int = 0) -> bool:
    """Does values.schema.json explicitly allow `path` (properties, patternProperties, an
    additionalProperties schema, items)? A schema that merely omits `additionalProperties`
    does not count: otherwise every typo would pass."""
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if not path or schema is True:
        return True
    if not isinstance(schema, Mapping) or depth > 64:
        return False
    branches = [schema] + [b for key in ("allOf", "anyOf", "oneOf")
                           for b in as_list(schema.get(key))]
    for branch in branches:
        branch = _resolve(branch, root)
        if not isinstance(branch, Mapping):
            continue
        for child in _schema_children(branch, path[0]):
            if schema_allows(child, path[1:], root, depth + 1):
                return True
    return False


def suggest_key(values: Any, path: tuple[str | int, ...]) -> str:
    """` (did you mean 'a.b'?)` from the keys next to the one that is missing."""
    node = values
    for part in path[:-1]:
        if isinstance(part, int) and isinstance(node, list) and node:
            node = node[min(part, len(node) - 1)]
        elif isinstance(part, str) and isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            break
    last = path[-1]
    if not isinstance(node, Mapping) or not isinstance(last, str):
        return ""
    close = difflib.get_close_matches(last, [str(k) for k in node], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
