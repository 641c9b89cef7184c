"""Validate any Margo document the way a standards body would, with located problems.

Pipeline: load (safe, bounded) → detect kind and shape → JSON Schema of that shape →
semantic checks the schema cannot express (`margo.semantics`) → normalise to the internal
model. Every problem found is reported, each with file, line, column and JSON path; a
document is returned as a model only when it has none.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastjsonschema import JsonSchemaException
from jsonschema.exceptions import ValidationError, best_match
from jsonschema.protocols import Validator

from margo.errors import DocumentError, Path, Problem, short_repr
from margo.kinds import Kind, Shape, detect
from margo.loading import Limits, LoadedDocument, load_document, load_path
from margo.normalize import normalise
from margo.schemas import hot_gate, shown_pattern, validator_for
from margo.schemas.source import APP_ID, COMPONENT_NAME, DEVICE_ID, SEMVER_UNDERSCORE, UUID
from margo.semantics import semantic_problems

__all__ = ["ValidationReport", "explain_schema_errors", "validate_document", "validate_file",
           "validate_loaded", "validate_value"]

_PATTERN_NAMES = {
    APP_ID: "an id of lower-case letters, digits and dashes (at most 200 characters)",
    COMPONENT_NAME: "a name of lower-case letters, digits and dashes",
    DEVICE_ID: "a device id of RFC 3986 unreserved characters, '/' between hierarchy levels",
    SEMVER_UNDERSCORE: "a SemVer 2.0 revision without leading 'v', build metadata after '_'",
    UUID: "a UUID",
    r"^\d+m\d+s$": "a timeout written as ##m##s, e.g. 8m30s",
    r"^oci://.+": "an OCI reference starting with oci://",
}
_TYPE_NAMES = {"object": "an object", "array": "a list", "string": "a string",
               "number": "a number", "integer": "an integer", "boolean": "true or false",
               "null": "null"}


@dataclass
class ValidationReport:
    """What `margo validate` prints for one document."""

    file: str | None
    kind: Kind | None
    shape: Shape | None
    problems: list[Problem] = field(default_factory=list)
    model: Any = None
    document: Any = None

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.file,
            "kind": str(self.kind) if self.kind else None,
            "shape": str(self.shape) if self.shape else None,
            "valid": self.valid,
            "errors": [p.to_json() for p in self.problems],
        }


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _unknown_keys(error: ValidationError) -> list[str]:
    schema = error.schema if isinstance(error.schema, dict) else {}
    known = set(schema.get("properties", {}))
    patterns = [re.compile(p) for p in schema.get("patternProperties", {})]
    instance = error.instance if isinstance(error.instance, dict) else {}
    return [k for k in instance if k not in known and not any(p.search(k) for p in patterns)]


def _unknown_key_message(key: str, known: Iterable[str], extensions_allowed: bool) -> str:
    message = f"unknown field {key!r}"
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f"{message} (did you mean {close[0]!r}?)"
    if key.startswith("x-") and extensions_allowed:
        return (f"{message}: extensions must be named x-<name>-extensions with <name> "
                "[a-z][a-z0-9-]*")
    if key.startswith("x-"):
        return f"{message}: this object does not allow extensions"
    return message


def _closest_branch(context: list[ValidationError]) -> list[ValidationError]:
    """The errors of the anyOf/oneOf branch the instance came closest to matching: branches
    whose type does not even fit are dropped, then the one with the fewest errors wins."""
    branches: dict[Any, list[ValidationError]] = {}
    for error in context:
        branches.setdefault(error.relative_schema_path[0], []).append(error)
    fitting = [errors for errors in branches.values()
               if not any(e.validator == "type" and not e.relative_path for e in errors)]
    if not fitting:
        return [best_match(context)]
    return min(fitting, key=lambda errors: (len(errors),
                                            -max(len(e.relative_path) for e in errors)))


def _problems_from_error(error: ValidationError) -> list[tuple[Problem, bool]]:
    path: Path = tuple(error.absolute_path)
    validator = error.validator
    # The instance and the keyword's value are the document's and the schema's JSON (never
    # jsonschema's Unset, which only stands in for errors built by hand).
    instance: Any = error.instance
    value: Any = error.validator_value
    if validator in ("anyOf", "oneOf") and error.context:
        if path and path[0] == "labels":
            return [(Problem(path, "a label value must be a string, number, boolean, or a list "
                                   "of strings or of numbers", expected="label value",
                             found=short_repr(instance)), False)]
        return [found for branch_error in _closest_branch(error.context)
                for found in _problems_from_error(branch_error)]
    if validator == "additionalProperties":
        schema = error.schema if isinstance(error.schema, dict) else {}
        known = schema.get("properties", {})
        extensions_allowed = bool(schema.get("patternProperties"))
        return [(Problem((*path, key), _unknown_key_message(key, known, extensions_allowed),
                         expected="one of " + ", ".join(sorted(known)) if known else None,
                         found=key), True)
                for key in _unknown_keys(error)]
    if validator == "required":
        missing = [k for k in value if isinstance(instance, dict) and k not in instance]
        # Point at the key that introduces the incomplete object, not at its first child.
        return [(Problem(path, f"missing required field {k!r}", expected=k, found=None), True)
                for k in missing]
    if validator == "const":
        message = f"expected {value!r}, found {short_repr(instance)}"
        return [(Problem(path, message, expected=repr(value), found=short_repr(instance)), False)]
    if validator == "enum":
        allowed = ", ".join(repr(v) for v in value)
        return [(Problem(path, f"expected one of {allowed}, found {short_repr(instance)}",
                         expected=allowed, found=short_repr(instance)), False)]
    if validator == "type":
        types = value if isinstance(value, list) else [value]
        expected = " or ".join(str(_TYPE_NAMES.get(t, t)) for t in types)
        found = _TYPE_NAMES.get(_json_type(instance), _json_type(instance))
        return [(Problem(path, f"expected {expected}, found {found} ({short_repr(instance)})",
                         expected=expected, found=short_repr(instance)), False)]
    if validator == "pattern":
        value = shown_pattern(value)
        expected = _PATTERN_NAMES.get(value, f"a string matching {value}")
        return [(Problem(path, f"expected {expected}, found {short_repr(instance)}",
                         expected=expected, found=short_repr(instance)), False)]
    if validator in ("minItems", "maxItems"):
        bound = "at least" if validator == "minItems" else "at most"
        return [(Problem(path, f"expected {bound} {value} item(s), found {len(instance)}",
                         expected=f"{bound} {value}", found=str(len(instance))), False)]
    return [(Problem(path, error.message, found=short_repr(instance)), False)]


def schema_problems(instance: Any, kind: Kind, shape: Shape) -> list[tuple[Problem, bool]]:
    """Every schema violation as (problem, located-at-key) pairs, in document order.

    A kind this process validates in bulk passes the compiled gate first, and only a refused
    document is explained; otherwise the explaining validator alone decides (`hot_gate`)."""
    gate = hot_gate(str(kind), str(shape))
    if gate is None:
        return explain_schema_errors(validator_for(str(kind), str(shape)), instance)
    try:
        gate(instance)
        return []
    except JsonSchemaException as refusal:
        return (explain_schema_errors(validator_for(str(kind), str(shape)), instance)
                or gate_problems(refusal, instance))


def gate_problems(refusal: JsonSchemaException, instance: Any) -> list[tuple[Problem, bool]]:
    """The fastjsonschema gate's own refusal as a problem, for when the explaining validator
    finds none. The two are built to agree (`margo.schemas.python_patterns`, and tests hold
    them to it); should they still differ, the document is refused all the same, never
    let through because the explanation came back empty."""
    parts = list(getattr(refusal, "path", None) or ["data"])[1:]  # "data" is the root
    path: list[str | int] = []
    node = instance
    for part in parts:
        key: str | int = int(part) if isinstance(node, list) and part.isdigit() else part
        path.append(key)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
    message = str(getattr(refusal, "message", refusal)).removeprefix("data")
    return [(Problem(tuple(path), f"invalid: {message.lstrip('.')}"), False)]


def explain_schema_errors(validator: Validator, instance: Any) -> list[tuple[Problem, bool]]:
    """Every violation of any JSON Schema as (problem, located-at-key) pairs; also used for
    the project's own document kinds (deployment intents)."""
    out: list[tuple[Problem, bool]] = []
    for error in validator.iter_errors(instance):
        out.extend(_problems_from_error(error))
    return out


