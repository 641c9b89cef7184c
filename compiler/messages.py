"""Commit messages for people, rendered from `templates/commit-message.txt.j2`.

The message says what changed in the device's desired state and why (intent edited,
application version changed, capabilities changed, device became (in)eligible); trailers
carry the digests of the inputs so any commit can be traced back to exactly what produced
it (`git log --format=%(trailers)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.runtime import Context

__all__ = ["TEMPLATES", "Change", "commit_message", "warm_up"]

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


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
    template = _template()
    context = Context(template.environment, {**_globals(), "device_id": device_id,
                                             "changes": changes, "trailers": trailers},
                      template.name, template.blocks)
    text = "".join(template.root_render_func(context))  # what `render` does with it
    return text.rstrip("\n") + "\n"


def warm_up() -> None:
    """Load and compile the template now: a process about to fork compile workers calls
    this so that each of them does not do it again (~20 ms each)."""
    _globals()
