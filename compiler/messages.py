"""Commit messages for people, rendered from `compiler/templates/commit-message.txt.j2`.

The message says what changed in the device's desired state and why (intent edited,
application version changed, capabilities changed, device became (in)eligible); trailers
carry the digests of the inputs so any commit can be traced back to exactly what produced
it (`git log --format=%(trailers)`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.runtime import Context

__all__ = ["TEMPLATES", "Change", "commit_message", "warm_up"]

TEMPLATES = Path(__file__).resolve().parent / "templates"  # package data


@dataclass(frozen=True, slots=True)
class Change:
    """One file's change in a device tree."""

    file: str
    intent: str
    action: str  # add | update | reconfigure | remove | keep
    reasons: tuple[str, ...] = ()


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template("commit-message.txt.j2")


@cache
def _globals() -> dict[str, Any]:
    """The template's globals, copied once: `Template.render` copies them out of a
    `ChainMap` on every call, 60% of rendering a message (one per changed device)."""
    return dict(_template().globals)


def commit_message(device_id: str, changes: Sequence[Change],
                   trailers: Mapping[str, str]) -> str:
    """The message of a commit of `device_id`'s branch making `changes`.

    One intent's edit gives a thousand devices the same changes and the same trailer names;
    only the device id and the trailer values differ. So the template is rendered once per
    (changes, trailer names), with markers where those values go (`_Fill`), and each
    message is that text with the values put in."""
    key = (tuple(changes), tuple(trailers))
    fill = _fills.get(key)
    if fill is None:
        if len(_fills) >= _FILL_LIMIT:
            _fills.clear()
        fill = _fills[key] = _Fill.of(changes, key[1])
    if fill is _NO_FILL:
        text = _render(device_id, changes, trailers)
    else:
        text = fill.apply((device_id, *trailers.values()))
    return text.rstrip("\n") + "\n"


def _render(device_id: str, changes: Sequence[Change], trailers: Mapping[str, str]) -> str:
    template = _template()
    context = Context(template.environment, {**_globals(), "device_id": device_id,
                                             "changes": changes, "trailers": trailers},
                      template.name, template.blocks)
    return "".join(template.root_render_func(context))  # what `render` does with it


class _Fill:
    """A rendered message with holes for the device id and the trailer values.

    Found by rendering with markers in place of those values (strings no change can hold:
    they contain NUL) and checked with a second, longer set of markers: a template that
    changes, cuts or measures a value gives different text, or broken markers, and is then
    rendered for every message (`_NO_FILL`). A template must not branch on these values
    (ours prints them as they are; `tests/compiler/test_commit_messages.py` compares fills
    with renders).
    """

    __slots__ = ("literals", "slots")

    def __init__(self, literals: list[str], slots: list[int]) -> None:
        self.literals, self.slots = literals, slots  # literals[0], values[slots[0]], ...

    @staticmethod
    def of(changes: Sequence[Change], names: tuple[str, ...]) -> _Fill:
        count = 1 + len(names)
        first = _Fill._split(changes, names, [f"\0{i}\0a" for i in range(count)])
        second = _Fill._split(changes, names, [f"\0{i}\0bb" for i in range(count)])
        if (first is None or second is None or first.literals != second.literals
                or first.slots != second.slots):
            return _NO_FILL
        return first

    @staticmethod
    def _split(changes: Sequence[Change], names: tuple[str, ...],
               markers: list[str]) -> _Fill | None:
        pieces = _MARKER.split(_render(markers[0], changes,
                                       dict(zip(names, markers[1:], strict=True))))
        literals, slots = pieces[0::2], [int(n) for n in pieces[1::2]]
        if any("\0" in literal for literal in literals) or any(
                n >= len(markers) for n in slots):
            return None  # a marker came out changed
        return _Fill(literals, slots)

    def apply(self, values: tuple[str, ...]) -> str:
        literals, slots = self.literals, self.slots
        parts = [literals[0]]
        for index, slot in enumerate(slots, start=1):
            parts.append(values[slot])
            parts.append(literals[index])
        return "".join(parts)


_NO_FILL = _Fill([], [])
_MARKER = re.compile(r"\0(\d+)\0(?:a|bb)")
_FILL_LIMIT = 4_096
_fills: dict[tuple[tuple[Change, ...], tuple[str, ...]], _Fill] = {}


def warm_up() -> None:
    """Load and compile the template now: a process about to fork compile workers calls
    this so that each of them does not do it again (~20 ms each)."""
    _globals()
