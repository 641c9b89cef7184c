"""Deployment parameters turned into per-component configuration: Helm values and Compose env.

An ApplicationDeployment's `spec.parameters` maps a parameter name to
`{"value": ..., "targets": [{"pointer": ..., "components": [...]}]}`. Each target names the
components it configures and a *pointer* whose meaning depends on the component type.

**Helm** pointers use the key syntax of `helm install --set` (the spec says "as for
`helm install --set`"):

* dots separate map keys; `name[0]` (and `name[0][1]`, `name[0].sub`) index lists;
* `\\.`, `\\\\`, `\\,`, `\\=`, `\\[` and `\\]` are a literal dot, backslash, comma, equals
  sign and bracket inside a key (`nodeSelector.kubernetes\\.io/role`); any other escape, a
  trailing lone backslash, an unescaped `,` or `=` (which `--set` would split on), empty
  keys (`a..b`, a leading or trailing dot), unbalanced brackets and negative, non-numeric
  or too large indices (over 65536, Helm's own limit) are errors;
* writing `name[3]` into a missing or shorter list pads it with `None`, as Helm does.

Values are set *typed*: the parameter value itself (deep-copied), never re-parsed from text,
so `"4"` stays a string and `4` an integer (the reason we build values files rather than
`--set` strings). Parameters are applied in sorted-name order so the tree is deterministic.
Unlike `--set`, which lets the last write silently win, two targets that disagree are an
error naming both pointers: one setting `a` to a value while another writes `a.b`, one
using `a` as a list (`a[0]`) and another as a map (`a.b`), or two different values for the
same key. Two targets writing the same value to the same key are fine.

**Compose** pointers are environment variable names (`ADMIN_NAME`; the older spelling
`ENV.ADMIN_NAME` is accepted and means the same variable), matching
`[A-Za-z_][A-Za-z0-9_]*`. Environment values are text, so values are rendered by
`env_string`:

* `True`/`False` -> `"true"`/`"false"` (YAML/JSON spelling, not Python's `True`);
* integers -> decimal digits; floats -> Python's shortest round-trip `repr` (`"0.5"`,
  `"1e-07"`); non-finite floats are refused;
* strings as they are; `None` -> `""` (the variable is set, but empty);
* lists (array parameters) and mappings -> compact JSON text
  (`json.dumps(..., separators=(",", ":"), ensure_ascii=False, sort_keys=True)`), so an
  application can parse them back unambiguously;
* anything else (dates, bytes, ...) is a `TypeError`, and text containing NUL (which no
  process environment can hold) a `ValueError`.

Two parameters giving the same variable different text are an error; the same text is fine.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from margo.errors import short_repr
from margo.parameters import same_value

__all__ = [
    "MAX_HELM_INDEX",
    "compose_environment",
    "compose_variable_name",
    "env_string",
    "format_helm_pointer",
    "helm_values",
    "parse_helm_pointer",
    "set_helm_value",
]

#: Largest list index a Helm pointer may use (Helm's strvals refuses larger ones too): keeps
#: a pointer like `a[999999999]` from allocating a huge list.
MAX_HELM_INDEX: Final = 65536

_ESCAPABLE: Final = frozenset(".\\,=[]")
_KEY_END: Final = frozenset(".[")
_DIGITS: Final = re.compile(r"[0-9]+")
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

HelmPath = tuple[str | int, ...]


# --------------------------------------------------------------------------- Helm pointers


def _pointer_error(pointer: str, reason: str, position: int) -> ValueError:
    return ValueError(f"invalid Helm pointer {pointer!r}: {reason} at position {position}")


def _read_key(pointer: str, start: int) -> tuple[str, int]:
    """Scan one (unescaped) map key starting at `start`; returns (key, position after it)."""
    chars: list[str] = []
    i = start
    while i < len(pointer) and pointer[i] not in _KEY_END:
        char = pointer[i]
        if char == "\\":
            if i + 1 == len(pointer):
                raise _pointer_error(pointer, "trailing lone backslash", i)
            if pointer[i + 1] not in _ESCAPABLE:
                raise _pointer_error(
                    pointer, f"unknown escape '\\{pointer[i + 1]}' (only \\. \\\\ \\, \\= "
                    "\\[ \\] are allowed)", i)
            chars.append(pointer[i + 1])
            i += 2
            continue
        if char == "]":
            raise _pointer_error(pointer, "unbalanced ']'", i)
        if char in ",=":
            raise _pointer_error(pointer, f"unescaped {char!r} (write '\\{char}')", i)
        chars.append(char)
        i += 1
    if not chars:
        raise _pointer_error(pointer, "empty key", start)
    return "".join(chars), i


def _read_index(pointer: str, start: int) -> tuple[int, int]:
    """Scan `[digits]` starting at the `[` at `start`; returns (index, position after `]`)."""
    close = pointer.find("]", start)
    if close < 0:
        raise _pointer_error(pointer, "unbalanced '['", start)
    text = pointer[start + 1 : close]
    if not _DIGITS.fullmatch(text):
        raise _pointer_error(
            pointer, f"list index must be a non-negative integer, found {text!r}", start)
    index = int(text)
    if index > MAX_HELM_INDEX:
        raise _pointer_error(
            pointer, f"list index {index} is greater than the maximum {MAX_HELM_INDEX}", start)
    return index, close + 1


def parse_helm_pointer(pointer: str) -> HelmPath:
    """`a.b\\.c[0].d` -> `("a", "b.c", 0, "d")`; raises ValueError saying what is wrong."""
    if not isinstance(pointer, str):
        raise ValueError(f"a Helm pointer must be a string, found {short_repr(pointer)}")
    if not pointer:
        raise ValueError("invalid Helm pointer '': it is empty")
    parts: list[str | int] = []
    i = 0
    while True:
        key, i = _read_key(pointer, i)
        parts.append(key)
        while i < len(pointer) and pointer[i] == "[":
            index, i = _read_index(pointer, i)
            parts.append(index)
        if i == len(pointer):
            return tuple(parts)
        if pointer[i] != ".":
            raise _pointer_error(pointer, f"expected '.' or '[' after ']', found {pointer[i]!r}",
                                 i)
        i += 1


def _escape_key(key: str) -> str:
    return "".join("\\" + char if char in _ESCAPABLE else char for char in key)


def format_helm_pointer(path: HelmPath) -> str:
    """The inverse of `parse_helm_pointer`: `("a", "b.c", 0)` -> `a.b\\.c[0]`."""
    if not path or not isinstance(path[0], str):
        raise ValueError(f"a Helm path must start with a map key, found {path!r}")
    out: list[str] = []
    for part in path:
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise ValueError(f"Helm path parts are keys or indices, found {part!r}")
        if isinstance(part, int):
            if not 0 <= part <= MAX_HELM_INDEX:
                raise ValueError(f"list index {part} is out of range 0..{MAX_HELM_INDEX}")
            out.append(f"[{part}]")
        elif not part:
            raise ValueError("Helm keys cannot be empty")
        else:
            out.append(("." if out else "") + _escape_key(part))
    return "".join(out)


# --------------------------------------------------------------------------- Helm values

#: A map or a list of a Helm values tree.
_Container = dict[Any, Any] | list[Any]


def _slot(node: _Container, part: str | int) -> Any:
    """Current value at `part` of `node` (None when missing); pads lists like Helm does."""
    if isinstance(node, list):
        assert isinstance(part, int)
        if len(node) <= part:
            node.extend([None] * (part + 1 - len(node)))
        return node[part]
    return node.get(part)


def _container_name(kind: type) -> str:
    return "a list" if kind is list else "a map"


def _descend(node: _Container, part: str | int, kind: type, pointer: str,
             where: HelmPath) -> _Container:
    """The child container at `part`, created as `kind` when missing."""
    current: _Container | None = _slot(node, part)
    if current is None:
        current = kind()
        node[part] = current  # type: ignore[index]
    elif not isinstance(current, kind):
        raise ValueError(
            f"Helm pointer {pointer!r} needs {format_helm_pointer(where)} to be "
            f"{_container_name(kind)}, but it holds {short_repr(current)}")
    return current


def set_helm_value(tree: dict[str, Any], pointer: str, value: Any) -> None:
    """Set `value` (deep-copied, typed) at `pointer` in `tree`, creating dicts and lists.

    Replacing an existing scalar is allowed (as a repeated `--set` would); replacing or
    descending through something of the wrong shape (a map where a list is needed, a scalar
    where a map is needed, a map or list by a different value) raises ValueError.
    """
    path = parse_helm_pointer(pointer)
    node: _Container = tree
    for depth in range(len(path) - 1):
        kind = list if isinstance(path[depth + 1], int) else dict
        node = _descend(node, path[depth], kind, pointer, path[: depth + 1])
    last = path[-1]
    current = _slot(node, last)
    if isinstance(current, dict | list) and not same_value(current, value):
        raise ValueError(f"Helm pointer {pointer!r} would replace {short_repr(current)} "
                         f"at {format_helm_pointer(path)} with {short_repr(value)}")
    node[last] = copy.deepcopy(value)  # type: ignore[index]


@dataclass
class _Claims:
    """Who wrote what so far, so a conflict can name both pointers involved."""

    leaves: dict[HelmPath, tuple[str, Any]] = field(default_factory=dict)
    containers: dict[HelmPath, tuple[type, str]] = field(default_factory=dict)

    def claim(self, path: HelmPath, label: str, value: Any) -> bool:
        """Record a write; False for an identical repeat, ValueError for a conflict."""
        for depth in range(1, len(path)):
            self._check_prefix(path[:depth], list if isinstance(path[depth], int) else dict,
                               label)
        if path in self.containers:
            _, other = self.containers[path]
            raise _conflict(other, label, path, "one writes inside it, the other sets it to "
                            "a value")
        if path in self.leaves:
            other, earlier = self.leaves[path]
            if same_value(earlier, value):
                return False
            raise _conflict(other, label, path, f"they set different values "
                            f"({short_repr(earlier)} and {short_repr(value)})")
        for depth in range(1, len(path)):
            kind = list if isinstance(path[depth], int) else dict
            self.containers.setdefault(path[:depth], (kind, label))
        self.leaves[path] = (label, value)
        return True

    def _check_prefix(self, prefix: HelmPath, kind: type, label: str) -> None:
        if prefix in self.leaves:
            other, _ = self.leaves[prefix]
            raise _conflict(other, label, prefix, f"one sets it to a value, the other uses "
                            f"it as {_container_name(kind)}")
        if prefix in self.containers and self.containers[prefix][0] is not kind:
            earlier_kind, other = self.containers[prefix]
            raise _conflict(other, label, prefix, f"one uses it as "
                            f"{_container_name(earlier_kind)}, the other as "
                            f"{_container_name(kind)}")


def _conflict(first: str, second: str, where: HelmPath, why: str) -> ValueError:
    return ValueError(f"conflicting Helm pointers {first} and {second} at "
                      f"{format_helm_pointer(where)}: {why}")


def _targets_for(name: str, parameter: Mapping[str, Any], component: str) -> Iterator[str]:
    """Pointers of the targets of `parameter` that list `component`."""
    targets = parameter.get("targets") or []
    if not isinstance(targets, list):
        raise ValueError(f"parameter {name!r}: targets must be a list, found "
                         f"{short_repr(targets)}")
    for target in targets:
        if not isinstance(target, Mapping) or not isinstance(target.get("pointer"), str):
            raise ValueError(f"parameter {name!r}: each target needs a string pointer, found "
                             f"{short_repr(target)}")
        if component in (target.get("components") or ()):
            yield target["pointer"]


def _assignments(parameters: Mapping[str, Mapping[str, Any]], component: str
                 ) -> Iterator[tuple[str, str, Any]]:
    """(parameter name, pointer, value) for `component`, in sorted parameter order."""
    for name in sorted(parameters):
        parameter = parameters[name]
        if "value" not in parameter:
            continue
        for pointer in _targets_for(name, parameter, component):
            yield name, pointer, parameter["value"]


def helm_values(parameters: Mapping[str, Mapping[str, Any]], component: str
                ) -> dict[str, Any]:
    """The values tree that the parameters targeting Helm `component` produce."""
    tree: dict[str, Any] = {}
    claims = _Claims()
    for name, pointer, value in _assignments(parameters, component):
        try:
            path = parse_helm_pointer(pointer)
        except ValueError as exc:
            raise ValueError(f"parameter {name!r}: {exc}") from exc
        if claims.claim(path, f"{pointer!r} (parameter {name!r})", value):
            set_helm_value(tree, pointer, value)
    return tree


# --------------------------------------------------------------------------- Compose


def compose_variable_name(pointer: str) -> str:
    """`ADMIN_NAME` or the older `ENV.ADMIN_NAME` -> `ADMIN_NAME`; ValueError if invalid."""
    if not isinstance(pointer, str):
        raise ValueError(f"a Compose pointer must be a string, found {short_repr(pointer)}")
    name = pointer.removeprefix("ENV.")
    if not _VARIABLE.fullmatch(name):
        raise ValueError(f"invalid Compose pointer {pointer!r}: an environment variable name "
                         "is letters, digits and underscores, not starting with a digit")
    return name


def env_string(value: Any) -> str:
    """The text an environment variable gets for a parameter value (see module docstring)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be an environment value")
        text = repr(value)
    elif isinstance(value, str):
        text = value
    elif isinstance(value, list | tuple | Mapping):
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                          sort_keys=True)
    else:
        raise TypeError(f"cannot render {type(value).__name__} as an environment value")
    if "\x00" in text:
        raise ValueError("environment values cannot contain NUL characters")
    return text


def compose_environment(parameters: Mapping[str, Mapping[str, Any]], component: str
                        ) -> dict[str, str]:
    """Environment variables (sorted by name) the parameters give Compose `component`."""
    env: dict[str, str] = {}
    owners: dict[str, str] = {}
    for name, pointer, value in _assignments(parameters, component):
        try:
            variable = compose_variable_name(pointer)
            text = env_string(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"parameter {name!r}: {exc}") from exc
        if variable in env and env[variable] != text:
            raise ValueError(
                f"environment variable {variable} gets {short_repr(env[variable])} from "
                f"parameter {owners[variable]!r} and {short_repr(text)} from parameter {name!r}")
        env[variable] = text
        owners.setdefault(variable, name)
    return dict(sorted(env.items()))
