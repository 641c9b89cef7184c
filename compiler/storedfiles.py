"""What the deployment files already on devices say they take (`StoredFiles`).

What a file a device's tree keeps takes is read from the file itself whenever it is not
what its intent renders now (`compiler.holding`, `margo explain`): rc.3 files carry their
profile's `deviceConstraints` verbatim, rc.2 files in our extension
(`margo.emit.CONSTRAINTS_EXTENSION`, the rc.2 profile having no such field). Oct-2024 files
have no place for them: such a file takes what the application profile whose Oct-2024 text
it holds takes, when the source still has exactly one such profile (one set of
constraints); else it does not say. Each distinct text is compiled once per compile: one
intent's files on a thousand devices share their profile text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

from compiler.render import RenderCache
from compiler.source import AppVersion
from compiler.specdiff import spec_sections
from margo.canonical import canonical_yaml
from margo.constraints import CompiledConstraints, compile_constraints
from margo.digests import data_digest
from margo.emit import (
    CONSTRAINTS_EXTENSION,
    deployment_document,
    emitted_shape,
    profile_type_spelling,
)
from margo.errors import DocumentError
from margo.kinds import Shape
from margo.models import ApplicationDeployment, DeploymentProfile

__all__ = ["StoredFiles"]

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_UNREAD = object()
_PROFILE = b"deploymentProfile"
#: The application id of an Oct-2024 file our emitter wrote (second annotation, plain).
_OCT_2024_APPLICATION = re.compile(rb"\n    applicationId: ([a-z0-9-]{1,200})\n")


class StoredFiles:
    """The constraints deployment files already on devices carry, compiled once per distinct
    text per compile (one intent's files on a thousand devices share their profile text).

    `applications` (the source's: id -> version -> application) is what Oct-2024 files are
    matched against; without it they do not say what they take."""

    def __init__(self, applications: Mapping[str, Mapping[str, AppVersion]] | None = None,
                 renders: RenderCache | None = None) -> None:
        self._applications = applications or {}
        self._renders = renders or RenderCache()
        self._compiled: dict[tuple[Any, ...], CompiledConstraints | None] = {}
        self._texts: dict[tuple[str, str | None, str], bytes] = {}  # `profile_text`

    def constraints(self, data: bytes) -> CompiledConstraints | None:
        """The compiled `deviceConstraints` of a file this compiler wrote (empty ones for a
        profile without any); None when the file does not say (an Oct-2024 file of no
        single known profile, or a file that does not read as ours)."""
        shape = emitted_shape(data)
        section = None if shape is None else spec_sections(data).get(_PROFILE)
        if shape is None or section is None:
            return None
        key: tuple[Any, ...] = (shape, section)
        if shape == Shape.OCT_2024:
            found_id = _OCT_2024_APPLICATION.search(data)
            key = (shape, section, found_id[1].decode() if found_id else None)
        found = self._compiled.get(key, _UNREAD)
        if found is _UNREAD:
            if len(self._compiled) >= 10_000:
                self._compiled.clear()
            found = self._compiled[key] = (self._oct_2024(key[2], section)
                                           if shape == Shape.OCT_2024
                                           else _compiled(section, shape))
        return found  # type: ignore[return-value]

    def _oct_2024(self, app_id: str | None, section: bytes) -> CompiledConstraints | None:
        """What an Oct-2024 file of application `app_id` takes: the constraints of the
        source's profiles whose Oct-2024 text it holds, if they are one set."""
        versions = self._applications.get(app_id or "", {})
        fits = {data_digest(p.device_constraints): p.device_constraints
                for _, app in sorted(versions.items()) for p in app.description.profiles
                if self.profile_text(app, p, self._renders, Shape.OCT_2024) == section}
        if len(fits) != 1:
            return None
        [constraints] = fits.values()
        try:
            return compile_constraints(constraints)
        except (DocumentError, ValueError, TypeError):
            return None

    def profile_text(self, app: AppVersion, profile: DeploymentProfile,
                     renders: RenderCache, shape: str = Shape.RC3) -> bytes:
        """The `deploymentProfile` text a file of this application profile holds in
        `shape` (empty when that shape cannot hold the profile's type)."""
        key = (app.digest, profile.id, shape)
        found = self._texts.get(key)
        if found is None:
            plan = renders.plan(app, profile).profile
            found = b""
            if profile_type_spelling(shape, plan.type) is not None:
                deployment = ApplicationDeployment(
                    id="", name="x", namespace="x", application_id=app.description.id,
                    profile=plan, parameters={}, device_id="")
                document = canonical_yaml(deployment_document(deployment, shape=shape))
                found = spec_sections(document).get(_PROFILE, b"")
            self._texts[key] = found
        return found

    def running_version(self, versions: Mapping[str, AppVersion], data: bytes,
                        renders: RenderCache) -> str | None:
        """The version of the application (among `versions`, the source's) whose profile
        the file `data` holds, or None when none does (an edited or deleted version)."""
        section = spec_sections(data).get(_PROFILE)
        shape = emitted_shape(data)
        if section is None or shape is None:
            return None
        for version, app in sorted(versions.items()):
            for profile in app.description.profiles:
                if self.profile_text(app, profile, renders, shape) == section:
                    return version
        return None


def _compiled(section: bytes, shape: Shape) -> CompiledConstraints | None:
    try:
        doc = yaml.load(section, Loader=_LOADER)
    except yaml.YAMLError:
        return None
    profile = doc.get("deploymentProfile") if isinstance(doc, dict) else None
    if not isinstance(profile, dict):
        return None
    if shape == Shape.RC2:
        ours = profile.get(CONSTRAINTS_EXTENSION[0])
        constraints = ours.get(CONSTRAINTS_EXTENSION[1]) if isinstance(ours, dict) else None
    else:
        constraints = profile.get("deviceConstraints")
    try:
        return compile_constraints(constraints if isinstance(constraints, dict) else None)
    except (DocumentError, ValueError, TypeError):
        return None
