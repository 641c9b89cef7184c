"""Component revisions: SemVer 2.0 written as OCI tags (build metadata after `_`, not `+`).

OCI tags cannot contain `+`, so Margo writes SemVer build metadata after `_`; anything
comparing revisions must convert back first. Precedence follows SemVer 2.0 section 11
(build metadata is ignored for precedence but kept for equality of the tag text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

__all__ = ["Revision", "parse_revision", "revision_problem"]

_CORE = r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
_IDENT = r"(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_PRE = rf"(?:-({_IDENT}(?:\.{_IDENT})*))?"
_BUILD = r"(?:[_+]([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
_SEMVER = re.compile(rf"^{_CORE}{_PRE}{_BUILD}\Z")


@total_ordering
@dataclass(frozen=True, slots=True)
class Revision:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    @property
    def tag(self) -> str:
        """The OCI-tag spelling (`1.2.3-rc.1_build.5`)."""
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "_" + ".".join(self.build)
        return text

    @property
    def semver(self) -> str:
        """The SemVer spelling (`1.2.3-rc.1+build.5`), e.g. for Helm chart versions."""
        return self.tag.replace("_", "+", 1) if self.build else self.tag

    def _key(self) -> tuple[object, ...]:
        # A release sorts after its prereleases; numeric identifiers sort before alphanumeric.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, not self.prerelease, pre)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Revision):
            return NotImplemented
        return self._key() < other._key()


def parse_revision(text: str, *, allow_plus: bool = False) -> Revision:
    """Parse a revision; `+` build metadata is accepted only with `allow_plus`."""
    match = _SEMVER.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"expected a SemVer 2.0 revision such as 1.2.3 or 1.2.3-rc.1_build.5 "
                         f"(no leading 'v'), found {text!r}")
    if "+" in text and not allow_plus:
        raise ValueError(f"build metadata must follow '_' instead of '+' (OCI tags cannot "
                         f"contain '+'): write {text.replace('+', '_', 1)!r}")
    major, minor, patch, pre, build = match.groups()
    return Revision(int(major), int(minor), int(patch),
                    tuple(pre.split(".")) if pre else (), tuple(build.split(".")) if build else ())


def revision_problem(text: object) -> str | None:
    """Why `text` is not a valid revision, or None."""
    try:
        parse_revision(text)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return None
