"""Where desired state comes from: the device's Git repository or the Margo REST manifest.

Both return the same thing, a `DesiredState`, so everything after fetching is shared. A source
never applies anything and never persists anything: the runner adopts what it returns only
after every document has been verified and parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from reconciler.desired import DesiredState
from reconciler.errors import IntegrityError, SourceError

__all__ = ["Adopted", "IntegrityError", "Source", "SourceError"]


@dataclass(frozen=True)
class Adopted:
    """What the device adopted last (from its durable state): the source's version marker and
    the exact bytes of the documents it holds, by digest, so unchanged ones are not fetched.

    `damaged` names deployments whose stored copies no longer match their digests (they are
    not in `documents`): the source must deliver the adopted version again even though it has
    not changed, since "unchanged" would leave the device without a usable copy.
    `history_rewrite_accepted` is the Git commit whose rewritten history an operator accepted
    and the device adopted: that override is spent."""

    version: str | None = None  # commit id, or manifestVersion as text
    manifest_version: int | None = None
    etag: str | None = None
    documents: Mapping[str, bytes] = field(default_factory=dict)  # digest -> exact bytes
    damaged: tuple[str, ...] = ()  # deployment ids
    history_rewrite_accepted: str | None = None


class Source(Protocol):
    name: str  # "git" or "margo-rest"

    def fetch(self, adopted: Adopted) -> DesiredState | None:
        """The new desired state, or None when nothing changed since `adopted` (never None
        while `adopted.damaged` names anything). Raises `SourceError` / `IntegrityError`."""
        ...

    def close(self) -> None:
        ...
