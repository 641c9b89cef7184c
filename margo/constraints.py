"""Margo placement: does a device satisfy a profile's `deviceConstraints` — and if not, why?

The WFM asks this for every (profile, device) pair, and a device client asks it before every
deployment, so constraints are compiled once (JSON Pointers split, quantities parsed, value
lists turned into typed sets, every clause validated) and then evaluated against many devices
with no parsing or regex work at evaluate time.

Two things shape the design:

* A "no" must be actionable. Evaluation never stops at the first failing clause: every failing
  capacity requirement and every failing expression of every rule is reported as a `Failure`
  with the required and the actual value and a sentence ("needs 4Gi memory, has 3.5Gi").
* A mistake in a constraint must never silently widen matching. Unknown fields, unknown
  operators, malformed pointers, mixed-type value lists and unparsable quantities are
  compile errors (`DocumentError`, one located `Problem` per bad clause), and at evaluate time
  every doubtful comparison — a missing key, a string where a number was asked for, a list
  where a scalar was asked for — evaluates to "does not match".

Semantics follow the spec's deviceConstraints section (capacity, then OR across rules, AND
within a rule and within a selector) plus the older `requiredResources` block; `cpus` entries
are placement units and are never summed.

Two extensions live inside `deviceConstraints["x-margo-gitops-extensions"]`, where the spec
requires them to be copied verbatim to devices (docs/intents.md, "Requirements on Kubernetes
clusters"):

* `cluster`: node-aware requirements on a Kubernetes cluster ("2 nodes with >= 2 cores and 4Gi
  available", a Kubernetes version range, API groups, CRDs, a default storage class), read
  from the cluster body a device reports under its root `x-margo-gitops-extensions.cluster`.
  A device that reported no cluster fails every such requirement: absence never passes.
* `deviceCharacteristics`: the schema-agnostic matching DRAFT (key, optional property
  pointer, operators including `GtEq`/`LtEq`), evaluated by the same expressions and
  explained in the same words.

Every evaluation reads a device's *matching view* (`matching_view`): its `properties` with its
root `x-...-extensions` and its cluster sections (`metadata`, `apiSurface`, `resources`,
`capabilities`) merged in, so a propertySelector pointer reaches whatever the device reported.
Callers build the view once per device, not once per evaluation.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from operator import eq, ge, gt, le, lt
from typing import Any, Final

from margo.errors import DocumentError, Path, Problem, short_repr
from margo.quantity import format_quantity, parse_quantity

__all__ = [
    "ARCHITECTURE_ALIASES",
    "CLUSTER_SECTIONS",
    "DEVICE_CHARACTERISTIC",
    "DRAFT_OPERATORS",
    "EXTENSION",
    "OPERATORS",
    "CompiledConstraints",
    "Failure",
    "MatchResult",
    "cluster_of",
    "compile_constraints",
    "match",
    "matching_view",
    "parse_pointer",
    "parse_version_range",
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


# --------------------------------------------------------------------------- results


def _jsonable(value: Any) -> Any:
    """Tuples and mappings from callers become plain lists and dicts for `json.dumps`."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Decimal):
        return format(value, "f")
    return value


@dataclass(frozen=True, slots=True)
class Failure:
    """One unmet clause, with enough detail to fix either the device or the constraint."""

    stage: str
    key: str
    operator: str
    required: Any
    actual: Any
    rule: int | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "key": self.key,
            "operator": self.operator,
            "required": _jsonable(self.required),
            "actual": _jsonable(self.actual),
            "rule": self.rule,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The verdict; `failures` is empty exactly when `eligible` is true."""

    eligible: bool
    failures: tuple[Failure, ...]

    def to_json(self) -> dict[str, Any]:
        return {"eligible": self.eligible, "failures": [f.to_json() for f in self.failures]}


_ELIGIBLE: Final = MatchResult(True, ())


# --------------------------------------------------------------------------- rendering


def _render(value: Any) -> str:
    """JSON-ish text for messages: strings quoted, true/false/null, nested lists and objects."""
    if isinstance(value, bool) or value is None:
        return "true" if value is True else "false" if value is False else "null"
    if isinstance(value, str | int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return repr(value)


def _show(value: Any, limit: int = 120) -> str:
    text = _render(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    """The JSON type of a value, with an article, for type-mismatch hints."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "a list"
    return "an object" if isinstance(value, Mapping) else type(value).__name__


_PLURAL: Final[Mapping[str, str]] = {
    "a string": "strings",
    "a number": "numbers",
    "a boolean": "a boolean",
}


def _number(value: int | float) -> int | float:
    """2.0 cores reads as 2 in messages and JSON."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --------------------------------------------------------------------------- JSON Pointer


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
    """Follow one reference token; anything that does not lead anywhere is `_MISSING`."""
    if isinstance(doc, dict):
        return doc.get(key, _MISSING)
    if isinstance(doc, list | tuple):
        return doc[index] if index is not None and index < len(doc) else _MISSING
    if isinstance(doc, Mapping):
        return doc.get(key, _MISSING)
    return _MISSING


def _identity(doc: Any) -> Any:
    return doc


def _pointer_lookup(tokens: tuple[str, ...]) -> Lookup:
    """A resolver for pre-split tokens, with array indices decided at compile time."""
    steps = tuple((t, int(t) if _ARRAY_INDEX.fullmatch(t) else None) for t in tokens)
    if not steps:
        return _identity
    if len(steps) == 1:
        ((key, index),) = steps

        def lookup_one(doc: Any) -> Any:
            if isinstance(doc, dict):
                return doc.get(key, _MISSING)
            return _step(doc, key, index)

        return lookup_one

    def lookup(doc: Any) -> Any:
        for key, index in steps:
            doc = _step(doc, key, index)
        return doc

    return lookup


def _label_lookup(key: str) -> Lookup:
    def lookup(labels: Any) -> Any:
        return labels.get(key, _MISSING)

    return lookup


# --------------------------------------------------------------------------- matching view


def _get(doc: Any, key: str) -> Any:
    """doc[key] for a JSON object, else `_MISSING`; plain dicts (every parsed document) skip
    the slow ABC isinstance check, which dominates cluster checks otherwise."""
    if type(doc) is dict or isinstance(doc, Mapping):
        return doc.get(key, _MISSING)
    return _MISSING


def _is_object(value: Any) -> bool:
    return type(value) is dict or isinstance(value, Mapping)


def cluster_of(view: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Kubernetes cluster body a device reported (`x-margo-gitops-extensions.cluster`)."""
    cluster = _get(_get(view, EXTENSION), "cluster")
    return cluster if _is_object(cluster) else None


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


# --------------------------------------------------------------------------- operator tests


def _in_test(values: tuple[Any, ...]) -> Test:
    """Strictly typed membership: "1" is not 1 and true is not 1."""
    if isinstance(values[0], bool):
        flag = values[0]
        return lambda actual: actual is flag
    allowed = frozenset(values)
    if isinstance(values[0], str):
        return lambda actual: isinstance(actual, str) and actual in allowed
    return lambda actual: _is_number(actual) and actual in allowed


def _not_in_test(values: tuple[Any, ...]) -> Test:
    """Present scalar (string, number, boolean) equal to none of the values."""
    member = _in_test(values)
    return lambda actual: isinstance(actual, str | int | float) and not member(actual)


def _bound_test(operator: str, bound: int | float) -> Test:
    if operator == "Gt":
        return lambda actual: _is_number(actual) and actual > bound
    if operator == "GtEq":
        return lambda actual: _is_number(actual) and actual >= bound
    if operator == "LtEq":
        return lambda actual: _is_number(actual) and actual <= bound
    return lambda actual: _is_number(actual) and actual < bound


def _exists(actual: Any) -> bool:
    return actual is not _MISSING


def _does_not_exist(actual: Any) -> bool:
    return actual is _MISSING


def _contains_test(operator: str, items: tuple[_Expression, ...]) -> Test:
    """Some element of an array matches all (ContainsAll) / any (ContainsAny) item expression."""

    def contains_all(actual: Any) -> bool:
        if not isinstance(actual, list | tuple):
            return False
        for element in actual:
            for item in items:
                if not item.test(item.lookup(element)):
                    break
            else:
                return True
        return False

    def contains_any(actual: Any) -> bool:
        if not isinstance(actual, list | tuple):
            return False
        for element in actual:
            for item in items:
                if item.test(item.lookup(element)):
                    return True
        return False

    return contains_all if operator == "ContainsAll" else contains_any


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class _Expression:
    """A compiled matchExpression: where to look, what to test, and how to explain a miss."""

    key: str
    operator: str
    subject: str  # "/vendor" or "label 'example.com/gpu'"
    noun: str  # "property /vendor" or "label 'example.com/gpu'"
    lookup: Lookup
    test: Test
    values: tuple[Any, ...]
    required: Any
    text: str  # "/vendor In ['Acme']"

    def why_not(self, actual: Any) -> str:
        """Why `actual` fails this expression, as the second half of a sentence."""
        if actual is _MISSING:
            return f"the device has no {self.noun}"
        shown = f"the device has {_show(actual)}"
        if self.operator in _CONTAINS_OPERATORS:
            return self._why_not_contains(actual, shown)
        if self.operator == "DoesNotExist" or actual is None:
            return shown
        if isinstance(actual, list | tuple | Mapping):
            hint = "; ContainsAll/ContainsAny test lists" if isinstance(actual, list) else ""
            return f"{shown} ({_kind(actual)}, not a single value{hint})"
        if self.operator in _BOUND_OPERATORS and not _is_number(actual):
            return f"{shown} ({_kind(actual)}, not a number)"
        if self.operator == "In" and _kind(actual) != _kind(self.values[0]):
            return f"{shown} ({_kind(actual)}; the values are {_PLURAL[_kind(self.values[0])]})"
        return shown

    def _why_not_contains(self, actual: Any, shown: str) -> str:
        if not isinstance(actual, list | tuple):
            return f"{shown}, {_kind(actual)}, not a list"
        if not actual:
            return f"{shown}, an empty list"
        which = "all item expressions" if self.operator == "ContainsAll" else "any item expression"
        return f"no element of {_show(actual)} matches {which}"