def validate_loaded(loaded: LoadedDocument, *, expect: Kind | None = None) -> ValidationReport:
    """Validate an already-parsed document; never raises for bad content."""
    doc = loaded.value
    detection = detect(doc, expect=expect)
    report = ValidationReport(loaded.file, detection.kind, detection.shape, document=doc)
    if detection.kind is None or detection.shape is None:
        report.problems.append(loaded.locate(Problem((), detection.reason)))
        return report
    located = schema_problems(doc, detection.kind, detection.shape)
    if not located:
        located = [(p, False) for p in semantic_problems(detection.kind, detection.shape, doc)]
    seen: set[tuple[Path, str]] = set()
    for problem, at_key in located:
        if (problem.path, problem.message) in seen:
            continue
        seen.add((problem.path, problem.message))
        report.problems.append(loaded.locate(problem, at_key=at_key))
    report.problems.sort(key=lambda p: (p.line or 0, p.column or 0, p.json_path))
    if not report.problems:
        report.model = normalise(detection.kind, detection.shape, doc)
    return report


def validate_document(data: bytes | str, *, file: str | None = None,
                      expect: Kind | None = None, limits: Limits | None = None) -> ValidationReport:
    """Parse and validate bytes; unparsable input is reported as problems, not raised."""
    try:
        loaded = load_document(data, file=file, **({"limits": limits} if limits else {}))
    except DocumentError as exc:
        return ValidationReport(file, None, None, list(exc.problems))
    return validate_loaded(loaded, expect=expect)


def validate_file(path: str, *, expect: Kind | None = None) -> ValidationReport:
    """Validate a file; `OSError` propagates (unreadable is not the same as invalid)."""
    try:
        loaded = load_path(path)
    except DocumentError as exc:
        return ValidationReport(path, None, None, list(exc.problems))
    return validate_loaded(loaded, expect=expect)


def validate_value(doc: Any, *, expect: Kind | None = None, file: str | None = None) -> Any:
    """Validate already-decoded data (e.g. a JSON request body) and return its model;
    raise `DocumentError` (unlocated paths) when invalid."""
    report = validate_loaded(LoadedDocument.unlocated(doc, file), expect=expect)
    if report.problems:
        raise DocumentError(report.problems)
    return report.model
