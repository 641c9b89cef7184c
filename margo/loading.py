"""Safe, located loading of YAML and JSON documents.

Everything a device, a platform engineer or an attacker sends passes through here first,
so this module is deliberately paranoid and predictable:

* bytes must be UTF-8 (a BOM is tolerated) and at most `Limits.max_bytes` long;
* YAML is read with the YAML 1.2 core schema (`yes`/`on` stay strings, `2024-01-01` stays
  a string, `012` is twelve), so the same text means the same data in every tool;
* duplicate keys, non-scalar keys, merge keys, custom tags and non-finite numbers are
  errors, because JSON cannot represent them and they hide mistakes;
* nesting depth and alias expansion are bounded, so alias bombs and deeply nested input
  fail fast with a located error instead of exhausting memory or the stack;
* positions (line/column of every value and key) are recorded lazily: the common
  valid-document path pays nothing for them, error reporting re-reads the text once.

JSON input (text starting with `{` or `[`) is parsed by the stdlib decoder, and located
with the same YAML event reader when an error has to be reported.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from margo.errors import DocumentError, Path, Problem

__all__ = ["Limits", "LoadedDocument", "SourceMap", "load_document", "load_path",
           "strict_json_value"]

try:  # libyaml is bundled in PyYAML wheels; the pure-Python parser is the fallback.
    _Parser: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - depends on the PyYAML build
    _Parser = yaml.SafeLoader


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds that keep hostile input cheap to reject."""

    max_bytes: int = 4 * 1024 * 1024
    max_depth: int = 100
    max_alias_nodes: int = 100_000


DEFAULT_LIMITS = Limits()

# YAML 1.2 core schema, section 10.3.2.
_NULL = re.compile(r"^(?:~|null|Null|NULL|)\Z")
_BOOL_TRUE = re.compile(r"^(?:true|True|TRUE)\Z")
_BOOL_FALSE = re.compile(r"^(?:false|False|FALSE)\Z")
_INT10 = re.compile(r"^[-+]?[0-9]+\Z")
_INT8 = re.compile(r"^0o[0-7]+\Z")
_INT16 = re.compile(r"^0x[0-9a-fA-F]+\Z")
_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?\Z")
_INF_NAN = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z")

_STR_TAG = "tag:yaml.org,2002:str"
_KNOWN_TAGS = {
    _STR_TAG,
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}


class _LoadFailure(Exception):
    """Internal: one located problem that stops loading."""

    def __init__(self, path: Path, message: str, line: int, column: int):
        super().__init__(message)
        self.path, self.message, self.line, self.column = path, message, line, column


def resolve_plain_scalar(text: str) -> Any:
    """Type of an unquoted scalar under the YAML 1.2 core schema."""
    if _NULL.match(text):
        return None
    if _BOOL_TRUE.match(text):
        return True
    if _BOOL_FALSE.match(text):
        return False
    if _INT10.match(text):
        return int(text)
    if _INT8.match(text):
        return int(text[2:], 8)
    if _INT16.match(text):
        return int(text[2:], 16)
    if _FLOAT.match(text):
        return float(text)
    if _INF_NAN.match(text):
        raise ValueError(f"{text!r} is not a finite number and cannot be represented in JSON")
    return text


def _explicit_scalar(tag: str, text: str) -> Any:
    if tag == _STR_TAG:
        return text
    value = resolve_plain_scalar(text)
    expected: Any = {  # a type, or a tuple of types
        "tag:yaml.org,2002:int": int,
        "tag:yaml.org,2002:float": (int, float),
        "tag:yaml.org,2002:bool": bool,
        "tag:yaml.org,2002:null": type(None),
    }[tag]
    if isinstance(value, bool) and expected is not bool:
        raise ValueError(f"{text!r} does not match its tag {tag}")
    if not isinstance(value, expected):
        raise ValueError(f"{text!r} does not match its tag {tag}")
    return float(value) if tag.endswith(":float") else value


@dataclass
class _Frame:
    container: dict[str, Any] | list[Any]
    path: Path
    anchor: str | None
    pending_key: str | None = None
    nodes: int = 1