# --------------------------------------------------------------------------- checks


@lru_cache(maxsize=4096)
def _parse_reported_text(text: str) -> Decimal | str:
    """Device quantities repeat across a fleet; parse each distinct string once."""
    try:
        return parse_quantity(text)
    except ValueError as exc:
        return str(exc)


def _reported_bytes(value: Any) -> Decimal | str:
    """A device-reported quantity as bytes, or the reason it is not one (never raises)."""
    if isinstance(value, str):
        return _parse_reported_text(value)
    try:
        return parse_quantity(value)
    except ValueError as exc:
        return str(exc)


@dataclass(frozen=True, slots=True)
class _CpuCheck:
    """Some single `cpus` entry has enough cores (and a listed architecture)."""

    stage: str
    cores: int | float
    architectures: tuple[str, ...] | None  # as written, for reports
    accepted: frozenset[str] | None  # normalised

    def _arch_ok(self, entry: Any) -> bool:
        if self.accepted is None:
            return True
        arch = entry.get("architecture") if isinstance(entry, Mapping) else None
        return isinstance(arch, str) and ARCHITECTURE_ALIASES.get(arch, arch) in self.accepted

    def _cores_ok(self, entry: Any) -> bool:
        cores = entry.get("cores") if isinstance(entry, Mapping) else None
        return _is_number(cores) and cores >= self.cores

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cpus = properties.get("cpus")
        if not isinstance(cpus, list | tuple):
            return False
        return any(self._cores_ok(e) and self._arch_ok(e) for e in cpus)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        cpus = properties.get("cpus")
        if not isinstance(cpus, list | tuple):
            return self._no_cpus(cpus)
        if self.accepted is None:
            return [self._cores_failure(cpus, None)]
        arch_matching = [e for e in cpus if self._arch_ok(e)]
        if arch_matching:
            return [self._cores_failure(cpus, arch_matching)]
        failures = [self._architecture_failure(cpus)]
        if not any(self._cores_ok(e) for e in cpus):
            failures.append(self._cores_failure(cpus, None))
        return failures

    def _wanted(self) -> str:
        arch = f" {'/'.join(self.architectures)}" if self.architectures else ""
        return f"a single{arch} CPU entry with at least {_number(self.cores)} cores"

    def _no_cpus(self, cpus: Any) -> list[Failure]:
        reported = "no cpus" if cpus is None else f"cpus as {_show(cpus)}, not a list"
        message = f"needs {self._wanted()}, but the device reports {reported}"
        failures = [
            Failure(self.stage, "cpu.cores", ">=", _number(self.cores), None, None, message)
        ]
        if self.architectures:
            failures.append(
                Failure(self.stage, "cpu.architectures", "In", list(self.architectures), None,
                        None, message)
            )
        return failures

    def _architecture_failure(self, cpus: list[Any] | tuple[Any, ...]) -> Failure:
        actual = [_entry_field(e, "architecture") for e in cpus]
        required = list(self.architectures or ())
        message = (
            f"needs a CPU entry with architecture in {_show(required)}, "
            f"but the device's cpus are {_show(actual)}"
        )
        return Failure(self.stage, "cpu.architectures", "In", required, actual, None, message)

    def _cores_failure(self, cpus: list[Any] | tuple[Any, ...],
                       arch_matching: list[Any] | None) -> Failure:
        """Cores per entry; `arch_matching` narrows the explanation to the usable entries."""
        actual = [_entry_field(e, "cores") for e in cpus]
        if arch_matching is None:
            has = f"the device's cpus have {_show(actual)} cores"
        else:
            usable = [_entry_field(e, "cores") for e in arch_matching]
            arch = "/".join(self.architectures or ())
            has = (
                f"the device's {arch} entries have {_show(usable)} cores"
                f" (all entries: {_show(actual)})"
            )
        message = f"needs {self._wanted()}, but {has}; entries are never summed"
        return Failure(self.stage, "cpu.cores", ">=", _number(self.cores), actual, None, message)


def _entry_field(entry: Any, field: str) -> Any:
    value = entry.get(field) if isinstance(entry, Mapping) else None
    return _number(value) if _is_number(value) else value


@dataclass(frozen=True, slots=True)
class _QuantityCheck:
    """`memory` / `storage`: the device reports at least the required bytes."""

    stage: str
    field: str
    required_text: Any  # as written in the constraint
    required_bytes: Decimal
    required_shown: str  # format_quantity(required_bytes), rendered once at compile time

    def passes(self, properties: Mapping[str, Any]) -> bool:
        reported = _reported_bytes(properties.get(self.field))
        return isinstance(reported, Decimal) and reported >= self.required_bytes

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        raw = properties.get(self.field)
        needs = f"needs {self.required_shown} {self.field}"
        if raw is None:
            message = f"{needs}, but the device does not report {self.field}"
        else:
            reported = _reported_bytes(raw)
            message = (
                f"{needs}, has {self._has(reported)}"
                if isinstance(reported, Decimal)
                else f"{needs}, but the device reports {_show(raw)}, which is not a quantity"
                f" ({reported})"
            )
        return [Failure(self.stage, self.field, ">=", self.required_text, raw, None, message)]

    def _has(self, reported: Decimal) -> str:
        has = format_quantity(reported)
        if has != self.required_shown:
            return has
        return f"{has} ({reported} < {self.required_bytes} bytes)"


@dataclass(frozen=True, slots=True)
class _PeripheralCheck:
    """Legacy: some device peripheral has the required type (and manufacturer/model if given)."""

    stage: str
    required: tuple[tuple[str, str], ...]

    def passes(self, properties: Mapping[str, Any]) -> bool:
        peripherals = properties.get("peripherals")
        if not isinstance(peripherals, list | tuple):
            return False
        return any(
            isinstance(p, Mapping) and all(p.get(f) == v for f, v in self.required)
            for p in peripherals
        )

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        actual = properties.get("peripherals")
        wanted = ", ".join(f"{f} {v!r}" for f, v in self.required)
        has = "no peripherals" if actual is None else _show(actual)
        message = f"needs a peripheral with {wanted}, but the device has {has}"
        return [Failure(self.stage, "peripherals", "ContainsAll", dict(self.required), actual,
                        None, message)]


@dataclass(frozen=True, slots=True)
class _InterfaceCheck:
    """Legacy: the device has an interface of the required type."""

    stage: str
    type: str

    def passes(self, properties: Mapping[str, Any]) -> bool:
        interfaces = properties.get("interfaces")
        if not isinstance(interfaces, list | tuple):
            return False
        return any(isinstance(i, Mapping) and i.get("type") == self.type for i in interfaces)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        actual = properties.get("interfaces")
        has = "no interfaces" if actual is None else _show(actual)
        message = f"needs a {self.type!r} interface, but the device has {has}"
        return [Failure(self.stage, "interfaces", "ContainsAll", {"type": self.type}, actual,
                        None, message)]


# --------------------------------------------------------------------------- cluster requirements

_NO_CLUSTER: Final = "the device reported no Kubernetes cluster data"
_LISTED_NODES: Final = 8  # near misses named per failure; the rest are counted
_NAMED_QUALIFIERS: Final = 5

Version = tuple[int, int, int]
Bound = tuple[str, Version]  # (">=" | ">" | "<=" | "<" | "==", version)

_COMPARISONS: Final[Mapping[str, Callable[[Version, Version], bool]]] = {
    ">=": ge, ">": gt, "<=": le, "<": lt, "==": eq,
}
_COMPARATOR = re.compile(
    r"(>=|<=|>|<|=)?\s*v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(?:\.(0|[1-9][0-9]*))?"
)
_REPORTED_VERSION = re.compile(r"v?([0-9]+)\.([0-9]+)(?:\.([0-9]+))?")
_RANGE_EXPECTED = ("a version range such as '>=1.28 <1.33' (comparators >=, >, <=, <, = with "
                   "MAJOR.MINOR[.PATCH], space = AND, || = OR)")
_VERSION_TEXT = r"v[0-9]+(?:(?:alpha|beta)[0-9]+)?"
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_API_VERSION = re.compile(_VERSION_TEXT)
_API_GROUP = re.compile(rf"({_DNS_LABEL}(?:\.{_DNS_LABEL})*)(?:/({_VERSION_TEXT}))?")
_CRD_NAME = re.compile(rf"([A-Za-z][A-Za-z0-9]*)\.({_DNS_LABEL}(?:\.{_DNS_LABEL})+)")


