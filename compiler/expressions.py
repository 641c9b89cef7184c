"""Sandboxed Jinja2 expressions in deployment-intent parameter values, evaluated per device.

An intent's parameter value is either a literal or a Jinja2 expression evaluated against ONE
device's capability document, exposed as the variable `device`
(`{"id", "properties", "labels", "extensions"}`, see `device_context`):

    "{{ [device.labels['example.com/nodes'] | int, 2] | min }}"    -> 2        (native int)
    "site-{{ device.labels['example.com/site'] }}"                  -> "site-x"  (text)

Threat model. Platform engineers write these expressions; the fleet server evaluates them for
thousands of devices. An expression must never reach files, the network, Python object
internals (`''.__class__.__mro__`, `device.labels.get.__self__`, template `self`), nor exhaust
the server's CPU or memory. Hence, in layers:

* `jinja2.sandbox.ImmutableSandboxedEnvironment`, no loader (no include/import/extends),
  no extensions, autoescape off, `StrictUndefined` (a missing key is an error naming it,
  never a silent empty string).
* Only `{{ expressions }}`: statement blocks, `{% raw %}` and comments are rejected by the
  lexer at compile time; the names `self`, `loop`, `caller`, `varargs`, `kwargs`, `super` and
  attributes starting with `_` are rejected in the parsed tree.
* Whitelists for everything callable: the filters and tests below, two globals (`range`,
  capped at 10,000 items, and `dict`), and a few side-effect-free methods of data values
  (`str.lower/upper/strip/split/startswith/...`, `dict.get/keys/values/items`,
  `list.index/count`). `str.format`, `%`-formatting of strings and padding methods are out:
  they allocate arbitrary widths.
* Resource bounds. Per operation: `*` on strings/lists produces at most 10,000
  characters/items (nested content counts), `**` at most 2**64 in magnitude (integer
  exponents <= 64), `range` at most 10,000 items, `round` precision +-20, `tojson` indent
  <= 8. Per render, two budgets: 25,000 steps (every filter/test/method call, plus the
  length of its operand and every item a lazy filter such as `map` yields), so a chain of
  `map`s cannot burn CPU; and 262,144 characters/items built by `range`, `*`, `+`, `join`,
  `replace`, `tojson` and `dict`, so `replace`/`join` cannot blow up memory. Results hold at
  most 10,000 items and 65,536 characters; expression source is at most 16 KiB. Jinja's
  compile-time constant folding is off, so (bar literal-only pieces of text templates, still
  under the per-operation caps) nothing is evaluated outside these budgets.
* Every failure — syntax, undefined, sandbox, arithmetic, limits, recursion — surfaces as
  `ExpressionError` (a `ValueError`) with a concise message and, when known, a 1-based
  line/column within the expression text.

Allowed filters: abs, bool (strict: True/False or exactly "true"/"false"), capitalize, count,
d, default, first, float (strict: unconvertible input is an error unless a default is given),
gib (bytes -> GiB float), int (strict, like float), join, last, length, list, lower, map, max,
min, quantity ("59 Gi" -> bytes as int, rounded up), reject, rejectattr, replace, reverse,
round (precision within +-20), select, selectattr, sort, string (non-strings as JSON), sum
(numbers only), title, tojson (plain JSON, sorted keys, indent <= 8), trim, unique, upper.

Allowed tests: defined, undefined, none, boolean, integer, float, number, string, sequence,
mapping, even, odd, divisibleby, eq/==, ne/!=, lt/<, le/<=, gt/>, ge/>=, in.

Rendering: a string that is exactly one `{{ expression }}` (surrounding whitespace allowed)
renders to the expression's native value (int, float, bool, None, str, list, dict); any other
template renders to text, where non-string values are written as JSON (`true`, `null`,
`[1, 2]`), as they are by `~` and the `string` filter (`"v" ~ true` is `"vtrue"`: the
values end up in YAML/Helm, where Python's `True`/`None` would be wrong). Literals —
non-strings and strings without `{{`, `{%` or `{#` — pass through unchanged; lists, tuples
and mappings are walked so the expression strings inside them are evaluated (mapping keys
never are). Compiled templates are cached per source string.

Layout: this module is the sandbox and the compiler of expressions; what an expression may
call is `compiler.expression_functions`, and the limits, budgets and the conversion of
results to data are `compiler.expression_limits`.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from functools import lru_cache
from typing import Any, Final, cast

from jinja2 import nodes
from jinja2.exceptions import (
    SecurityError,
    TemplateError,
    TemplateSyntaxError,
    UndefinedError,
)
from jinja2.runtime import Context, StrictUndefined, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

from compiler.expression_functions import (
    BINARY_OPERATORS,
    GLOBALS,
    TEST_NAMES,
    allowed_attributes,
    build_filters,
    build_tests,
)
from compiler.expression_limits import (
    MAX_DEPTH,
    MAX_RESULT_CHARS,
    MAX_SOURCE_CHARS,
    RENDER_STATE,
    ExpressionError,
    RenderState,
    cost_of,
    kind_of,
    spend_steps,
    text_of,
    to_data,
)

__all__ = [
    "CompiledValue",
    "ExpressionError",
    "compile_value",
    "device_context",
    "is_expression",
]

_RESERVED_NAMES: Final = frozenset({"self", "loop", "caller", "varargs", "kwargs", "super"})
_FORBIDDEN_TOKENS: Final = {
    "block_begin": "statement blocks",
    "raw_begin": "raw blocks",
    "comment_begin": "comments",
    "linestatement_begin": "line statements",
    "linecomment_begin": "line comments",
}
_ONLY_EXPRESSIONS: Final = "only {{ expressions }} are allowed"


def is_expression(value: object) -> bool:
    """True for strings that contain template syntax (`{{`, or the forbidden `{%`/`{#`)."""
    return isinstance(value, str) and ("{{" in value or "{%" in value or "{#" in value)


# --------------------------------------------------------------------------------------------
# Helpful messages for missing keys


def _segment(key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f".{key}"
    return f"[{key!r}]"


def _path_of(target: Any, context: Mapping[str, Any] | None) -> str | None:
    """Where `target` sits in the render context (`device.labels`), by identity; bounded."""
    if context is None:
        return None
    queue: deque[tuple[str, Any]] = deque((str(name), value) for name, value in context.items())
    seen = 0
    while queue and seen < 10_000:
        path, value = queue.popleft()
        seen += 1
        if value is target:
            return path
        if isinstance(value, Mapping):
            children: Any = value.items()
        elif isinstance(value, list | tuple):
            children = enumerate(value)
        else:
            continue
        for key, child in children:
            if isinstance(child, Mapping | list | tuple):
                queue.append((path + _segment(key), child))
    return None


def _preview_keys(mapping: Mapping[Any, Any]) -> str:
    if not mapping:
        return " (it is empty)"
    keys = sorted(mapping, key=str)
    shown = ", ".join(repr(key) for key in keys[:10])
    more = f", ... ({len(keys)} keys)" if len(keys) > 10 else ""
    return f"; it has {shown}{more}"


def _missing_message(obj: Any, name: Any) -> str:
    state = RENDER_STATE.get()
    context = state.context if state is not None else None
    if obj is missing:
        names = sorted({*(context or {}), *_ENV.globals})
        return f"unknown name {name!r} (available: {', '.join(names)})"
    where = _path_of(obj, context) or kind_of(obj)
    if isinstance(obj, Mapping):
        return f"{where} has no key {name!r}{_preview_keys(obj)}"
    if isinstance(obj, list | tuple | str) and isinstance(name, int):
        return f"{where} has no item {name} (it has {len(obj)})"
    if not isinstance(name, str):
        return f"{where} has no item {name!r}"
    return f"{where} has no attribute {name!r}"


class _Undefined(StrictUndefined):
    """StrictUndefined whose message names the path: `device.labels has no key 'x'`."""

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        if self._undefined_hint:
            return self._undefined_hint
        return _missing_message(self._undefined_obj, self._undefined_name)


# --------------------------------------------------------------------------------------------
# The sandbox (what it may call: `compiler.expression_functions`)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, narrowed to whitelists, metered, with data-first attribute access."""

    intercepted_binops = frozenset(BINARY_OPERATORS)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return attr in allowed_attributes(obj) and super().is_safe_attribute(obj, attr, value)

    def wrap_str_format(self, value: Any) -> None:
        # The sandbox would hand out a wrapped str.format here, bypassing is_safe_attribute;
        # format widths ("{:>999999999}") allocate at will, so it stays unavailable.
        return None

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        allowed = sorted(allowed_attributes(obj))
        hint = f"attribute {attribute!r} of {kind_of(obj)} is not allowed"
        if allowed:
            hint += f" (allowed: {', '.join(allowed)})"
        return self.undefined(hint, obj=obj, name=attribute, exc=SecurityError)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # Data first: `device.properties.items` is the key "items" if there is one.
        if type(obj) is dict:
            try:
                return obj[attribute]
            except KeyError:
                pass
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return BINARY_OPERATORS[operator](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        spend_steps(cost_of(getattr(__obj, "__self__", None)))
        return super().call(__context, __obj, *args, **kwargs)


def _make_environment() -> _Environment:
    env = _Environment(
        undefined=_Undefined,
        autoescape=False,
        loader=None,
        finalize=text_of,
        optimized=False,
        keep_trailing_newline=True,
        cache_size=0,
    )
    env.filters = build_filters()
    env.tests = cast(Any, build_tests())  # (typeshed types them as plain functions)
    env.globals.clear()
    env.globals.update(GLOBALS)
    return env


_ENV: Final = _make_environment()
ALLOWED_FILTERS: Final = tuple(_ENV.filters)
ALLOWED_TESTS: Final = tuple(TEST_NAMES)


# --------------------------------------------------------------------------------------------
# Compiling

_UNKNOWN_NAMED = re.compile(r"No (filter|test) named '([^']*)'")


def _unknown_message(kind: str, name: str) -> str:
    allowed = ALLOWED_FILTERS if kind == "filter" else ALLOWED_TESTS
    return f"{kind} {name!r} is unknown or not allowed (allowed: {', '.join(allowed)})"


def _translate(exc: BaseException) -> ExpressionError:
    """Every failure as a concise ExpressionError."""
    if isinstance(exc, ExpressionError):
        return exc
    line = getattr(exc, "lineno", None) if isinstance(exc, TemplateSyntaxError) else None
    text = exc.message if isinstance(exc, TemplateError) and exc.message else str(exc)
    unknown = _UNKNOWN_NAMED.search(text) if isinstance(exc, TemplateError) else None
    if unknown:
        message = _unknown_message(*unknown.groups())
    elif isinstance(exc, TemplateSyntaxError):
        message = f"syntax error: {text}"
    elif isinstance(exc, UndefinedError | SecurityError):
        message = text
    elif isinstance(exc, ZeroDivisionError):
        message = "division by zero"
    elif isinstance(exc, RecursionError):
        message = "expression is nested too deeply"
    elif isinstance(exc, OverflowError):
        message = f"number out of range: {text}"
    elif isinstance(exc, MemoryError):
        message = "expression needs too much memory"
    elif isinstance(exc, TemplateError | TypeError | ValueError | LookupError | ArithmeticError):
        message = text or type(exc).__name__
    else:
        message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return ExpressionError(message, line)


def _position(source: str, offset: int) -> tuple[int, int]:
    line = source.count("\n", 0, offset) + 1
    return line, offset - (source.rfind("\n", 0, offset) + 1) + 1


def _reject_statements(source: str) -> None:
    """Refuse {% %}, {# #}, raw blocks: the lexer tells them from `"{%"` inside a string."""
    delimiter_counts = {"{%": 0, "{#": 0}
    for lineno, token, value in _ENV.lex(source):
        what = _FORBIDDEN_TOKENS.get(token)
        if what is not None:
            delimiter = value[:2]
            # The lexer only drops whitespace, so the offending delimiter is the next
            # occurrence after those inside earlier tokens.
            offset = -1
            for _ in range(delimiter_counts.get(delimiter, 0) + 1):
                offset = source.find(delimiter, offset + 1)
            line, column = _position(source, offset) if offset >= 0 else (lineno, None)
            raise ExpressionError(f"{what} are not allowed: {_ONLY_EXPRESSIONS}", line, column)
        for delimiter in delimiter_counts:
            delimiter_counts[delimiter] += value.count(delimiter)


def _prepare_tree(tree: nodes.Template) -> None:
    """Refuse reserved names and private attributes; make `~` write values as JSON."""
    if any(not isinstance(node, nodes.Output) for node in tree.body):
        raise ExpressionError(_ONLY_EXPRESSIONS)
    for name in tree.find_all(nodes.Name):
        if name.name in _RESERVED_NAMES:
            raise ExpressionError(
                f"name {name.name!r} is not available in expressions", name.lineno
            )
    for node in tree.find_all((nodes.Filter, nodes.Test)):
        # Also in branches never taken, where Jinja would only complain at run time.
        kind = "filter" if isinstance(node, nodes.Filter) else "test"
        if node.name not in (_ENV.filters if kind == "filter" else _ENV.tests):
            raise ExpressionError(_unknown_message(kind, node.name), node.lineno)
    for concat in tree.find_all(nodes.Concat):
        # `~` writes non-strings as JSON too ("v" ~ true == "vtrue"), like {{ }} does.
        concat.nodes = [
            nodes.Filter(node, "string", [], [], None, None, lineno=node.lineno)
            for node in concat.nodes
        ]
    for attribute in tree.find_all(nodes.Getattr):
        if attribute.attr.startswith("_"):
            raise ExpressionError(
                f"attribute {attribute.attr!r} is not allowed "
                f"(write ['{attribute.attr}'] to read a key starting with '_')",
                attribute.lineno,
            )


def _single_expression(tree: nodes.Template) -> nodes.Expr | None:
    """The expression node if the template is exactly one `{{ }}` plus whitespace."""
    if len(tree.body) != 1:
        return None
    parts = [
        node
        for node in cast(nodes.Output, tree.body[0]).nodes
        if not (isinstance(node, nodes.TemplateData) and not node.data.strip())
    ]
    if len(parts) == 1 and not isinstance(parts[0], nodes.TemplateData):
        return parts[0]
    return None


Renderer = Callable[[Mapping[str, Any]], Any]


def _new_frame(context: Mapping[str, Any]) -> Context:
    # What Template.new_context does, minus copying the globals out of a ChainMap twice per
    # call (a third of the render time of a simple expression).
    return Context(_ENV, {**_ENV.globals, **context}, None, {})


def _expression_renderer(expression: nodes.Expr) -> Renderer:
    store = nodes.Name("result", "store", lineno=expression.lineno)
    body = nodes.Template([nodes.Assign(store, expression, lineno=expression.lineno)], lineno=1)
    body.set_environment(_ENV)
    root = _ENV.from_string(body).root_render_func

    def render(context: Mapping[str, Any]) -> Any:
        frame = _new_frame(context)
        for _ in root(frame):
            pass
        return to_data(frame.vars["result"])

    return render


def _text_renderer(tree: nodes.Template) -> Renderer:
    root = _ENV.from_string(tree).root_render_func

    def render(context: Mapping[str, Any]) -> str:
        text = "".join(root(_new_frame(context)))
        if len(text) > MAX_RESULT_CHARS:
            raise ExpressionError(f"result is longer than {MAX_RESULT_CHARS} characters")
        return text

    return render


def _translating(renderer: Renderer) -> Renderer:
    def render(context: Mapping[str, Any]) -> Any:
        try:
            return renderer(context)
        except Exception as exc:
            raise _translate(exc) from exc

    return render


@lru_cache(maxsize=4096)
def _compile_source(source: str) -> Renderer:
    """Compile one expression string (cached: an intent renders for thousands of devices)."""
    try:
        if len(source) > MAX_SOURCE_CHARS:
            raise ExpressionError(
                f"expression is {len(source)} characters long; at most {MAX_SOURCE_CHARS}"
            )
        _reject_statements(source)
        tree = _ENV.parse(source)
        _prepare_tree(tree)
        tree.set_environment(_ENV)
        expression = _single_expression(tree)
        if expression is not None:
            return _translating(_expression_renderer(expression))
        return _translating(_text_renderer(tree))
    except Exception as exc:
        raise _translate(exc) from exc


def _compile(value: object, depth: int = 0) -> Renderer | None:
    """A renderer for `value`, or None when it is a plain literal."""
    if isinstance(value, str):
        if not is_expression(value):
            return None
        return _compile_source(value)
    if not isinstance(value, Mapping | list | tuple):
        return None
    if depth >= MAX_DEPTH:
        raise ExpressionError(f"value is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        entries = list(value.items())
        renderers = [_located(key, item, depth) for key, item in entries]
        if all(renderer is None for renderer in renderers):
            return None
        return _mapping_renderer(entries, renderers)
    renderers = [_located(index, item, depth) for index, item in enumerate(value)]
    if all(renderer is None for renderer in renderers):
        return None
    return _sequence_renderer(list(value), renderers, type(value) is tuple)


def _located(key: Any, item: object, depth: int) -> Renderer | None:
    try:
        return _compile(item, depth + 1)
    except ExpressionError as error:
        raise error._at(f"[{key!r}]") from None


def _mapping_renderer(entries: list[tuple[Any, Any]], renderers: list[Renderer | None]) -> Renderer:
    def render(context: Mapping[str, Any]) -> dict[Any, Any]:
        result = {}
        for (key, item), renderer in zip(entries, renderers, strict=True):
            if renderer is None:
                result[key] = item
                continue
            try:
                result[key] = renderer(context)
            except ExpressionError as error:
                raise error._at(f"[{key!r}]") from None
        return result

    return render


def _sequence_renderer(
    items: list[Any], renderers: list[Renderer | None], as_tuple: bool
) -> Renderer:
    def render(context: Mapping[str, Any]) -> list[Any] | tuple[Any, ...]:
        result = []
        for index, (item, renderer) in enumerate(zip(items, renderers, strict=True)):
            if renderer is None:
                result.append(item)
                continue
            try:
                result.append(renderer(context))
            except ExpressionError as error:
                raise error._at(f"[{index}]") from None
        return tuple(result) if as_tuple else result

    return render


#: What an expression reads of `device`: (section, key) pairs, key None for the whole
#: section ("id" is a section of its own). None: it reads `device` some other way.
Reads = frozenset[tuple[str, str | None]]
_SECTIONS: Final = frozenset({"id", "properties", "labels", "extensions"})
#: Keys that `device.labels['k']` may resolve to a method of the mapping when the key is
#: missing (Jinja falls back to attributes), so their result is not a function of the value.
_MAPPING_ATTRIBUTES: Final = frozenset(dir(dict))


def _section_of(node: nodes.Node) -> str | None:
    """`device.<section>` or `device['<section>']` → the section name."""
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name):
        name, section = node.node.name, node.attr
    elif (isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name)
          and isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)):
        name, section = node.node.name, node.arg.value
    else:
        return None
    return section if name == "device" and section in _SECTIONS else None