@dataclass
class SourceMap:
    """Line/column (1-based) of values and keys by path; built on first use."""

    text: str | None
    _values: dict[Path, tuple[int, int]] | None = None
    _keys: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def _build(self) -> None:
        if self._values is not None:
            return
        self._values = {}
        if self.text is None:
            return
        # Best effort: the document already loaded, positions are a courtesy.
        with contextlib.suppress(_LoadFailure, yaml.YAMLError, DocumentError, ValueError):
            _build_from_events(self.text, DEFAULT_LIMITS, self._values, self._keys)

    def value_position(self, path: Path) -> tuple[int, int] | None:
        """Position of the value at `path`, or of its nearest located ancestor."""
        self._build()
        assert self._values is not None
        probe = tuple(path)
        while True:
            if probe in self._values:
                return self._values[probe]
            if not probe:
                return None
            probe = probe[:-1]

    def key_position(self, path: Path) -> tuple[int, int] | None:
        """Position of the mapping key that introduces `path` (falls back to the value)."""
        self._build()
        return self._keys.get(tuple(path)) or self.value_position(path)


class _NoPositions:
    """The source map of data that never was text (e.g. an already-decoded request body)."""

    def value_position(self, path: Path) -> None:
        return None

    def key_position(self, path: Path) -> None:
        return None


@dataclass
class LoadedDocument:
    """A parsed document plus what is needed to point at any part of it."""

    value: Any
    file: str | None
    source: SourceMap

    def locate(self, problem: Problem, *, at_key: bool = False) -> Problem:
        position = (
            self.source.key_position(problem.path)
            if at_key
            else self.source.value_position(problem.path)
        )
        line, column = position if position else (None, None)
        return problem.located(file=self.file, line=line, column=column)

    @classmethod
    def unlocated(cls, value: Any, file: str | None = None) -> LoadedDocument:
        """Wrap decoded data; its problems carry paths but no line/column."""
        return cls(value, file, _NoPositions())  # type: ignore[arg-type]


def _build_from_events(
    text: str,
    limits: Limits,
    positions: dict[Path, tuple[int, int]] | None,
    key_positions: dict[Path, tuple[int, int]] | None,
) -> list[Any]:
    """Build plain Python values from YAML events without recursion; return all documents."""
    builder = _Builder(limits, positions, key_positions)
    for event in yaml.parse(text, Loader=_Parser):
        builder.take(event)
    builder.documents.extend(builder.root)
    return builder.documents