def _partial_bounds(op: str, major: int, minor: int, patch: int | None) -> list[Bound]:
    """Comparator -> bounds. A MAJOR.MINOR version stands for every patch of that minor:
    `>1.31` is `>=1.32.0`, `<=1.31` is `<1.32.0`, `=1.31` is `>=1.31.0 <1.32.0`."""
    if patch is not None:
        return [("==" if op == "=" else op, (major, minor, patch))]
    low, high = (major, minor, 0), (major, minor + 1, 0)
    return {">=": [(">=", low)], "<": [("<", low)], ">": [(">=", high)],
            "<=": [("<", high)], "=": [(">=", low), ("<", high)]}[op]


def parse_version_range(text: str) -> tuple[tuple[Bound, ...], ...]:
    """Parse a Kubernetes version range into OR-alternatives of AND-ed bounds.

    Grammar: alternatives separated by `||`; each is one or more whitespace-separated
    comparators `[>=|>|<=|<|=]MAJOR.MINOR[.PATCH]` (a leading `v` is allowed, no operator
    means `=`). Raises `ValueError` saying what could not be read.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a version range is a non-empty string")
    alternatives: list[tuple[Bound, ...]] = []
    for alternative in text.split("||"):
        words = alternative.split()
        if not words:
            raise ValueError(f"an alternative of {text!r} is empty")
        bounds: list[Bound] = []
        for word in _comparator_words(words):
            found = _COMPARATOR.fullmatch(word)
            if found is None:
                raise ValueError(f"cannot read {word!r} in {text!r}")
            op, major, minor, patch = found.groups()
            bounds += _partial_bounds(op or "=", int(major), int(minor),
                                      None if patch is None else int(patch))
        alternatives.append(tuple(bounds))
    return tuple(alternatives)


def _comparator_words(words: list[str]) -> list[str]:
    """`>= 1.28` is one comparator written with a space: join a bare operator to its version."""
    joined: list[str] = []
    for word in words:
        if joined and joined[-1] in (">=", "<=", ">", "<", "="):
            joined[-1] += word
        else:
            joined.append(word)
    return joined


def _in_range(version: Version, alternatives: tuple[tuple[Bound, ...], ...]) -> bool:
    return any(all(_COMPARISONS[op](version, bound) for op, bound in alternative)
               for alternative in alternatives)


def _section(cluster: Mapping[str, Any], *keys: str) -> Any:
    """cluster[k1][k2]...; `_MISSING` as soon as a level is absent or not an object."""
    value: Any = cluster
    for key in keys:
        value = _get(value, key)
    return value


def _unknown_note(cluster: Mapping[str, Any], *words: str) -> str:
    """What the cluster said it could not read about a field (RBAC, errors), as a note, so a
    missing section reads as "could not read: forbidden" rather than as "has none"."""
    unknown = cluster.get("unknown")
    if not isinstance(unknown, list | tuple):
        return ""
    notes = []
    for entry in unknown:
        what = str(entry.get("what", "")) if isinstance(entry, Mapping) else ""
        if what and any(word.lower() in what.lower() for word in words):
            reason = entry.get("reason")
            notes.append(f"{what}: {reason}" if reason else what)
    return f" (the cluster could not read {'; '.join(notes)})" if notes else ""


def _number_text(amount: Decimal | int | float) -> str:
    if isinstance(amount, Decimal):
        amount = int(amount) if amount == amount.to_integral_value() else float(amount)
    return str(_number(amount))


@dataclass(frozen=True, slots=True)
class _NodeAmount:
    """One per-node capacity clause, compared with what the node has AVAILABLE (allocatable
    minus what scheduled pods already request), never with its raw capacity."""

    field: str  # key in the node's `available` object
    unit: str  # "cores", "memory", "ephemeral storage" or the extended resource name
    quantity: bool  # memory-like byte quantity (else a number of cores or devices)
    required: Decimal | int | float
    shown: str  # "2 cores", "4Gi memory", "1 nvidia.com/gpu"

    def amount(self, node: Mapping[str, Any]) -> Decimal | int | float | None:
        value = _get(node.get("available"), self.field)
        if type(value) in (int, float) and not self.quantity:
            return value
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            parsed = _reported_bytes(value)  # also reads "1500m" cores
            return parsed if isinstance(parsed, Decimal) else None
        return None

    def ok(self, node: Mapping[str, Any]) -> bool:
        amount = self.amount(node)
        return amount is not None and amount >= self.required

    def has(self, node: Mapping[str, Any]) -> str:
        amount = self.amount(node)
        if amount is None:
            return f"no {self.unit}"
        if self.quantity:
            return f"{format_quantity(Decimal(amount))} {self.unit}"
        shown = _number_text(amount)
        return f"{shown} {'core' if self.unit == 'cores' and shown == '1' else self.unit}"


def _node_name(node: Any, index: int) -> str:
    name = node.get("name") if isinstance(node, Mapping) else None
    return name if isinstance(name, str) and name else f"node {index}"


def _summary_nodes(summary: list[Any] | tuple[Any, ...]) -> list[dict[str, Any]]:
    """Nodes of a manifest carrying only the proposal's `nodeSummary`. The proposal defines it
    as the allocatable resources of Ready nodes for "does a single node fit" questions and
    reports no requests, so allocatable stands in for available (said in explanations)."""
    nodes = []
    for index, entry in enumerate(summary):
        if not isinstance(entry, Mapping):
            continue
        amounts: dict[str, Any] = {}
        if "allocatableCpu" in entry:
            amounts["cpu"] = entry["allocatableCpu"]
        if "allocatableMemory" in entry:
            amounts["memory"] = entry["allocatableMemory"]
        for key in ("allocatableGpu", "allocatableExtendedResources"):
            if isinstance(entry.get(key), Mapping):
                amounts.update(entry[key])
        nodes.append({"name": f"nodeSummary[{index}]", "architecture": entry.get("architecture"),
                      "ready": True, "schedulable": True, "allocatable": amounts,
                      "available": amounts})
    return nodes


_SUMMARY_ORIGIN: Final = " (from nodeSummary: allocatable amounts, the cluster reports no requests)"


def _cluster_nodes(cluster: Mapping[str, Any]) -> tuple[list[Any] | tuple[Any, ...], str] | None:
    """The cluster's node objects and a note on where they came from; None if it has none."""
    nodes = _section(cluster, "resources", "nodes")
    if isinstance(nodes, list | tuple):
        return nodes, ""
    summary = _section(cluster, "resources", "nodeSummary")
    if isinstance(summary, list | tuple):
        return _summary_nodes(summary), _SUMMARY_ORIGIN
    return None


def _qualifying_text(names: list[str]) -> str:
    if not names:
        return "no node qualifies"
    shown = ", ".join(names[:_NAMED_QUALIFIERS])
    if len(names) > _NAMED_QUALIFIERS:
        shown += f", and {len(names) - _NAMED_QUALIFIERS} more"
    verb = "node qualifies" if len(names) == 1 else "nodes qualify"
    return f"{len(names)} {verb} ({shown})"


@dataclass(frozen=True, slots=True)
class _NodeRequirement:
    """At least `count` distinct nodes each pass the default filters (Ready, schedulable, unless
    the selector tests those itself), the node selector and every per-node capacity clause.
    Counting is all the WFM does: which node runs what stays with the Kubernetes scheduler."""

    stage: str
    index: int
    count: int
    amounts: tuple[_NodeAmount, ...]
    selector: tuple[_Expression, ...]
    only_ready: bool
    only_schedulable: bool
    required: Mapping[str, Any]  # as written, for reports

    def _qualifies(self, node: Any) -> bool:
        if not _is_object(node):
            return False
        if self.only_ready and node.get("ready") is not True:
            return False
        if self.only_schedulable and node.get("schedulable") is not True:
            return False
        for expr in self.selector:
            if not expr.test(expr.lookup(node)):
                return False
        return all(amount.ok(node) for amount in self.amounts)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cluster = cluster_of(properties)
        found = None if cluster is None else _cluster_nodes(cluster)
        if found is None:
            return False
        qualifying = 0
        for node in found[0]:
            if self._qualifies(node):
                qualifying += 1
                if qualifying >= self.count:
                    return True
        return False

    def wanted(self) -> str:
        text = f"{self.count} {'node' if self.count == 1 else 'nodes'}"
        if self.selector:
            text += " matching " + " and ".join(e.text for e in self.selector)
        if self.amounts:
            text += " with >= " + " and ".join(a.shown for a in self.amounts) + " available"
        return text

    def misses(self, node: Any) -> list[str]:
        """Why one node does not qualify, every reason (empty when it does)."""
        if not isinstance(node, Mapping):
            return [f"is {_kind(node)}, not a node object"]
        reasons = []
        if self.only_ready and node.get("ready") is not True:
            reasons.append("is not Ready" if node.get("ready") is False else "has no Ready status")
        if self.only_schedulable and node.get("schedulable") is not True:
            reasons.append("is not schedulable" if node.get("schedulable") is False
                           else "has no schedulable status")
        for expr in self.selector:
            actual = expr.lookup(node)
            if not expr.test(actual):
                has = "nothing there" if actual is _MISSING else _show(actual, 60)
                reasons.append(f"fails {expr.text} (has {has})")
        short = [amount for amount in self.amounts if not amount.ok(node)]
        if short:
            reasons.append("has " + " and ".join(a.has(node) for a in short) + " available")
        return reasons

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        needs = f"needs {self.wanted()}"
        cluster = cluster_of(properties)
        if cluster is None:
            return [self._failure(f"{needs}, but {_NO_CLUSTER}", None)]
        found = _cluster_nodes(cluster)
        if found is None:
            note = _unknown_note(cluster, "node")
            return [self._failure(f"{needs}, but the cluster reported no nodes{note}", None)]
        nodes, origin = found
        qualifying: list[str] = []
        misses: dict[str, list[str]] = {}
        for index, node in enumerate(nodes):
            reasons = self.misses(node)
            if reasons:
                misses[_node_name(node, index)] = reasons
            else:
                qualifying.append(_node_name(node, index))
        message = f"{needs}{origin}; {_qualifying_text(qualifying)}"
        if not nodes:
            message += " (the cluster reported no nodes)"
        listed = list(misses.items())[:_LISTED_NODES]
        message += "".join(f"; {name} {', '.join(reasons)}" for name, reasons in listed)
        if len(misses) > len(listed):
            message += f"; and {len(misses) - len(listed)} more nodes do not qualify"
        return [self._failure(message, {"qualifying": qualifying, "nodes": misses})]

    def _failure(self, message: str, actual: Any) -> Failure:
        return Failure(self.stage, f"cluster.nodes[{self.index}]", ">=", dict(self.required),
                       actual, None, message)


