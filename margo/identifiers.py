"""Identifiers: what a valid name of each family is, checked where it enters.

Names that devices and platform engineers choose travel far: a device id becomes a Git
branch (``refs/heads/devices/<component>``, one file on disk in every stock clone), a path
in URLs, a key in the database and in every compile; an intent's name becomes
``<intent>.yaml`` on each device; an application id becomes a Kubernetes namespace. A name
that one of those places cannot hold must be refused where it enters (with a 4xx naming
the field, or a located problem for the fleet source), not found later by the compile of
the whole fleet. Each family here is a maximum length plus a syntax, chosen so that
every accepted name is usable everywhere it goes:

* **device ids** keep the standard's syntax (``DeviceId``: segments of RFC 3986 unreserved
  characters separated by ``/``, the gateway hierarchy), at most `MAX_DEVICE_ID`
  characters, with a branch component (`branch_component`: ``~``, ``/`` and some dots are
  percent-encoded, three characters each) of at most `MAX_REF_COMPONENT` bytes, so
  ``<component>.lock`` still fits a file name (255 bytes on every common file system) in
  the server's repository and in any clone, and the whole ref libgit2's 1,024 bytes;
* **deployment ids** and **client ids**: one RFC 3986 unreserved segment (they are URL path
  segments; a client id is also a SPIFFE path segment), bounded;
* **label keys**: the Kubernetes label key syntax (``[prefix/]name``, a DNS subdomain prefix
  of at most 253 and a name of at most 63 characters), which every key a Kubernetes node
  reports already has and which the spec's "domain prefix recommended" describes;
  **label values**: strings (or list items) bounded and free of control characters;
* **DNS labels** (namespaces, intent names that become ``<name>.yaml``): RFC 1123 labels.

`ref_component_problem` and `file_name_problem` state the two targets' own rules (those of
``git check-ref-format`` for one component, and of a portable file name); the tests hold
every accepted name of every family to them.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from margo.errors import short_repr

__all__ = [
    "CLIENT_ID",
    "DEPLOYMENT_ID",
    "DEVICE_ID",
    "DNS_LABEL",
    "LABEL_KEY",
    "MAX_DEVICE_ID",
    "MAX_LABEL_VALUE",
    "MAX_REF_COMPONENT",
    "REGISTRY_HOST",
    "IdentifierError",
    "IdentifierFamily",
    "branch_component",
    "device_id_problem",
    "file_name_problem",
    "label_value_problem",
    "ref_component_problem",
]

#: A registry `host[:port]` as image references and `oci://` repositories write it (device
#: configurations and intents' `registryCredentials` name registries so).
REGISTRY_HOST = r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?(:[0-9]{1,5})?$"

#: Longest device id, in characters (a DNS name is at most 253; ids are usually far shorter).
MAX_DEVICE_ID = 250
#: Longest ref component we create, in bytes: NAME_MAX (255) minus the ``.lock`` Git writes
#: next to a loose ref while it updates it.
MAX_REF_COMPONENT = 250
#: Longest label value (or item of a list value), in characters.
MAX_LABEL_VALUE = 1024
#: Most items a list-valued label may hold.
MAX_LABEL_ITEMS = 256

_UNRESERVED = r"[A-Za-z0-9._~-]"
_KEPT = frozenset(string.ascii_letters + string.digits + "_-")
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class IdentifierError(ValueError):
    """A name refused by its family; `family` and `reason` say which rule, for messages."""

    def __init__(self, family: str, value: object, reason: str) -> None:
        super().__init__(f"{family} {short_repr(value)}: {reason}")
        self.family, self.value, self.reason = family, value, reason


@dataclass(frozen=True, slots=True)
class IdentifierFamily:
    """One family of names: `max_length` characters of `syntax` (a full-match pattern),
    described as `allowed` in messages, made of the characters `chars` matches (named when
    a value has others); `extra` states any further rule (None: none)."""

    name: str
    max_length: int
    syntax: re.Pattern[str]
    allowed: str
    chars: re.Pattern[str]
    extra: Callable[[str], str | None] | None = None

    def problem(self, value: object) -> str | None:
        """What is wrong with `value` as a name of this family, or None when it is valid.
        The length is checked first, so a huge value costs nothing more to refuse."""
        if not isinstance(value, str):
            return f"a {self.name} must be a string, found {type(value).__name__}"
        if not value:
            return f"a {self.name} must not be empty"
        if len(value) > self.max_length:
            return (f"a {self.name} is at most {self.max_length} characters, this one has "
                    f"{len(value)}")
        if not self.syntax.fullmatch(value):
            bad = sorted({c for c in value if not self.chars.fullmatch(c)})
            shown = f" (found {', '.join(map(repr, bad[:5]))})" if bad else ""
            return f"a {self.name} must be {self.allowed}{shown}"
        return self.extra(value) if self.extra is not None else None

    def is_valid(self, value: object) -> bool:
        return self.problem(value) is None

    def check(self, value: object) -> str:
        """`value` itself when valid; `IdentifierError` saying why not otherwise."""
        problem = self.problem(value)
        if problem is not None:
            raise IdentifierError(self.name, value, problem)
        assert isinstance(value, str)
        return value


# --- the targets' own rules ----------------------------------------------------------------

_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\/]")


def ref_component_problem(component: str, *, branch_start: bool = False) -> str | None:
    """What makes `component` unusable as one component of a Git ref name, or None:
    the rules of ``git check-ref-format`` (no control characters, space, ``~^:?*[\\``, no
    ``..`` or ``@{``, not ``@``, no leading ``.``, no trailing ``.`` or ``.lock``), no
    ``/`` (it would be two components) and at most `MAX_REF_COMPONENT` bytes (a loose ref
    and its lock are files). With `branch_start` (the component begins a branch name, as
    in ``refs/heads/<it>``) no leading ``-`` either: ``git branch`` and ``git checkout``
    would take it for an option."""
    if not component:
        return "a ref component must not be empty"
    found = _REF_FORBIDDEN.search(component)
    if found:
        return f"a ref component must not contain {found.group()!r}"
    if ".." in component or "@{" in component or component == "@":
        return "a ref component must not contain '..' or '@{' nor be '@'"
    if component.startswith(".") or component.endswith((".", ".lock")):
        return "a ref component must not start with '.', nor end with '.' or '.lock'"
    if branch_start and component.startswith("-"):
        return "a branch name must not start with '-'"
    if len(component.encode("utf-8", "surrogatepass")) > MAX_REF_COMPONENT:
        return f"a ref component is at most {MAX_REF_COMPONENT} bytes"
    return None


def file_name_problem(name: str) -> str | None:
    """What makes `name` unusable as a portable file name, or None: empty, ``.``/``..``,
    ``/``, control characters, or more than 255 bytes of UTF-8."""
    if not name or name in (".", ".."):
        return f"{short_repr(name)} cannot be a file name"
    if "/" in name or _CONTROL.search(name):
        return "a file name must not contain '/' or control characters"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "a file name must be encodable as UTF-8"
    return "a file name is at most 255 bytes" if size > 255 else None


# --- device ids and their branches ---------------------------------------------------------

def branch_component(device_id: str) -> str:
    """The one ref component naming `device_id`'s branch (``refs/heads/devices/<it>``).

    The whole id becomes ONE component, so a gateway ``gw`` and its child ``gw/child`` can
    both have branches (as refs they would be a file and a directory of the same name).
    Kept as is: ``[A-Za-z0-9_-]`` and the dots Git accepts; percent-encoded (``%XX``,
    upper-case): ``%``, ``~``, ``/``, a dot that is first, last or follows another dot, and
    the dot of a trailing ``.lock``. Expects a valid `DEVICE_ID` (other text may give a
    component Git refuses)."""
    last = len(device_id) - 1
    out: list[str] = []
    for i, char in enumerate(device_id):
        plain_dot = char == "." and 0 < i < last and device_id[i - 1] != "."
        if char in _KEPT or plain_dot:
            out.append(char)
        else:
            out.append("".join(f"%{byte:02X}" for byte in char.encode("utf-8")))
    encoded = "".join(out)
    if encoded.endswith(".lock"):
        encoded = encoded[: -len(".lock")] + "%2Elock"
    return encoded


def _device_id_rules(device_id: str) -> str | None:
    size = len(branch_component(device_id))
    if size > MAX_REF_COMPONENT:
        return (f"a device id's branch name is at most {MAX_REF_COMPONENT} characters, this "
                f"one has {size} ('~', '/' and some dots are written as three)")
    return None


DEVICE_ID = IdentifierFamily(
    "device id", MAX_DEVICE_ID,
    re.compile(rf"{_UNRESERVED}+(?:/{_UNRESERVED}+)*"),
    "'/'-separated segments of RFC 3986 unreserved characters (A-Z a-z 0-9 . _ ~ -)",
    re.compile(r"[A-Za-z0-9._~/-]"), _device_id_rules)


def _one_segment(name: str) -> Callable[[str], str | None]:
    def rules(value: str) -> str | None:
        return f"a {name} must not be '.' or '..'" if value in (".", "..") else None
    return rules


DEPLOYMENT_ID = IdentifierFamily(
    "deployment id", 128, re.compile(f"{_UNRESERVED}+"),
    "made of RFC 3986 unreserved characters (A-Z a-z 0-9 . _ ~ -)", re.compile(_UNRESERVED),
    _one_segment("deployment id"))

CLIENT_ID = IdentifierFamily(
    "client id", 128, re.compile(f"{_UNRESERVED}+"),
    "made of RFC 3986 unreserved characters (A-Z a-z 0-9 . _ ~ -)", re.compile(_UNRESERVED),
    _one_segment("client id"))

DNS_LABEL = IdentifierFamily(
    "DNS label", 63, re.compile(_DNS_LABEL),
    "made of lower-case letters, digits and '-', starting and ending with a letter or digit",
    re.compile(r"[-a-z0-9]"))


def _label_key_rules(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if len(prefix) > 253:
        return "a label key's prefix is at most 253 characters"
    if len(name) > 63:
        return "a label key's name (after the prefix) is at most 63 characters"
    return None


LABEL_KEY = IdentifierFamily(
    "label key", 253 + 1 + 63,
    re.compile(rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?{_LABEL_NAME}"),
    "an optional DNS subdomain prefix and '/', then letters, digits, '-', '_' and '.', "
    "starting and ending with a letter or digit (a Kubernetes label key)",
    re.compile(r"[-A-Za-z0-9_./]"), _label_key_rules)


def label_value_problem(value: Any) -> str | None:
    """What is wrong with a label value's size or text, or None (its type is the schema's
    business): strings and list items of at most `MAX_LABEL_VALUE` characters without
    control characters, lists of at most `MAX_LABEL_ITEMS` items."""
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_LABEL_ITEMS:
        return f"a label value lists at most {MAX_LABEL_ITEMS} items, this one {len(items)}"
    for item in items:
        if not isinstance(item, str):
            continue
        if len(item) > MAX_LABEL_VALUE:
            return f"a label value is at most {MAX_LABEL_VALUE} characters, this one has " \
                   f"{len(item)}"
        if _CONTROL.search(item):
            return "a label value must not contain control characters"
    return None


@functools.lru_cache(maxsize=32_768)  # a fleet's ids are checked on every compile
def device_id_problem(device_id: str) -> str | None:
    """`DEVICE_ID.problem`, remembered (strings only)."""
    return DEVICE_ID.problem(device_id)