@lru_cache(maxsize=4096)
def _source_reads(source: str) -> Reads | None:
    """The parts of `device` one expression string reads, when every use of the name is
    `device.<section>` (or `device.<section>['<key>']`, key-level); else None."""
    tree = _ENV.parse(source)
    uses = sum(1 for name in tree.find_all(nodes.Name) if name.name == "device")
    sections: dict[int, str] = {}  # id(section node) -> section, found from their parents
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        section = _section_of(node)
        if section is not None:
            sections[id(node)] = section
    if len(sections) != uses:
        return None
    reads: set[tuple[str, str | None]] = set()
    keyed: set[int] = set()
    for node in tree.find_all(nodes.Getitem):
        section = sections.get(id(node.node))
        if (section is not None and section != "id" and isinstance(node.arg, nodes.Const)
                and isinstance(node.arg.value, str)
                and node.arg.value not in _MAPPING_ATTRIBUTES):
            reads.add((section, node.arg.value))
            keyed.add(id(node.node))
    reads.update((section, None) for node_id, section in sections.items()
                 if node_id not in keyed)
    return frozenset(reads)


def _value_reads(value: object, depth: int = 0) -> Reads | None:
    """The union of `_source_reads` over every expression string in a (nested) value."""
    if isinstance(value, str):
        return _source_reads(value) if is_expression(value) else frozenset()
    if depth >= MAX_DEPTH or not isinstance(value, Mapping | list | tuple):
        return frozenset()
    reads: set[tuple[str, str | None]] = set()
    for item in value.values() if isinstance(value, Mapping) else value:
        found = _value_reads(item, depth + 1)
        if found is None:
            return None
        reads |= found
    return frozenset(reads)