def _cluster_failure(stage: str, key: str, operator: str, required: Any, actual: Any,
                     message: str) -> list[Failure]:
    return [Failure(stage, f"cluster.{key}", operator, required, actual, None, message)]


@dataclass(frozen=True, slots=True)
class _VersionRequirement:
    """The cluster's Kubernetes version (metadata.kubernetesVersion) is in a range; patch and
    distribution suffixes (`+k3s1`, `-gke.100`) are ignored."""

    stage: str
    text: str
    alternatives: tuple[tuple[Bound, ...], ...]

    @staticmethod
    def _reported(cluster: Mapping[str, Any] | None) -> Any:
        return _MISSING if cluster is None else _section(cluster, "metadata", "kubernetesVersion")

    @staticmethod
    def _version(raw: Any) -> Version | None:
        found = _REPORTED_VERSION.match(raw) if isinstance(raw, str) else None
        if found is None:
            return None
        return int(found[1]), int(found[2]), int(found[3] or 0)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        version = self._version(self._reported(cluster_of(properties)))
        return version is not None and _in_range(version, self.alternatives)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        if self.passes(properties):
            return []
        cluster = cluster_of(properties)
        raw = self._reported(cluster)
        needs = f"needs Kubernetes {self.text}"
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif raw is _MISSING:
            message = (f"{needs}, but the cluster reported no Kubernetes version"
                       f"{_unknown_note(cluster, 'kubernetesVersion')}")
        elif self._version(raw) is None:
            message = f"{needs}, but the cluster reports {_show(raw)}, not MAJOR.MINOR[.PATCH]"
        else:
            message = f"{needs}, but the cluster runs {raw}"
        return _cluster_failure(self.stage, "kubernetesVersion", "In", self.text,
                                None if raw is _MISSING else raw, message)


def _serves(groups: list[Any] | tuple[Any, ...], group: str, version: str | None) -> bool:
    for entry in groups:
        if _get(entry, "name") == group:
            versions = _get(entry, "versions")
            if version is None or (isinstance(versions, list | tuple) and version in versions):
                return True
    return False


