"""The compiler: constraint documents into `CompiledConstraints`, collecting every problem.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

from margo.constraints.capacity import (
    _CpuCheck,
    _InterfaceCheck,
    _parse_reported_text,
    _PeripheralCheck,
    _QuantityCheck,
)
from margo.constraints.cluster import (
    _API_GROUP,
    _API_VERSION,
    _CRD_NAME,
    _RANGE_EXPECTED,
    _ApiGroupsRequirement,
    _Check,
    _CrdRequirement,
    _NodeAmount,
    _NodeRequirement,
    _number_text,
    _StorageClassRequirement,
    _VersionRequirement,
    parse_version_range,
)
from margo.constraints.compiled import CompiledConstraints
from margo.constraints.operators import (
    _bound_test,
    _contains_test,
    _does_not_exist,
    _exists,
    _Expression,
    _in_test,
    _not_in_test,
)
from margo.constraints.pointers import _identity, _label_lookup, _pointer_lookup, parse_pointer
from margo.constraints.results import MatchResult, _is_number, _kind, _show
from margo.constraints.rules import _CharacteristicExpression, _CharacteristicRule, _Rule
from margo.constraints.vocabulary import (
    _BOUND_OPERATORS,
    _CAPACITY_FIELDS,
    _CHARACTERISTIC_FIELDS,
    _CHARACTERISTIC_RULE_FIELDS,
    _CLUSTER_FIELDS,
    _CONTAINS_OPERATORS,
    _CPU_FIELDS,
    _DEVICE_CONSTRAINT_FIELDS,
    _EXPRESSION_FIELDS,
    _EXTENDED_OPERATORS,
    _EXTENSION_FIELDS,
    _EXTENSION_KEY,
    _INTERFACE_FIELDS,
    _LEGACY_FIELDS,
    _MISSING,
    _NODE_CAPACITY_FIELDS,
    _NODE_FIELDS,
    _PERIPHERAL_FIELDS,
    _PRESENCE_OPERATORS,
    _RULE_FIELDS,
    _SELECTOR_FIELDS,
    _VALUE_OPERATORS,
    ARCHITECTURE_ALIASES,
    DRAFT_OPERATORS,
    EXTENSION,
    OPERATORS,
    Lookup,
)
from margo.errors import DocumentError, Path, Problem, short_repr
from margo.quantity import format_quantity, parse_quantity

__all__ = ["compile_constraints", "match"]


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
                           f"{subject} {operator}{shown}", items)

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