@dataclass(frozen=True)
class CompiledValue:
    """A parameter value ready to render per device. Construct with `compile_value`.

    Literal parts are returned as they are (the same objects, shared between renders: do not
    mutate them); expression strings, also inside lists and mappings, are evaluated.
    """

    source: object
    _renderer: Renderer | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._renderer is None:
            object.__setattr__(self, "_renderer", _compile(self.source))

    @property
    def reads(self) -> Reads | None:
        """What the value reads of `device`: (section, key) pairs, key None for a whole
        section; None when that cannot be told from the expressions. The expressions are
        pure functions of what they read (no randomness, clock or I/O is reachable), so
        devices that agree on it get the same value."""
        return _value_reads(self.source) if self._renderer is not None else frozenset()

    @property
    def is_literal(self) -> bool:
        """True when the value contains no expression (it renders the same for every device)."""
        return self._renderer is None

    def render(self, context: Mapping[str, Any]) -> Any:
        """The value for one device; `context` is e.g. `{"device": device_context(...)}`."""
        renderer = self._renderer
        if renderer is None:
            return self.source
        token = RENDER_STATE.set(RenderState(context))
        try:
            return renderer(context)
        except ExpressionError:
            raise
        except Exception as exc:  # pragma: no cover - leaf renderers already translate
            raise _translate(exc) from exc
        finally:
            RENDER_STATE.reset(token)