@dataclass(frozen=True, slots=True)
class _ApiGroupsRequirement:
    """Every listed API group (at the listed version, if one is given) is served."""

    stage: str
    entries: tuple[tuple[str, str, str | None], ...]  # (as written, group, version or None)

    @staticmethod
    def _served(properties: Mapping[str, Any]) -> dict[str, list[Any]] | None:
        cluster = cluster_of(properties)
        groups = _MISSING if cluster is None else _section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return None
        served: dict[str, list[Any]] = {}
        for group in groups:
            if isinstance(group, Mapping) and isinstance(group.get("name"), str):
                versions = group.get("versions")
                served.setdefault(group["name"], []).extend(
                    versions if isinstance(versions, list | tuple) else [])
        return served

    def _missing(self, served: dict[str, list[Any]]) -> list[str]:
        missing = []
        for text, group, version in self.entries:
            if group not in served:
                missing.append(f"{text} (group not served)")
            elif version is not None and version not in served[group]:
                missing.append(f"{text} (served: {', '.join(map(str, served[group])) or 'none'})")
        return missing

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cluster = cluster_of(properties)
        groups = _MISSING if cluster is None else _section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return False
        return all(_serves(groups, group, version) for _, group, version in self.entries)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        served = self._served(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs API {'group' if len(required) == 1 else 'groups'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif served is None:
            message = (f"{needs}, but the cluster reported no API groups"
                       f"{_unknown_note(cluster, 'apiGroups', 'api groups', 'discovery')}")
        else:
            missing = self._missing(served)
            if not missing:
                return []
            message = f"{needs}, but the cluster lacks {'; '.join(missing)}"
        return _cluster_failure(self.stage, "apiGroups", "ContainsAll", required,
                                None if served is None else sorted(served), message)


def _crd_matches(entry: Mapping[str, Any], text: str, resource: str, group: str) -> bool:
    """`plural.group` or `Kind.group` against a reported CRD. The proposal reports kinds, not
    plurals, so a plural is recognised as the lower-cased kind plus s / es / y->ies (or an
    explicit `name`/`plural` field when the reporter adds one)."""
    if entry.get("group") != group:
        return False
    if entry.get("name") == text or entry.get("plural") == resource:
        return True
    kind = entry.get("kind")
    if not isinstance(kind, str) or not kind:
        return False
    if resource[0].isupper():
        return kind == resource
    lower = kind.lower()
    plurals = {lower, lower + "s", lower + "es"}
    if lower.endswith("y"):
        plurals.add(lower[:-1] + "ies")
    return resource in plurals


@dataclass(frozen=True, slots=True)
class _CrdRequirement:
    """Every listed CustomResourceDefinition is installed."""

    stage: str
    entries: tuple[tuple[str, str, str], ...]  # (as written, plural or Kind, group)

    @staticmethod
    def _reported(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        crds = (_MISSING if cluster is None
                else _section(cluster, "apiSurface", "customResourceDefinitions"))
        if not isinstance(crds, list | tuple):
            return None
        return [crd for crd in crds if isinstance(crd, Mapping)]

    def _missing(self, crds: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
        return [(text, group) for text, resource, group in self.entries
                if not any(_crd_matches(crd, text, resource, group) for crd in crds)]

    def passes(self, properties: Mapping[str, Any]) -> bool:
        crds = self._reported(properties)
        return crds is not None and not self._missing(crds)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        crds = self._reported(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs {'CRD' if len(required) == 1 else 'CRDs'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif crds is None:
            note = _unknown_note(cluster, "customResourceDefinitions", "crd")
            message = f"{needs}, but the cluster reported no CRDs{note}"
        else:
            missing = self._missing(crds)
            if not missing:
                return []
            details = []
            for text, group in missing:
                kinds = sorted({str(c.get("kind")) for c in crds if c.get("group") == group})
                details.append(f"{text} (group {group} has {', '.join(kinds)})" if kinds
                               else f"{text} (no CRD of group {group})")
            message = f"{needs}, but the cluster lacks {'; '.join(details)}"
        actual = None if crds is None else [f"{c.get('kind')}.{c.get('group')}" for c in crds]
        return _cluster_failure(self.stage, "customResourceDefinitions", "ContainsAll", required,
                                actual, message)


@dataclass(frozen=True, slots=True)
class _StorageClassRequirement:
    """The cluster has a default StorageClass (`name` None), or `name` is the default."""

    stage: str
    name: str | None

    @staticmethod
    def _classes(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        classes = _MISSING if cluster is None else _section(cluster, "capabilities",
                                                            "storageClasses")
        if not isinstance(classes, list | tuple):
            return None
        return [c for c in classes if isinstance(c, Mapping)]

    def _ok(self, classes: list[Mapping[str, Any]]) -> bool:
        return any(c.get("isDefault") is True and (self.name is None or c.get("name") == self.name)
                   for c in classes)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        classes = self._classes(properties)
        return classes is not None and self._ok(classes)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        classes = self._classes(properties)
        needs = ("needs a default storage class" if self.name is None
                 else f"needs {self.name!r} as the default storage class")
        cluster = cluster_of(properties)
        defaults = [str(c.get("name")) for c in classes or () if c.get("isDefault") is True]
        if cluster is None:
            message = f"{needs}, but {_NO_CLUSTER}"
        elif classes is None:
            note = _unknown_note(cluster, "storageClasses", "storage")
            message = f"{needs}, but the cluster reported no storage classes{note}"
        elif self._ok(classes):
            return []
        elif defaults:
            message = f"{needs}, but the default is {', '.join(map(repr, defaults))}"
        else:
            names = ", ".join(repr(str(c.get("name"))) for c in classes) or "none"
            message = f"{needs}, but no storage class is the default (classes: {names})"
        return _cluster_failure(self.stage, "defaultStorageClass", "In",
                                True if self.name is None else self.name, defaults or None,
                                message)


_Check = (_CpuCheck | _QuantityCheck | _PeripheralCheck | _InterfaceCheck | _NodeRequirement
          | _VersionRequirement | _ApiGroupsRequirement | _CrdRequirement
          | _StorageClassRequirement)


@dataclass(frozen=True, slots=True)
class _Rule:
    """One eligibility rule: every property and every label expression must hold."""

    index: int
    properties: tuple[_Expression, ...]
    labels: tuple[_Expression, ...]

    def passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                if not expr.test(expr.lookup(doc)):
                    return False
        return True

    def explain(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> list[Failure]:
        failures = []
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                actual = expr.lookup(doc)
                if not expr.test(actual):
                    failures.append(self._failure(expr, actual))
        return failures

    def _failure(self, expr: _Expression, actual: Any) -> Failure:
        message = f"rule {self.index}: {expr.text} but {expr.why_not(actual)}"
        return Failure("eligibility", expr.key, expr.operator, expr.required,
                       None if actual is _MISSING else actual, self.index, message)


def _characteristic(view: Mapping[str, Any], labels: Mapping[str, Any], key: str) -> Any:
    """The draft's device side, mapped onto an rc.3 report: `DEVICE_CHARACTERISTIC` is the whole
    matching view; then characteristics the device reports in the draft's shape under
    `x-margo-gitops-extensions.deviceCharacteristics` ([{key, properties}]); then labels (a
    label is a characteristic whose value is the label value). `_MISSING` when none has it."""
    if key == DEVICE_CHARACTERISTIC:
        return view
    extension = view.get(EXTENSION)
    reported = extension.get("deviceCharacteristics") if isinstance(extension, Mapping) else None
    if isinstance(reported, list | tuple):
        for entry in reported:
            if isinstance(entry, Mapping) and entry.get("key") == key:
                return entry.get("properties", _MISSING)
    return labels.get(key, _MISSING)


@dataclass(frozen=True, slots=True)
class _CharacteristicExpression:
    """A draft matchExpression: find the characteristic `key`, then test `expression` (whose
    lookup is the `property` pointer, or the whole value when there is none)."""

    key: str
    property: str | None
    expression: _Expression

    def actual(self, view: Mapping[str, Any], labels: Mapping[str, Any]) -> tuple[Any, Any]:
        found = _characteristic(view, labels, self.key)
        return found, self.expression.lookup(found)

    def why_not(self, found: Any, actual: Any) -> str:
        if found is _MISSING:
            return f"the device has no characteristic or label {self.key!r}"
        return self.expression.why_not(actual)


@dataclass(frozen=True, slots=True)
class _CharacteristicRule:
    """One `deviceCharacteristics` entry of the draft: every expression must hold."""

    index: int
    expressions: tuple[_CharacteristicExpression, ...]

    def passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for item in self.expressions:
            expr = item.expression
            if not expr.test(expr.lookup(_characteristic(properties, labels, item.key))):
                return False
        return True

    def explain(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> list[Failure]:
        failures = []
        for item in self.expressions:
            found, actual = item.actual(properties, labels)
            if item.expression.test(actual):
                continue
            message = (f"deviceCharacteristics {self.index} (draft): {item.expression.text} but "
                       f"{item.why_not(found, actual)}")
            key = item.key if item.property is None else f"{item.key} {item.property}"
            failures.append(Failure("characteristics", key, item.expression.operator,
                                    item.expression.required,
                                    None if actual is _MISSING else actual, self.index, message))
        return failures


# --------------------------------------------------------------------------- compiled form


@dataclass(frozen=True, slots=True)
class CompiledConstraints:
    """Validated, pre-parsed constraints; immutable and safe to share across threads.

    `evaluate` first runs a boolean-only pass (the common "eligible" answer costs no
    allocations) and builds explanations only for devices that do not match.
    """

    checks: tuple[_Check, ...]
    rules: tuple[_Rule, ...]
    characteristics: tuple[_CharacteristicRule, ...] = ()

    def _passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for check in self.checks:
            if not check.passes(properties):
                return False
        if self.rules and not any(rule.passes(properties, labels) for rule in self.rules):
            return False
        return not self.characteristics or any(
            rule.passes(properties, labels) for rule in self.characteristics)

    @property
    def reads_properties(self) -> bool:
        """Whether a verdict can depend on the device's properties at all: with labels-only
        rules it cannot, and callers may pass None instead of building a matching view."""
        return bool(self.checks or self.characteristics
                    or any(rule.properties for rule in self.rules))

    def is_eligible(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> bool:
        """The verdict alone, for callers that explain only on demand (fleet compiles)."""
        return self._passes(_EMPTY if properties is None else properties,
                            _EMPTY if labels is None else labels)

    def evaluate(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> MatchResult:
        """Match one device: capacity and cluster requirements AND (no rules OR some rule) AND
        (no draft characteristics OR some characteristics entry), explaining every miss.

        `properties` is the device's matching view (`matching_view`); plain `properties`
        work too, but then extensions and cluster requirements see nothing (and fail)."""
        properties = _EMPTY if properties is None else properties
        labels = _EMPTY if labels is None else labels
        if self._passes(properties, labels):
            return _ELIGIBLE
        failures: list[Failure] = []
        for check in self.checks:
            failures.extend(check.explain(properties))
        for group in (self.rules, self.characteristics):
            group_failures: list[Failure] = []
            for rule in group:
                missed = rule.explain(properties, labels)
                if not missed:
                    group_failures = []
                    break
                group_failures.extend(missed)
            failures.extend(group_failures)
        return MatchResult(False, tuple(failures))


# --------------------------------------------------------------------------- compiler


def _pointer_text(key: str) -> str:
    return key if key else '""'


class _Compiler:
    """Turns constraint documents into checks, collecting every problem instead of stopping."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def problem(self, path: Path, message: str, *, expected: str | None = None,
                found: Any = _MISSING) -> None:
        shown = None if found is _MISSING else short_repr(found)
        self.problems.append(Problem(path=path, message=message, expected=expected, found=shown))

    # ---- structure helpers

    def mapping(self, value: Any, path: Path, what: str) -> Mapping[str, Any] | None:
        if isinstance(value, Mapping):
            return value
        self.problem(path, f"{what} must be an object", expected="an object", found=value)
        return None

    def known_fields(self, doc: Mapping[str, Any], allowed: tuple[str, ...], path: Path,
                     what: str, *, extensions: bool = False) -> None:
        """Unknown fields are errors: a typo must not silently drop (and so widen) a clause."""
        for field in doc:
            if field in allowed:
                continue
            if extensions and isinstance(field, str) and _EXTENSION_KEY.fullmatch(field):
                continue
            close = difflib.get_close_matches(str(field), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            where = field if isinstance(field, str | int) else str(field)
            self.problem((*path, where), f"unknown field {field!r} in {what}{hint}",
                         expected="one of " + ", ".join(allowed), found=field)

    # ---- capacity

    def cpu(self, value: Any, path: Path, stage: str) -> _CpuCheck | None:
        doc = self.mapping(value, path, "cpu")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _CPU_FIELDS, path, "cpu")
        cores = doc.get("cores", _MISSING)
        if cores is _MISSING:
            self.problem(path, "cpu needs `cores`", expected="a number of cores greater than 0")
        elif not _is_number(cores) or not math.isfinite(cores) or cores <= 0:
            self.problem((*path, "cores"), "cores must be a number greater than 0",
                         expected="a number greater than 0", found=cores)
        architectures = self.architectures(doc.get("architectures", _MISSING), path)
        if len(self.problems) != before:
            return None
        accepted = (
            None
            if architectures is None
            else frozenset(ARCHITECTURE_ALIASES.get(a, a) for a in architectures)
        )
        return _CpuCheck(stage, cores, architectures, accepted)

    def architectures(self, value: Any, path: Path) -> tuple[str, ...] | None:
        """The listed architectures, None when absent (problems recorded when malformed)."""
        if value is _MISSING:
            return None
        path = (*path, "architectures")
        if not isinstance(value, list | tuple) or not value:
            self.problem(path, "architectures must be a non-empty list of architecture names",
                         expected="a non-empty list such as [amd64, arm64]", found=value)
            return None
        for i, arch in enumerate(value):
            if not isinstance(arch, str) or not arch:
                self.problem((*path, i), "an architecture must be a non-empty string",
                             expected="a name such as amd64", found=arch)
        return tuple(value)

    def quantity(self, doc: Mapping[str, Any], field: str, path: Path,
                 stage: str) -> _QuantityCheck | None:
        if field not in doc:
            return None
        value = doc[field]
        try:
            if not isinstance(value, str | int | float):
                raise ValueError(f"expected a quantity string, found {_kind(value)}")
            required = parse_quantity(value)
        except ValueError as exc:
            self.problem((*path, field), f"{field} is not a quantity: {exc}",
                         expected="a quantity such as 1024Mi or 10Gi", found=value)
            return None
        return _QuantityCheck(stage, field, value, required, format_quantity(required))

    def capacity(self, value: Any, path: Path, stage: str, fields: tuple[str, ...],
                 what: str) -> list[_Check]:
        doc = self.mapping(value, path, what)
        if doc is None:
            return []
        self.known_fields(doc, fields, path, what)
        checks: list[_Check | None] = []
        if "cpu" in doc:
            checks.append(self.cpu(doc["cpu"], (*path, "cpu"), stage))
        for field in ("memory", "storage"):
            checks.append(self.quantity(doc, field, path, stage))
        return [c for c in checks if c is not None]

    # ---- legacy requiredResources

    def required_resources(self, value: Any, path: Path) -> list[_Check]:
        stage = "requiredResources"
        checks = self.capacity(value, path, stage, _LEGACY_FIELDS, "requiredResources")
        if not isinstance(value, Mapping):
            return checks
        extra: list[_Check | None] = []
        for i, item in self.items(value, "peripherals", path):
            extra.append(self.peripheral(item, (*path, "peripherals", i), stage))
        for i, item in self.items(value, "interfaces", path):
            extra.append(self.interface(item, (*path, "interfaces", i), stage))
        return checks + [c for c in extra if c is not None]

    def items(self, doc: Mapping[str, Any], field: str, path: Path) -> list[tuple[int, Any]]:
        if field not in doc:
            return []
        value = doc[field]
        if not isinstance(value, list | tuple):
            self.problem((*path, field), f"{field} must be a list", expected="a list",
                         found=value)
            return []
        return list(enumerate(value))

    def peripheral(self, value: Any, path: Path, stage: str) -> _PeripheralCheck | None:
        doc = self.mapping(value, path, "a peripheral")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _PERIPHERAL_FIELDS, path, "a peripheral")
        if "type" not in doc:
            self.problem(path, "a peripheral needs `type`", expected="e.g. type: gpu")
        for field in _PERIPHERAL_FIELDS:
            if field in doc and (not isinstance(doc[field], str) or not doc[field]):
                self.problem((*path, field), f"peripheral {field} must be a non-empty string",
                             expected="a non-empty string", found=doc[field])
        if len(self.problems) != before:
            return None
        return _PeripheralCheck(stage, tuple((f, doc[f]) for f in _PERIPHERAL_FIELDS if f in doc))

    def interface(self, value: Any, path: Path, stage: str) -> _InterfaceCheck | None:
        doc = self.mapping(value, path, "an interface")
        if doc is None:
            return None
        self.known_fields(doc, _INTERFACE_FIELDS, path, "an interface")
        kind = doc.get("type", _MISSING)
        if isinstance(kind, str) and kind:
            return _InterfaceCheck(stage, kind)
        if kind is _MISSING:
            self.problem(path, "an interface needs `type`", expected="e.g. type: ethernet")
        else:
            self.problem((*path, "type"), "interface type must be a non-empty string",
                         expected="a non-empty string", found=kind)
        return None

    # ---- eligibility rules

    def rules(self, value: Any, path: Path) -> list[_Rule]:
        if not isinstance(value, list | tuple):
            self.problem(path, "eligibilityRules must be a list of rules",
                         expected="a list (OR across rules)", found=value)
            return []
        compiled = [self.rule(raw, (*path, i), i) for i, raw in enumerate(value)]
        return [rule for rule in compiled if rule is not None]

    def rule(self, value: Any, path: Path, index: int) -> _Rule | None:
        doc = self.mapping(value, path, "an eligibility rule")
        if doc is None:
            return None
        self.known_fields(doc, _RULE_FIELDS, path, "an eligibility rule")
        if not any(field in doc for field in _RULE_FIELDS):
            self.problem(path, "an eligibility rule needs a propertySelector or a labelSelector",
                         expected="propertySelector and/or labelSelector", found=value)
            return None
        before = len(self.problems)
        properties = self.selector(doc.get("propertySelector", _MISSING),
                                   (*path, "propertySelector"), labels=False)
        labels = self.selector(doc.get("labelSelector", _MISSING), (*path, "labelSelector"),
                               labels=True)
        if len(self.problems) != before:
            return None
        return _Rule(index, properties, labels)

    def selector(self, value: Any, path: Path, *, labels: bool, item: bool = False,
                 extended: bool = False) -> tuple[_Expression, ...]:
        """matchExpressions of a property, label or item selector (missing selector = none);
        `extended` selectors (inside our extension) also take the draft operators."""
        if value is _MISSING:
            return ()
        doc = self.mapping(value, path, "a selector")
        if doc is None:
            return ()
        self.known_fields(doc, _SELECTOR_FIELDS, path, "a selector")
        expressions = doc.get("matchExpressions", _MISSING)
        if expressions is _MISSING:
            self.problem(path, "a selector needs matchExpressions",
                         expected="matchExpressions: [...]")
            return ()
        path = (*path, "matchExpressions")
        if not isinstance(expressions, list | tuple) or (item and not expressions):
            need = "a non-empty list" if item else "a list"
            self.problem(path, f"matchExpressions must be {need}", expected=need,
                         found=expressions)
            return ()
        compiled = [self.expression(e, (*path, i), labels=labels, extended=extended)
                    for i, e in enumerate(expressions)]
        return tuple(e for e in compiled if e is not None)

    def expression(self, value: Any, path: Path, *, labels: bool,
                   extended: bool = False) -> _Expression | None:
        doc = self.mapping(value, path, "a matchExpression")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _EXPRESSION_FIELDS, path, "a matchExpression")
        key = self.expression_key(doc, path, labels=labels)
        operator = self.operator(doc, path, extended=extended)
        if operator is None:
            return None
        values = self.values(doc, operator, path)
        items = self.item_selector(doc, operator, path, extended=extended)
        if len(self.problems) != before or key is None or values is None or items is None:
            return None
        return self.build(key, operator, values, items, labels=labels)

    def expression_key(self, doc: Mapping[str, Any], path: Path, *,
                       labels: bool) -> tuple[str, Lookup] | None:
        key = doc.get("key", _MISSING)
        if key is _MISSING:
            self.problem(path, "a matchExpression needs `key`",
                         expected="a label key" if labels else "a JSON Pointer such as /vendor")
            return None
        if not isinstance(key, str) or (labels and not key):
            self.problem((*path, "key"), "key must be a non-empty string",
                         expected="a string", found=key)
            return None
        if labels:
            return key, _label_lookup(key)
        try:
            return key, _pointer_lookup(parse_pointer(key))
        except ValueError as exc:
            self.problem((*path, "key"), f"key is not a valid JSON Pointer: {exc}",
                         expected="an RFC 6901 JSON Pointer such as /vendor or /cpus/0/cores",
                         found=key)
            return None

    def operator(self, doc: Mapping[str, Any], path: Path, *,
                 extended: bool = False) -> str | None:
        allowed = _EXTENDED_OPERATORS if extended else OPERATORS
        expected = "one of " + ", ".join(sorted(allowed))
        operator = doc.get("operator", _MISSING)
        if operator is _MISSING:
            self.problem(path, "a matchExpression needs `operator`", expected=expected)
            return None
        if isinstance(operator, str) and operator in allowed:
            return operator
        if isinstance(operator, str) and operator in DRAFT_OPERATORS:
            self.problem((*path, "operator"),
                         f"{operator} belongs to the schema-agnostic matching draft, not to the"
                         f" rc.3 operators of this selector; use {operator[:2]} here, or use it"
                         f" inside deviceConstraints.{EXTENSION}", expected=expected,
                         found=operator)
            return None
        close = [o for o in allowed if isinstance(operator, str) and o.lower() ==
                 operator.lower()]
        hint = f"; did you mean {close[0]!r}? (operators are case-sensitive)" if close else ""
        self.problem((*path, "operator"), f"unknown operator {short_repr(operator)}{hint}",
                     expected=expected, found=operator)
        return None

    def values(self, doc: Mapping[str, Any], operator: str,
               path: Path) -> tuple[Any, ...] | None:
        values = doc.get("values", _MISSING)
        if operator in _PRESENCE_OPERATORS | _CONTAINS_OPERATORS:
            if values is _MISSING:
                return ()
            self.problem((*path, "values"), f"{operator} takes no values",
                         expected="no values", found=values)
            return None
        if values is _MISSING:
            self.problem(path, f"{operator} needs `values`",
                         expected=_VALUES_EXPECTED[operator])
            return None
        path = (*path, "values")
        if not isinstance(values, list | tuple) or not values:
            self.problem(path, f"{operator} needs a non-empty list of values",
                         expected=_VALUES_EXPECTED[operator], found=values)
            return None
        if operator in _BOUND_OPERATORS:
            return self.bound(values, operator, path)
        return self.value_list(values, operator, path)

    def bound(self, values: Any, operator: str, path: Path) -> tuple[Any, ...] | None:
        if len(values) != 1:
            self.problem(path, f"{operator} takes exactly one numeric value, found {len(values)}",
                         expected="exactly one number", found=values)
            return None
        bound = values[0]
        if not _is_number(bound) or not math.isfinite(bound):
            self.problem((*path, 0), f"{operator} compares numbers",
                         expected="a finite number (not a string or boolean)", found=bound)
            return None
        return (bound,)

    def value_list(self, values: Any, operator: str, path: Path) -> tuple[Any, ...] | None:
        """One or more strings, or one or more numbers, or exactly one boolean."""
        ok = True
        for i, value in enumerate(values):
            if not isinstance(value, str | int | float) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                self.problem((*path, i), f"{operator} values must be strings, numbers or a"
                             " boolean", expected="a string, finite number or boolean",
                             found=value)
                ok = False
        if not ok:
            return None
        kinds = {_kind(v) for v in values}
        if len(kinds) > 1:
            self.problem(path, f"{operator} values must all be of one type, found "
                         + " and ".join(sorted(kinds)),
                         expected="all strings, all numbers, or exactly one boolean",
                         found=values)
            return None
        if kinds == {"a boolean"} and len(values) != 1:
            self.problem(path, f"{operator} takes exactly one boolean value",
                         expected="[true] or [false]", found=values)
            return None
        return tuple(values)

    def item_selector(self, doc: Mapping[str, Any], operator: str, path: Path, *,
                      extended: bool = False) -> tuple[_Expression, ...] | None:
        selector = doc.get("itemSelector", _MISSING)
        if operator not in _CONTAINS_OPERATORS:
            if selector is _MISSING:
                return ()
            self.problem((*path, "itemSelector"),
                         f"{operator} takes no itemSelector (only ContainsAll/ContainsAny do)",
                         expected="no itemSelector", found=selector)
            return None
        if selector is _MISSING:
            self.problem(path, f"{operator} needs itemSelector.matchExpressions",
                         expected="itemSelector: {matchExpressions: [...]}")
            return None
        before = len(self.problems)
        items = self.selector(selector, (*path, "itemSelector"), labels=False, item=True,
                              extended=extended)
        return items if len(self.problems) == before else None

    def build(self, key_lookup: tuple[str, Lookup], operator: str, values: tuple[Any, ...],
              items: tuple[_Expression, ...], *, labels: bool,
              naming: tuple[str, str] | None = None) -> _Expression:
        """The compiled expression; `naming` overrides (subject, noun) for the draft form."""
        key, lookup = key_lookup
        subject = f"label {key!r}" if labels else _pointer_text(key)
        noun = subject if labels else f"property {subject}"
        if naming is not None:
            subject, noun = naming
        if operator in _VALUE_OPERATORS:
            test = _in_test(values) if operator == "In" else _not_in_test(values)
            required: Any = list(values)
            shown = f" {_show(required)}"
        elif operator in _BOUND_OPERATORS:
            test, required = _bound_test(operator, values[0]), values[0]
            shown = f" {_show(required)}"
        elif operator in _CONTAINS_OPERATORS:
            test, required = _contains_test(operator, items), [i.text for i in items]
            shown = " [" + ", ".join(required) + "]"
        else:
            test = _exists if operator == "Exists" else _does_not_exist
            required, shown = None, ""
        return _Expression(key, operator, subject, noun, lookup, test, values, required,
                           f"{subject} {operator}{shown}")

    # ---- our extension: cluster requirements and the draft form

    def extension(self, value: Any, path: Path) -> tuple[list[_Check],
                                                          list[_CharacteristicRule]]:
        """`deviceConstraints["x-margo-gitops-extensions"]`: our namespace, so unknown keys
        are errors here (a typo must not drop a requirement); other vendors' are ignored."""
        doc = self.mapping(value, path, EXTENSION)
        if doc is None:
            return [], []
        self.known_fields(doc, _EXTENSION_FIELDS, path, EXTENSION)
        checks = self.cluster(doc["cluster"], (*path, "cluster")) if "cluster" in doc else []
        characteristics = (self.characteristic_rules(doc["deviceCharacteristics"],
                                                     (*path, "deviceCharacteristics"))
                           if "deviceCharacteristics" in doc else [])
        return checks, characteristics

    def cluster(self, value: Any, path: Path) -> list[_Check]:
        doc = self.mapping(value, path, "cluster requirements")
        if doc is None:
            return []
        self.known_fields(doc, _CLUSTER_FIELDS, path, "cluster requirements")
        if not doc:
            self.problem(path, "cluster requirements are empty",
                         expected="one or more of " + ", ".join(_CLUSTER_FIELDS))
        checks: list[_Check | None] = []
        if "nodes" in doc:
            checks += self.node_requirements(doc["nodes"], (*path, "nodes"))
        if "kubernetesVersion" in doc:
            checks.append(self.version_requirement(doc["kubernetesVersion"],
                                                   (*path, "kubernetesVersion")))
        if "apiGroups" in doc:
            checks.append(self.api_groups(doc["apiGroups"], (*path, "apiGroups")))
        if "customResourceDefinitions" in doc:
            checks.append(self.crds(doc["customResourceDefinitions"],
                                    (*path, "customResourceDefinitions")))
        if "defaultStorageClass" in doc:
            checks.append(self.storage_class(doc["defaultStorageClass"],
                                             (*path, "defaultStorageClass")))
        return [c for c in checks if c is not None]

    def node_requirements(self, value: Any, path: Path) -> list[_NodeRequirement | None]:
        if not isinstance(value, list | tuple) or not value:
            self.problem(path, "nodes must be a non-empty list of node requirements",
                         expected="a list such as [{count: 2, capacity: {cpu: 2}}] (AND)",
                         found=value)
            return []
        return [self.node_requirement(raw, (*path, i), i) for i, raw in enumerate(value)]

    def node_requirement(self, value: Any, path: Path, index: int) -> _NodeRequirement | None:
        doc = self.mapping(value, path, "a node requirement")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _NODE_FIELDS, path, "a node requirement")
        count = doc.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            self.problem((*path, "count"), "count must be a whole number of nodes, at least 1",
                         expected="an integer >= 1", found=count)
        amounts = (self.node_capacity(doc["capacity"], (*path, "capacity"))
                   if "capacity" in doc else ())
        selector = self.selector(doc.get("selector", _MISSING), (*path, "selector"),
                                 labels=False, extended=True)
        if len(self.problems) != before:
            return None
        tested = {parse_pointer(e.key)[0] for e in selector if e.key}
        required: dict[str, Any] = {"count": count}
        if "capacity" in doc:
            required["capacity"] = doc["capacity"]
        if selector:
            required["selector"] = [e.text for e in selector]
        return _NodeRequirement("cluster", index, count, amounts, selector,
                                "ready" not in tested, "schedulable" not in tested, required)

    def node_capacity(self, value: Any, path: Path) -> tuple[_NodeAmount, ...]:
        doc = self.mapping(value, path, "node capacity")
        if doc is None:
            return ()
        self.known_fields(doc, _NODE_CAPACITY_FIELDS, path, "node capacity")
        if not doc:
            self.problem(path, "node capacity is empty",
                         expected="one or more of " + ", ".join(_NODE_CAPACITY_FIELDS))
        amounts: list[_NodeAmount | None] = []
        if "cpu" in doc:
            amounts.append(self.node_cores(doc["cpu"], (*path, "cpu")))
        for field, unit in (("memory", "memory"), ("ephemeralStorage", "ephemeral storage")):
            if field in doc:
                amounts.append(self.node_bytes(doc[field], (*path, field), field, unit))
        if "resources" in doc:
            amounts += self.node_resources(doc["resources"], (*path, "resources"))
        return tuple(a for a in amounts if a is not None)

    def node_cores(self, value: Any, path: Path) -> _NodeAmount | None:
        """Cores as a number (2, 1.5) or a Kubernetes CPU quantity ("1500m")."""
        cores: Decimal | int | float | None = None
        if _is_number(value) and math.isfinite(value) and value > 0:
            cores = value
        elif isinstance(value, str):
            parsed = _parse_reported_text(value)
            cores = parsed if isinstance(parsed, Decimal) and parsed > 0 else None
        if cores is None:
            self.problem(path, "cpu must be a number of cores greater than 0",
                         expected="e.g. 2, 0.5 or '500m'", found=value)
            return None
        shown = _number_text(cores)
        return _NodeAmount("cpu", "cores", False, cores,
                           f"{shown} {'core' if shown == '1' else 'cores'}")

    def node_bytes(self, value: Any, path: Path, field: str, unit: str) -> _NodeAmount | None:
        try:
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError(f"expected a quantity string, found {_kind(value)}")
            required = parse_quantity(value)
        except ValueError as exc:
            self.problem(path, f"{field} is not a quantity: {exc}",
                         expected="a quantity such as 4Gi or 512Mi", found=value)
            return None
        return _NodeAmount(field, unit, True, required, f"{format_quantity(required)} {unit}")

    def node_resources(self, value: Any, path: Path) -> list[_NodeAmount | None]:
        doc = self.mapping(value, path, "node resources")
        if doc is None:
            return []
        amounts: list[_NodeAmount | None] = []
        for name, count in doc.items():
            where = (*path, str(name))
            if not isinstance(name, str) or not name or name in _NODE_CAPACITY_FIELDS or (
                    name == "ephemeral-storage"):
                self.problem(where, f"{short_repr(name)} is not an extended resource name "
                             "(cpu, memory and ephemeral storage have their own fields)",
                             expected="e.g. nvidia.com/gpu", found=name)
            elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
                self.problem(where, f"{name} must be a whole number of devices, at least 1",
                             expected="an integer >= 1", found=count)
            else:
                amounts.append(_NodeAmount(name, name, False, count, f"{count} {name}"))
        return amounts

    def version_requirement(self, value: Any, path: Path) -> _VersionRequirement | None:
        try:
            alternatives = parse_version_range(value)
        except ValueError as exc:
            self.problem(path, f"kubernetesVersion is not a version range: {exc}",
                         expected=_RANGE_EXPECTED, found=value)
            return None
        return _VersionRequirement("cluster", value, alternatives)

    def string_list(self, value: Any, path: Path, what: str, example: str) -> list[tuple[int,
                                                                                           str]]:
        if not isinstance(value, list | tuple) or not value:
            self.problem(path, f"{what} must be a non-empty list", expected=example, found=value)
            return []
        good = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item:
                good.append((i, item))
            else:
                self.problem((*path, i), f"an entry of {what} must be a non-empty string",
                             expected=example, found=item)
        return good

    def api_groups(self, value: Any, path: Path) -> _ApiGroupsRequirement | None:
        """`group` or `group/version`; a bare version (`v1`) is the core group."""
        before = len(self.problems)
        example = "e.g. [networking.k8s.io, monitoring.coreos.com/v1, v1]"
        entries: list[tuple[str, str, str | None]] = []
        for i, text in self.string_list(value, path, "apiGroups", example):
            if _API_VERSION.fullmatch(text):
                entries.append((text, "", text))
                continue
            found = _API_GROUP.fullmatch(text)
            if found is None:
                self.problem((*path, i), f"{text!r} is not an API group[/version]",
                             expected=example, found=text)
            else:
                entries.append((text, found[1], found[2]))
        return None if len(self.problems) != before else _ApiGroupsRequirement(
            "cluster", tuple(entries))

    def crds(self, value: Any, path: Path) -> _CrdRequirement | None:
        before = len(self.problems)
        example = "e.g. [servicemonitors.monitoring.coreos.com] (plural.group or Kind.group)"
        entries: list[tuple[str, str, str]] = []
        for i, text in self.string_list(value, path, "customResourceDefinitions", example):
            found = _CRD_NAME.fullmatch(text)
            if found is None:
                self.problem((*path, i), f"{text!r} is not a CRD name (plural.group)",
                             expected=example, found=text)
            else:
                entries.append((text, found[1], found[2]))
        return None if len(self.problems) != before else _CrdRequirement(
            "cluster", tuple(entries))

    def storage_class(self, value: Any, path: Path) -> _StorageClassRequirement | None:
        if value is True:
            return _StorageClassRequirement("cluster", None)
        if isinstance(value, str) and value:
            return _StorageClassRequirement("cluster", value)
        self.problem(path, "defaultStorageClass is true (some default) or a class name",
                     expected="true or a storage class name", found=value)
        return None

    def characteristic_rules(self, value: Any, path: Path) -> list[_CharacteristicRule]:
        """The draft's `deviceCharacteristics`: OR across entries, AND within an entry."""
        if not isinstance(value, list | tuple) or not value:
            self.problem(path, "deviceCharacteristics must be a non-empty list",
                         expected="[{matchExpressions: [...]}, ...] (OR across entries)",
                         found=value)
            return []
        rules = []
        for index, raw in enumerate(value):
            where = (*path, index)
            doc = self.mapping(raw, where, "a deviceCharacteristics entry")
            if doc is None:
                continue
            self.known_fields(doc, _CHARACTERISTIC_RULE_FIELDS, where,
                              "a deviceCharacteristics entry")
            expressions = doc.get("matchExpressions", _MISSING)
            where = (*where, "matchExpressions")
            if not isinstance(expressions, list | tuple) or not expressions:
                self.problem(where, "matchExpressions must be a non-empty list",
                             expected="a non-empty list", found=expressions)
                continue
            compiled = [self.characteristic(e, (*where, i)) for i, e in enumerate(expressions)]
            if all(c is not None for c in compiled):
                rules.append(_CharacteristicRule(index, tuple(c for c in compiled if c)))
        return rules

    def characteristic(self, value: Any, path: Path) -> _CharacteristicExpression | None:
        doc = self.mapping(value, path, "a characteristic expression")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _CHARACTERISTIC_FIELDS, path, "a characteristic expression")
        key = doc.get("key", _MISSING)
        if not isinstance(key, str) or not key:
            self.problem(path if key is _MISSING else (*path, "key"),
                         "a characteristic expression needs `key`, a non-empty string",
                         expected="a characteristic key or label key", found=key)
        pointer = doc.get("property", _MISSING)
        lookup: Lookup = _identity
        if pointer is not _MISSING:
            try:
                if not isinstance(pointer, str):
                    raise ValueError(f"expected a string, found {_kind(pointer)}")
                lookup = _pointer_lookup(parse_pointer(pointer))
            except ValueError as exc:
                self.problem((*path, "property"), f"property is not a valid JSON Pointer: {exc}",
                             expected="an RFC 6901 JSON Pointer such as /cpus", found=pointer)
        operator = self.operator(doc, path, extended=True)
        if operator is None:
            return None
        values = self.values(doc, operator, path)
        items = self.item_selector(doc, operator, path, extended=True)
        if len(self.problems) != before or values is None or items is None:
            return None
        prop = None if pointer is _MISSING else str(pointer)
        subject = f"characteristic {key!r}" + ("" if prop is None else f" {_pointer_text(prop)}")
        noun = (f"characteristic or label {key!r}" if prop is None
                else f"property {_pointer_text(prop)} in characteristic {key!r}")
        expression = self.build((prop or "", lookup), operator, values, items, labels=False,
                                naming=(subject, noun))
        return _CharacteristicExpression(str(key), prop, expression)


_VALUES_EXPECTED: Final[Mapping[str, str]] = {
    "In": "one or more strings, one or more numbers, or exactly one boolean",
    "NotIn": "one or more strings, one or more numbers, or exactly one boolean",
    "Gt": "exactly one number",
    "Lt": "exactly one number",
    "GtEq": "exactly one number",
    "LtEq": "exactly one number",
}


def _required_resources_path(path: Path) -> Path:
    """Where requiredResources sits: beside a `.../deviceConstraints` path, at a
    `.../requiredResources` path itself, else inside `path` (a profile)."""
    if path and path[-1] == "deviceConstraints":
        return (*path[:-1], "requiredResources")
    if path and path[-1] == "requiredResources":
        return path
    return (*path, "requiredResources")


def compile_constraints(
    device_constraints: Mapping[str, Any] | None = None,
    *,
    required_resources: Mapping[str, Any] | None = None,
    path: Path = (),
    required_resources_path: Path | None = None,
) -> CompiledConstraints:
    """Validate and pre-parse a profile's constraints for fast repeated evaluation.

    `path` locates `device_constraints` in its document; every `Problem` in the raised
    `DocumentError` is `path` plus the offending clause's keys and indices. Problems in
    `required_resources` are located at `required_resources_path`; by default that is the
    sibling `requiredResources` of a `path` ending in `deviceConstraints`, `path` itself when it
    ends in `requiredResources`, else `path + ("requiredResources",)`.
    """
    compiler = _Compiler()
    checks: list[_Check] = []
    rules: list[_Rule] = []
    characteristics: list[_CharacteristicRule] = []
    if device_constraints is not None:
        doc = compiler.mapping(device_constraints, path, "deviceConstraints")
        if doc is not None:
            compiler.known_fields(doc, _DEVICE_CONSTRAINT_FIELDS, path, "deviceConstraints",
                                  extensions=True)
            if "capacityRequirements" in doc:
                checks += compiler.capacity(doc["capacityRequirements"],
                                            (*path, "capacityRequirements"), "capacity",
                                            _CAPACITY_FIELDS, "capacityRequirements")
            if "eligibilityRules" in doc:
                rules = compiler.rules(doc["eligibilityRules"], (*path, "eligibilityRules"))
            if EXTENSION in doc:
                cluster_checks, characteristics = compiler.extension(doc[EXTENSION],
                                                                     (*path, EXTENSION))
                checks += cluster_checks
    if required_resources is not None:
        legacy_path = (
            _required_resources_path(path)
            if required_resources_path is None
            else required_resources_path
        )
        checks += compiler.required_resources(required_resources, legacy_path)
    if compiler.problems:
        raise DocumentError(compiler.problems)
    return CompiledConstraints(tuple(checks), tuple(rules), tuple(characteristics))


def match(
    device_constraints: Mapping[str, Any] | None,
    properties: Mapping[str, Any] | None,
    labels: Mapping[str, Any] | None,
    *,
    required_resources: Mapping[str, Any] | None = None,
) -> MatchResult:
    """Compile and evaluate in one go; compile once yourself when matching many devices."""
    compiled = compile_constraints(device_constraints, required_resources=required_resources)
    return compiled.evaluate(properties, labels)