class _Builder:
    """The values of a YAML stream, built one event at a time on an explicit stack (no
    recursion, so nesting is bounded by `limits.max_depth` and not by Python's stack), with
    the positions of values and keys by path, and every limit checked as it is reached."""

    def __init__(self, limits: Limits, positions: dict[Path, tuple[int, int]] | None,
                 key_positions: dict[Path, tuple[int, int]] | None) -> None:
        self.limits, self.positions, self.key_positions = limits, positions, key_positions
        self.documents: list[Any] = []
        self.stack: list[_Frame] = []
        self.anchors: dict[str, tuple[Any, int]] = {}
        self.alias_budget = limits.max_alias_nodes
        self.root: list[Any] = []
        self.last_path: Path = ()

    def take(self, event: yaml.Event) -> None:
        """One event: the end of a document or a collection, a mapping key, or a value."""
        mark: Any = event.start_mark  # a parsed event always has one
        if isinstance(event, yaml.DocumentEndEvent):
            self.documents.extend(self.root)
            self.root.clear()
            self.anchors.clear()
        elif isinstance(event, (yaml.StreamStartEvent, yaml.StreamEndEvent,
                                yaml.DocumentStartEvent)):
            return
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            self.end_collection()
        elif self.expecting_key():
            self.key(event, mark)
        else:
            self.value(event, mark)

    def expecting_key(self) -> bool:
        return bool(self.stack) and isinstance(self.stack[-1].container, dict) and (
            self.stack[-1].pending_key is None)

    def end_collection(self) -> None:
        frame = self.stack.pop()
        if frame.anchor is not None:
            self.anchors[frame.anchor] = (frame.container, frame.nodes)
        self.attach(frame.container, frame.nodes)

    def key(self, event: yaml.Event, mark: Any) -> None:
        """A mapping key: a plain string, new in its mapping."""
        frame = self.stack[-1]
        if not isinstance(event, yaml.ScalarEvent):
            raise self.fail("mapping keys must be plain strings, not collections or aliases",
                            mark, frame.path)
        if event.tag not in (None, "!", _STR_TAG):
            raise self.fail(f"mapping key has unsupported tag {event.tag}", mark, frame.path)
        key = event.value
        if key == "<<" and event.style in (None, ""):
            raise self.fail("YAML merge keys (<<) are not supported; write the keys out",
                            mark, frame.path)
        assert isinstance(frame.container, dict)
        if key in frame.container:
            raise self.fail(f"duplicate key {key!r}", mark, (*frame.path, key))
        frame.pending_key = key
        self.last_path = (*frame.path, key)
        if self.key_positions is not None:
            self.key_positions[self.last_path] = (mark.line + 1, mark.column + 1)

    def value(self, event: yaml.Event, mark: Any) -> None:
        """A value where the stack expects one: an alias, a scalar or a new collection."""
        path = self.child_path()
        self.last_path = path
        if self.positions is not None:
            self.positions[path] = (mark.line + 1, mark.column + 1)
        if isinstance(event, yaml.AliasEvent):
            self.alias(event, mark)
        elif isinstance(event, yaml.ScalarEvent):
            self.scalar(event, mark)
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            self.start_collection(event, mark, path)

    def alias(self, event: yaml.AliasEvent, mark: Any) -> None:
        if event.anchor not in self.anchors:
            raise self.fail(f"unknown alias *{event.anchor}", mark)
        value, nodes = self.anchors[event.anchor]
        self.alias_budget -= nodes
        if self.alias_budget < 0:
            raise self.fail(
                f"aliases expand to more than {self.limits.max_alias_nodes} nodes "
                "(an alias bomb?)", mark)
        self.attach(copy.deepcopy(value), nodes)

    def scalar(self, event: yaml.ScalarEvent, mark: Any) -> None:
        tag = event.tag
        try:
            if tag in (None, "!") and event.implicit[0] and not event.style:
                value = resolve_plain_scalar(event.value)
            elif tag in (None, "!"):
                value = event.value
            elif tag in _KNOWN_TAGS:
                value = _explicit_scalar(tag, event.value)
            else:
                raise ValueError(f"unsupported YAML tag {tag}")
        except ValueError as exc:
            raise self.fail(str(exc), mark) from None
        if event.anchor is not None:
            self.anchors[event.anchor] = (value, 1)
        self.attach(value, 1)

    def start_collection(self, event: yaml.CollectionStartEvent, mark: Any,
                         path: Path) -> None:
        if event.tag not in (None, "!", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"):
            raise self.fail(f"unsupported YAML tag {event.tag}", mark)
        if len(self.stack) >= self.limits.max_depth:
            raise self.fail(f"nesting deeper than {self.limits.max_depth} levels", mark)
        container: dict[str, Any] | list[Any] = (
            {} if isinstance(event, yaml.MappingStartEvent) else []
        )
        self.stack.append(_Frame(container, path, event.anchor))

    def attach(self, value: Any, nodes: int) -> None:
        """Place a finished value in its parent (its path is `child_path()`, taken when
        the value began)."""
        if not self.stack:
            self.root.append(value)
            return
        frame = self.stack[-1]
        frame.nodes += nodes
        if isinstance(frame.container, list):
            frame.container.append(value)
            return
        key = frame.pending_key
        assert key is not None
        frame.container[key] = value
        frame.pending_key = None

    def child_path(self) -> Path:
        if not self.stack:
            return ()
        frame = self.stack[-1]
        if isinstance(frame.container, list):
            return (*frame.path, len(frame.container))
        return (*frame.path, frame.pending_key or "")

    def fail(self, message: str, mark: Any, path: Path | None = None) -> _LoadFailure:
        return _LoadFailure(path if path is not None else self.last_path, message,
                            mark.line + 1, mark.column + 1)


def _decode(data: bytes, limits: Limits) -> str:
    if len(data) > limits.max_bytes:
        raise _LoadFailure((), f"document is {len(data)} bytes; the limit is {limits.max_bytes}",
                           1, 1)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise _LoadFailure((), f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                               f"{exc.start})", line, column) from None
    if "\x00" in text:
        offset = text.index("\x00")
        line = text.count("\n", 0, offset) + 1
        raise _LoadFailure((), "NUL character in text document", line,
                           offset - (text.rfind("\n", 0, offset) + 1) + 1)
    return text


def _check_json_value(value: Any, limits: Limits) -> None:
    """Depth bound for JSON input (the decoder itself bounds recursion, not depth).
    Only containers are visited, so scalars cost nothing."""
    if not isinstance(value, (dict, list)):
        return
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > limits.max_depth:
            raise _LoadFailure((), f"nesting deeper than {limits.max_depth} levels", 1, 1)
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                todo.append((child, depth + 1))


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number and cannot be represented in JSON")


def _load_json(text: str, limits: Limits) -> Any:
    try:
        value = json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise _LoadFailure((), f"invalid JSON: {exc.msg}", exc.lineno, exc.colno) from None
    except RecursionError:
        raise _LoadFailure((), f"nesting deeper than {limits.max_depth} levels", 1, 1) from None
    except ValueError as exc:
        # Duplicate keys / constants: locate them with the YAML reader, which knows positions.
        try:
            _build_from_events(text, limits, None, None)
        except _LoadFailure:
            raise
        except yaml.YAMLError:
            pass
        raise _LoadFailure((), str(exc), 1, 1) from None
    _check_json_value(value, limits)
    return value


def strict_json_value(text: str, *, max_depth: int) -> Any:
    """`text` decoded as `load_document` decodes JSON (no duplicate key, no non-finite
    number, at most `max_depth` levels of containers), without locating a failure: a
    ValueError says what failed. Why: a reader of one part of a larger JSON document
    (`compiler.snapshot` reads a keyed capability file member by member) checks each part
    as the whole would be checked, and reads the whole the ordinary way when a part fails,
    which locates the fault."""
    try:
        value = json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
        _check_json_value(value, Limits(max_depth=max_depth))
    except (_LoadFailure, RecursionError) as exc:
        raise ValueError(str(exc) or "nesting too deep") from None
    return value


def load_document(
    data: bytes | str,
    *,
    file: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> LoadedDocument:
    """Parse exactly one YAML or JSON document, or raise `DocumentError` with its location."""
    try:
        text = data if isinstance(data, str) else _decode(data, limits)
        if isinstance(data, str) and len(data.encode("utf-8", "surrogatepass")) > limits.max_bytes:
            raise _LoadFailure((), f"document is larger than the limit of {limits.max_bytes} "
                                   "bytes", 1, 1)
        if text.lstrip()[:1] in ("{", "["):
            value = _load_json(text, limits)
            return LoadedDocument(value, file, SourceMap(text))
        documents = _build_from_events(text, limits, None, None)
    except _LoadFailure as exc:
        raise DocumentError([Problem(exc.path, exc.message, file, exc.line, exc.column)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(part for part in (exc.context, exc.problem) if part) or str(exc)
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise DocumentError([Problem((), f"invalid YAML: {message}", file, line, column)]) from None
    except yaml.YAMLError as exc:  # reader errors (e.g. control characters) carry no mark
        raise DocumentError([Problem((), f"invalid YAML: {exc}", file, 1, 1)]) from None
    if len(documents) != 1:
        found = "no document" if not documents else f"{len(documents)} documents"
        raise DocumentError([Problem((), f"expected exactly one document, found {found}",
                                     file, 1, 1)])
    return LoadedDocument(documents[0], file, SourceMap(text))


def load_path(path: str, *, limits: Limits = DEFAULT_LIMITS) -> LoadedDocument:
    """Read and parse a file; `OSError` propagates so callers can tell unreadable from invalid."""
    with open(path, "rb") as handle:
        data = handle.read(limits.max_bytes + 1)
    return load_document(data, file=path, limits=limits)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        not isinstance(value, float) or math.isfinite(value)
    )
