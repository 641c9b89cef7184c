"""What the deployment files already on devices say they take (`StoredFiles`).

rc.3 files carry their profile's `deviceConstraints` verbatim, so what a file a device's
tree keeps takes is read from the file itself whenever it is not what its intent renders
now (`compiler.holding`, `margo explain`). Each distinct text is compiled once per compile:
one intent's files on a thousand devices share their profile text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from compiler.render import RenderCache
from compiler.source import AppVersion
from compiler.specdiff import spec_sections
from margo.canonical import canonical_yaml
from margo.constraints import CompiledConstraints, compile_constraints
from margo.emit import deployment_document
from margo.errors import DocumentError
from margo.models import ApplicationDeployment, DeploymentProfile

__all__ = ["StoredFiles"]

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_UNREAD = object()
_PROFILE = b"deploymentProfile"


class StoredFiles:
    """The constraints deployment files already on devices carry, compiled once per distinct
    text per compile (one intent's files on a thousand devices share their profile text)."""

    def __init__(self) -> None:
        self._compiled: dict[bytes, CompiledConstraints | None] = {}
        self._texts: dict[tuple[str, str | None], bytes] = {}  # `profile_text`

    def constraints(self, data: bytes) -> CompiledConstraints | None:
        """The compiled `deviceConstraints` of a file this compiler wrote (empty ones for a
        profile without any); None when the file does not say (the oct-2024 shape, or a
        file that does not read as ours)."""
        if data.startswith(b"apiVersion:"):
            return None
        section = spec_sections(data).get(_PROFILE)
        if section is None:
            return None
        found = self._compiled.get(section, _UNREAD)
        if found is _UNREAD:
            if len(self._compiled) >= 10_000:
                self._compiled.clear()
            found = self._compiled[section] = _compiled(section)
        return found  # type: ignore[return-value]

    def profile_text(self, app: AppVersion, profile: DeploymentProfile,
                     renders: RenderCache) -> bytes:
        """The `deploymentProfile` text an rc.3 file of this application profile holds."""
        key = (app.digest, profile.id)
        found = self._texts.get(key)
        if found is None:
            deployment = ApplicationDeployment(
                id="", name="x", namespace="x", application_id=app.description.id,
                profile=renders.plan(app, profile).profile, parameters={}, device_id="")
            document = canonical_yaml(deployment_document(deployment))
            found = self._texts[key] = spec_sections(document).get(_PROFILE, b"")
        return found

    def running_version(self, versions: Mapping[str, AppVersion], data: bytes,
                        renders: RenderCache) -> str | None:
        """The version of the application (among `versions`, the source's) whose profile
        the file `data` holds, or None when none does (an edited or deleted version)."""
        section = spec_sections(data).get(_PROFILE)
        if section is None:
            return None
        for version, app in sorted(versions.items()):
            for profile in app.description.profiles:
                if self.profile_text(app, profile, renders) == section:
                    return version
        return None


def _compiled(section: bytes) -> CompiledConstraints | None:
    try:
        doc = yaml.load(section, Loader=_LOADER)
    except yaml.YAMLError:
        return None
    profile = doc.get("deploymentProfile") if isinstance(doc, dict) else None
    if not isinstance(profile, dict):
        return None
    constraints = profile.get("deviceConstraints")
    try:
        return compile_constraints(constraints if isinstance(constraints, dict) else None)
    except (DocumentError, ValueError, TypeError):
        return None
