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

import jinja2

__all__ = ["TEMPLATES", "Change", "commit_message"]

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


def commit_message(device_id: str, changes: Sequence[Change],
                   trailers: Mapping[str, str]) -> str:
    text = _template().render(device_id=device_id, changes=changes, trailers=trailers)
    return text.rstrip("\n") + "\n"
