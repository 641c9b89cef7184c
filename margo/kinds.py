"""Which Margo document is this, and in which spec generation's shape?

Margo documents changed shape across Oct-2024 (Preview Release 1), rc.2 and rc.3, and
several kinds carry no `kind` field at all in rc.3. Detection therefore looks at structure
first and at `kind` second: a document whose `kind` is wrong but whose body is clearly a
status report is validated as a status report, and the schema then reports the `kind`
("expected 'DeploymentStatusManifest', found 'WrongKind'") instead of a vague "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Detection", "Kind", "Shape", "detect"]


class Kind(StrEnum):
    APPLICATION_DESCRIPTION = "ApplicationDescription"
    APPLICATION_DEPLOYMENT = "ApplicationDeployment"
    DEVICE_CAPABILITIES = "DeviceCapabilitiesManifest"
    DEPLOYMENT_STATUS = "DeploymentStatusManifest"
    STATE_MANIFEST = "UnsignedAppStateManifest"
    PROBLEM_DETAIL = "ProblemDetail"


class Shape(StrEnum):
    """Spec generations, oldest first; the newest is what we emit."""

    OCT_2024 = "oct-2024"
    RC2 = "rc.2"
    RC3 = "rc.3"


#: The API generations a device or server may speak, newest (the default) first.
GENERATIONS: tuple[str, ...] = (Shape.RC3.value, Shape.RC2.value, Shape.OCT_2024.value)


#: `kind` values seen in the wild, mapped to our kinds.
KIND_NAMES: dict[str, Kind] = {
    "ApplicationDescription": Kind.APPLICATION_DESCRIPTION,
    "application": Kind.APPLICATION_DESCRIPTION,
    "ApplicationDeployment": Kind.APPLICATION_DEPLOYMENT,
    "DeviceCapabilitiesManifest": Kind.DEVICE_CAPABILITIES,
    "DeploymentStatusManifest": Kind.DEPLOYMENT_STATUS,
    "UnsignedAppStateManifest": Kind.STATE_MANIFEST,
    "DesiredStateManifest": Kind.STATE_MANIFEST,
}


@dataclass(frozen=True, slots=True)
class Detection:
    kind: Kind | None
    shape: Shape | None
    reason: str = ""


def _structural_kind(doc: dict[str, Any]) -> Kind | None:
    if "deploymentProfiles" in doc:
        return Kind.APPLICATION_DESCRIPTION
    if "spec" in doc and "metadata" in doc:
        return Kind.APPLICATION_DEPLOYMENT
    if "manifestVersion" in doc:
        return Kind.STATE_MANIFEST
    if "deploymentId" in doc or ("components" in doc and isinstance(doc.get("status"), dict)):
        return Kind.DEPLOYMENT_STATUS
    if isinstance(doc.get("properties"), dict):
        return Kind.DEVICE_CAPABILITIES
    if "title" in doc and ("type" in doc or isinstance(doc.get("status"), int)):
        return Kind.PROBLEM_DETAIL
    return None


def _description_shape(doc: dict[str, Any]) -> Shape:
    if doc.get("kind") == "application":
        return Shape.OCT_2024
    profiles = doc.get("deploymentProfiles")
    profile_list = profiles if isinstance(profiles, list) else []
    if "id" in doc or any(
        isinstance(p, dict) and ("deviceConstraints" in p or p.get("type") == "custom")
        for p in profile_list
    ):
        return Shape.RC3
    return Shape.RC2


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """`doc[key]` when it is an object, else an empty one: shapes are told from what is there."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _deployment_shape(doc: dict[str, Any]) -> Shape:
    metadata, spec = _object(doc, "metadata"), _object(doc, "spec")
    annotations = _object(metadata, "annotations")
    if {"apiVersion", "kind", "id"} <= doc.keys() and "applicationId" in annotations:
        return Shape.RC2  # rc.3 drops apiVersion and kind and keeps the id in spec only
    if "applicationId" in spec or ("deviceId" in metadata and "applicationId" not in annotations):
        return Shape.RC3
    if "id" in doc:
        return Shape.RC2
    if "id" in annotations:
        return Shape.OCT_2024
    return Shape.RC3


def _capabilities_shape(doc: dict[str, Any]) -> Shape:
    properties = _object(doc, "properties")
    if "roles" in properties or "resources" in properties:
        return Shape.OCT_2024
    custom = any(
        "custom" in (properties.get(field) or [])
        for field in ("supportedRuntimes", "supportedDeploymentTypes")
        if isinstance(properties.get(field), list)
    )
    if "labels" in doc or custom or "apiVersion" not in doc or "kind" not in doc:
        return Shape.RC3
    return Shape.RC2


def _status_shape(doc: dict[str, Any]) -> Shape:
    states = []
    if isinstance(doc.get("status"), dict):
        states.append(doc["status"].get("state"))
    if isinstance(doc.get("components"), list):
        states.extend(c.get("state") for c in doc["components"] if isinstance(c, dict))
    if any(isinstance(s, str) and s[:1].isupper() for s in states):
        return Shape.OCT_2024
    if "adoptedManifestVersion" in doc:
        return Shape.RC3
    if "apiVersion" in doc or "kind" in doc:
        return Shape.RC2
    return Shape.RC3


_SHAPERS = {
    Kind.APPLICATION_DESCRIPTION: _description_shape,
    Kind.APPLICATION_DEPLOYMENT: _deployment_shape,
    Kind.DEVICE_CAPABILITIES: _capabilities_shape,
    Kind.DEPLOYMENT_STATUS: _status_shape,
}


def detect(doc: Any, *, expect: Kind | None = None) -> Detection:
    """Kind and shape of a parsed document; `expect` forces the kind (e.g. an API endpoint)."""
    if not isinstance(doc, dict):
        found = "a list" if isinstance(doc, list) else type(doc).__name__
        return Detection(None, None, f"a Margo document is a mapping, found {found}")
    kind = expect or _structural_kind(doc)
    if kind is None:
        named = doc.get("kind")
        if isinstance(named, str) and named in KIND_NAMES:
            kind = KIND_NAMES[named]
        else:
            found = f"kind {named!r}" if named is not None else "no kind field"
            return Detection(None, None, f"cannot tell which Margo document this is ({found}, "
                                         "and no characteristic fields)")
    shaper = _SHAPERS.get(kind)
    return Detection(kind, shaper(doc) if shaper else Shape.RC3)
