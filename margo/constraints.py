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
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Final

from margo.errors import DocumentError, Path, Problem, short_repr
from margo.quantity import format_quantity, parse_quantity

__all__ = [
    "ARCHITECTURE_ALIASES",
    "OPERATORS",
    "CompiledConstraints",
    "Failure",
    "MatchResult",
    "compile_constraints",
    "match",
    "parse_pointer",
]

#: The matchExpression operators the spec defines (case-sensitive).
OPERATORS: Final = frozenset(
    {"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt", "ContainsAll", "ContainsAny"}
)
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

_VALUE_OPERATORS = frozenset({"In", "NotIn"})
_BOUND_OPERATORS = frozenset({"Gt", "Lt"})
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


_Check = _CpuCheck | _QuantityCheck | _PeripheralCheck | _InterfaceCheck


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


# --------------------------------------------------------------------------- compiled form


@dataclass(frozen=True, slots=True)
class CompiledConstraints:
    """Validated, pre-parsed constraints; immutable and safe to share across threads.

    `evaluate` first runs a boolean-only pass (the common "eligible" answer costs no
    allocations) and builds explanations only for devices that do not match.
    """

    checks: tuple[_Check, ...]
    rules: tuple[_Rule, ...]

    def _passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for check in self.checks:
            if not check.passes(properties):
                return False
        if not self.rules:
            return True
        return any(rule.passes(properties, labels) for rule in self.rules)

    def is_eligible(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> bool:
        """The verdict alone, for callers that explain only on demand (fleet compiles)."""
        return self._passes(_EMPTY if properties is None else properties,
                            _EMPTY if labels is None else labels)

    def evaluate(
        self, properties: Mapping[str, Any] | None, labels: Mapping[str, Any] | None
    ) -> MatchResult:
        """Match one device: capacity AND (no rules OR some rule), explaining every miss."""
        properties = _EMPTY if properties is None else properties
        labels = _EMPTY if labels is None else labels
        if self._passes(properties, labels):
            return _ELIGIBLE
        failures: list[Failure] = []
        for check in self.checks:
            failures.extend(check.explain(properties))
        rule_failures: list[Failure] = []
        for rule in self.rules:
            missed = rule.explain(properties, labels)
            if not missed:
                rule_failures = []
                break
            rule_failures.extend(missed)
        return MatchResult(False, (*failures, *rule_failures))


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

    def selector(self, value: Any, path: Path, *, labels: bool,
                 item: bool = False) -> tuple[_Expression, ...]:
        """matchExpressions of a property, label or item selector (missing selector = none)."""
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
        compiled = [self.expression(e, (*path, i), labels=labels)
                    for i, e in enumerate(expressions)]
        return tuple(e for e in compiled if e is not None)

    def expression(self, value: Any, path: Path, *, labels: bool) -> _Expression | None:
        doc = self.mapping(value, path, "a matchExpression")
        if doc is None:
            return None
        before = len(self.problems)
        self.known_fields(doc, _EXPRESSION_FIELDS, path, "a matchExpression")
        key = self.expression_key(doc, path, labels=labels)
        operator = self.operator(doc, path)
        if operator is None:
            return None
        values = self.values(doc, operator, path)
        items = self.item_selector(doc, operator, path)
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

    def operator(self, doc: Mapping[str, Any], path: Path) -> str | None:
        operator = doc.get("operator", _MISSING)
        if operator is _MISSING:
            self.problem(path, "a matchExpression needs `operator`",
                         expected="one of " + ", ".join(sorted(OPERATORS)))
            return None
        if operator in OPERATORS:
            return str(operator)
        close = [o for o in OPERATORS if isinstance(operator, str) and o.lower() ==
                 operator.lower()]
        hint = f"; did you mean {close[0]!r}? (operators are case-sensitive)" if close else ""
        self.problem((*path, "operator"), f"unknown operator {short_repr(operator)}{hint}",
                     expected="one of " + ", ".join(sorted(OPERATORS)), found=operator)
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

    def item_selector(self, doc: Mapping[str, Any], operator: str,
                      path: Path) -> tuple[_Expression, ...] | None:
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
        items = self.selector(selector, (*path, "itemSelector"), labels=False, item=True)
        return items if len(self.problems) == before else None

    def build(self, key_lookup: tuple[str, Lookup], operator: str, values: tuple[Any, ...],
              items: tuple[_Expression, ...], *, labels: bool) -> _Expression:
        key, lookup = key_lookup
        subject = f"label {key!r}" if labels else _pointer_text(key)
        noun = subject if labels else f"property {subject}"
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


_VALUES_EXPECTED: Final[Mapping[str, str]] = {
    "In": "one or more strings, one or more numbers, or exactly one boolean",
    "NotIn": "one or more strings, one or more numbers, or exactly one boolean",
    "Gt": "exactly one number",
    "Lt": "exactly one number",
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
    if required_resources is not None:
        legacy_path = (
            _required_resources_path(path)
            if required_resources_path is None
            else required_resources_path
        )
        checks += compiler.required_resources(required_resources, legacy_path)
    if compiler.problems:
        raise DocumentError(compiler.problems)
    return CompiledConstraints(tuple(checks), tuple(rules))


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
