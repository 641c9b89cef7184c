"""The words every dialect of deviceConstraints shares: the operators, our extension keys, the
sentinel for a key a device does not have, and the shapes of a lookup and a test.

Field names belong to the dialect that reads them (capacity, rules, cluster, ...); only what
more than one dialect needs lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = [
    "ARCHITECTURE_ALIASES",
    "CLUSTER_SECTIONS",
    "CONTAINS_OPERATORS",
    "DEVICE_CHARACTERISTIC",
    "DRAFT_OPERATORS",
    "EMPTY",
    "EXTENSION",
    "MISSING",
    "OPERATORS",
    "Lookup",
    "Test",
]

#: The matchExpression operators the spec defines (case-sensitive).
OPERATORS: Final = frozenset(
    {"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt", "ContainsAll", "ContainsAny"}
)
#: Operators of the schema-agnostic matching draft. Standard rc.3 selectors keep the spec's
#: set (a document using them would not be portable); our extensions accept both.
DRAFT_OPERATORS: Final = frozenset({"GtEq", "LtEq"})
#: The operators that test the elements of a list against item expressions.
CONTAINS_OPERATORS: Final = frozenset({"ContainsAll", "ContainsAny"})
#: Our extension key, in deviceConstraints (requirements) and in capabilities (reports).
EXTENSION: Final = "x-margo-gitops-extensions"
#: Cluster body sections a propertySelector pointer reaches at the root of the matching view.
CLUSTER_SECTIONS: Final = ("metadata", "apiSurface", "resources", "capabilities")
#: The characteristic key under which the draft form sees the whole matching view.
DEVICE_CHARACTERISTIC: Final = "margo-gitops.dev/capabilities"
#: Architecture spellings that mean the same placement target, normalised on both sides.
ARCHITECTURE_ALIASES: Final[Mapping[str, str]] = {"x86_64": "amd64", "aarch64": "arm64"}


class _Missing:
    """The value of a key the device does not have (distinct from a present `null`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


#: What a lookup returns for a key the device does not have.
MISSING: Final = _Missing()
#: The properties or labels of a device that reported none.
EMPTY: Final[Mapping[str, Any]] = {}

Lookup = Callable[[Any], Any]
Test = Callable[[Any], bool]
