"""The words of deviceConstraints: operators, field names, extension keys, and the sentinel
for a key a device does not have.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = [
    "ARCHITECTURE_ALIASES",
    "CLUSTER_SECTIONS",
    "DEVICE_CHARACTERISTIC",
    "DRAFT_OPERATORS",
    "EXTENSION",
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
_EXTENDED_OPERATORS: Final = OPERATORS | DRAFT_OPERATORS
#: Our extension key, in deviceConstraints (requirements) and in capabilities (reports).
EXTENSION: Final = "x-margo-gitops-extensions"
#: Cluster body sections a propertySelector pointer reaches at the root of the matching view.
CLUSTER_SECTIONS: Final = ("metadata", "apiSurface", "resources", "capabilities")
#: The characteristic key under which the draft form sees the whole matching view.
DEVICE_CHARACTERISTIC: Final = "margo-gitops.dev/capabilities"
#: Architecture spellings that mean the same placement target, normalised on both sides.
ARCHITECTURE_ALIASES: Final[Mapping[str, str]] = {"x86_64": "amd64", "aarch64": "arm64"}

_EXTENSION_KEY = re.compile(r"x-[a-z][a-z0-9-]*-extensions")
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
_BAD_ESCAPE = re.compile(r"~(?![01])")

_DEVICE_CONSTRAINT_FIELDS = ("capacityRequirements", "eligibilityRules")
_CAPACITY_FIELDS = ("cpu", "memory", "storage")
_CPU_FIELDS = ("cores", "architectures")
_RULE_FIELDS = ("propertySelector", "labelSelector")
_SELECTOR_FIELDS = ("matchExpressions",)
_EXPRESSION_FIELDS = ("key", "operator", "values", "itemSelector")
_LEGACY_FIELDS = ("cpu", "memory", "storage", "peripherals", "interfaces")
_PERIPHERAL_FIELDS = ("type", "manufacturer", "model")
_INTERFACE_FIELDS = ("type",)

_EXTENSION_FIELDS = ("cluster", "deviceCharacteristics")
_CLUSTER_FIELDS = ("nodes", "kubernetesVersion", "apiGroups", "customResourceDefinitions",
                   "defaultStorageClass")
_NODE_FIELDS = ("count", "capacity", "selector")
_NODE_CAPACITY_FIELDS = ("cpu", "memory", "ephemeralStorage", "resources")
_CHARACTERISTIC_RULE_FIELDS = ("matchExpressions",)
_CHARACTERISTIC_FIELDS = ("key", "property", "operator", "values", "itemSelector")

_VALUE_OPERATORS = frozenset({"In", "NotIn"})
_BOUND_OPERATORS = frozenset({"Gt", "Lt", "GtEq", "LtEq"})
_PRESENCE_OPERATORS = frozenset({"Exists", "DoesNotExist"})
_CONTAINS_OPERATORS = frozenset({"ContainsAll", "ContainsAny"})


class _Missing:
    """The value of a key the device does not have (distinct from a present `null`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Final = _Missing()
_EMPTY: Final[Mapping[str, Any]] = {}

Lookup = Callable[[Any], Any]
Test = Callable[[Any], bool]
