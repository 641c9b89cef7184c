"""JSON Pointers into a device report, label lookups, and the matching view every evaluation
reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from margo.constraints.vocabulary import CLUSTER_SECTIONS, EXTENSION, MISSING, Lookup

__all__ = ["cluster_of", "identity", "is_object", "label_lookup", "matching_view", "member",
           "parse_pointer", "pointer_lookup"]

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
_BAD_ESCAPE = re.compile(r"~(?![01])")


def parse_pointer(text: str) -> tuple[str, ...]:
    """Split an RFC 6901 JSON Pointer into unescaped reference tokens (`""` is the whole doc).

    Raises `ValueError` for a pointer that does not start with `/` or has a `~` escape other
    than `~0` / `~1`.
    """
    if text == "":
        return ()
    if not text.startswith("/"):
        raise ValueError(f"a JSON Pointer is empty or starts with '/', found {text!r}")
    tokens: list[str] = []
    for raw in text[1:].split("/"):
        if _BAD_ESCAPE.search(raw):
            raise ValueError(f"'~' must be followed by 0 or 1 in a JSON Pointer, found {text!r}")
        tokens.append(raw.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


def _step(doc: Any, key: str, index: int | None) -> Any:
    """Follow one reference token; anything that does not lead anywhere is `MISSING`."""
    if isinstance(doc, dict):
        return doc.get(key, MISSING)
    if isinstance(doc, list | tuple):
        return doc[index] if index is not None and index < len(doc) else MISSING
    if isinstance(doc, Mapping):
        return doc.get(key, MISSING)
    return MISSING


def identity(doc: Any) -> Any:
    """The lookup of the empty pointer: the whole document."""
    return doc


def pointer_lookup(tokens: tuple[str, ...]) -> Lookup:
    """A resolver for pre-split tokens, with array indices decided at compile time."""
    steps = tuple((t, int(t) if _ARRAY_INDEX.fullmatch(t) else None) for t in tokens)
    if not steps:
        return identity
    if len(steps) == 1:
        ((key, index),) = steps

        def lookup_one(doc: Any) -> Any:
            if isinstance(doc, dict):
                return doc.get(key, MISSING)
            return _step(doc, key, index)

        return lookup_one

    def lookup(doc: Any) -> Any:
        for key, index in steps:
            doc = _step(doc, key, index)
        return doc

    return lookup


def label_lookup(key: str) -> Lookup:
    """A resolver for one label key."""
    def lookup(labels: Any) -> Any:
        return labels.get(key, MISSING)

    return lookup


# --------------------------------------------------------------------------- matching view


def member(doc: Any, key: str) -> Any:
    """doc[key] for a JSON object, else `MISSING`; plain dicts (every parsed document) skip
    the slow ABC isinstance check, which dominates cluster checks otherwise."""
    if type(doc) is dict or isinstance(doc, Mapping):
        return doc.get(key, MISSING)
    return MISSING


def is_object(value: Any) -> bool:
    """A JSON object, with the fast path for plain dicts."""
    return type(value) is dict or isinstance(value, Mapping)


def cluster_of(view: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Kubernetes cluster body a device reported (`x-margo-gitops-extensions.cluster`)."""
    cluster = member(member(view, EXTENSION), "cluster")
    return cluster if is_object(cluster) else None


def matching_view(properties: Mapping[str, Any],
                  extensions: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """What propertySelector pointers resolve against: `properties`, plus the document's root
    `x-...-extensions` keys, plus the cluster body's top-level sections.

    Matching stays schema-agnostic: a pointer reaches whatever the device reported, so a new
    capability needs no code change (`/apiSurface/customResourceDefinitions` and
    `/x-margo-gitops-extensions/cluster/apiSurface/customResourceDefinitions` both resolve).
    The keys cannot collide: rc.3 `properties` is a closed set of names, extension keys all
    start with `x-`, and `CLUSTER_SECTIONS` is none of either; `properties` wins regardless.
    A device without extensions gets `properties` itself (no copy).
    """
    if not extensions:
        return properties
    view = {**extensions, **properties}
    cluster = cluster_of(extensions)
    if cluster is not None:
        for section in CLUSTER_SECTIONS:
            if section in cluster:
                view.setdefault(section, cluster[section])
    return view