def compile_value(value: object) -> CompiledValue:
    """Compile a parameter value; raises ExpressionError for syntax errors and forbidden
    constructs (statements, comments, unknown filters, reserved names, private attributes)."""
    try:
        return CompiledValue(value)
    except ExpressionError:
        raise
    except Exception as exc:
        raise _translate(exc) from exc


# --------------------------------------------------------------------------------------------
# The `device` variable


def _plain(value: Any, path: str, depth: int) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ExpressionError(f"{path} is not a finite number: {value!r}")
        return value
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ExpressionError(f"{path} is not a finite number: {value!r}")
        return int(value) if value == value.to_integral_value() else float(value)
    if depth >= MAX_DEPTH:
        raise ExpressionError(f"{path} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ExpressionError(f"{path} has a non-string key {key!r}")
            result[key] = _plain(item, path + _segment(key), depth + 1)
        return result
    if isinstance(value, list | tuple):
        return [_plain(item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value)]
    raise ExpressionError(f"{path} is not JSON-like data: a {type(value).__name__}")


def device_context(
    device_id: str,
    properties: Mapping[str, Any],
    labels: Mapping[str, Any],
    extensions: Mapping[str, Any],
) -> dict[str, Any]:
    """The `device` variable: plain deep copies of one device's capability document."""
    if not isinstance(device_id, str):
        raise ExpressionError(f"device id must be a string, found {device_id!r}")
    context: dict[str, Any] = {"id": device_id}
    for name, value in (("properties", properties), ("labels", labels), ("extensions", extensions)):
        if not isinstance(value, Mapping):
            raise ExpressionError(f"device.{name} must be a mapping, found {kind_of(value)}")
        context[name] = _plain(value, f"device.{name}", 1)
    return context
