"""Schema-valid documents of any spec shape → the internal model (`margo.models`).

Callers must have validated the document against the schema of its detected shape first
(`margo.validation` does); these functions rely on that and only translate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from margo import models as m
from margo.constraints import ARCHITECTURE_ALIASES
from margo.kinds import Kind, Shape

__all__ = ["normalise", "normalise_architecture"]

_EXTENSION = re.compile(r"^x-[a-z][a-z0-9-]*-extensions\Z")

PROFILE_TYPES = {"helm": m.ProfileType.HELM, "helm.v3": m.ProfileType.HELM,
                 "compose": m.ProfileType.COMPOSE, "docker-compose": m.ProfileType.COMPOSE,
                 "custom": m.ProfileType.CUSTOM}
ROLE_DEPLOYMENT_TYPES = {"Standalone Cluster": "helm", "Cluster Leader": "helm",
                         "Cluster Worker": "helm", "Standalone Device": "compose"}


def normalise_architecture(name: str) -> str:
    return ARCHITECTURE_ALIASES.get(name, name)


def extensions_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if _EXTENSION.match(k)}


def _wait(value: Any) -> bool | None:
    if isinstance(value, str):
        return value == "true"
    return value if isinstance(value, bool) else None


def _component(raw: Mapping[str, Any]) -> m.Component:
    props = raw["properties"]
    revision = props.get("revision")
    return m.Component(
        name=raw["name"],
        properties=m.ComponentProperties(
            repository=props.get("repository"),
            revision=str(revision) if revision is not None else None,
            wait=_wait(props.get("wait")),
            timeout=props.get("timeout"),
            package_location=props.get("packageLocation"),
            key_location=props.get("keyLocation"),
        ),
        extensions=extensions_of(raw),
    )


def _profile(raw: Mapping[str, Any]) -> m.DeploymentProfile:
    return m.DeploymentProfile(
        type=PROFILE_TYPES[raw["type"]],
        components=tuple(_component(c) for c in raw["components"]),
        id=raw.get("id"),
        description=raw.get("description"),
        device_constraints=raw.get("deviceConstraints"),
        required_resources=raw.get("requiredResources"),
        extensions=extensions_of(raw),
    )


def _parameters(raw: Mapping[str, Any] | None) -> dict[str, m.Parameter]:
    out: dict[str, m.Parameter] = {}
    for name, body in (raw or {}).items():
        targets = tuple(m.ParameterTarget(t["pointer"], tuple(t["components"]))
                        for t in body["targets"])
        out[name] = m.Parameter(name, targets, body.get("value"), "value" in body,
                                sensitive=body.get("sensitive") is True)
    return out


def _description(doc: Mapping[str, Any], shape: Shape) -> m.ApplicationDescription:
    metadata = doc["metadata"]
    configuration = doc.get("configuration") or {}
    sections = tuple(
        m.Section(
            name=s["name"],
            settings=tuple(m.Setting(parameter=x["parameter"], name=x["name"],
                                     schema=x["schema"], description=x.get("description"),
                                     immutable=bool(x.get("immutable", False)))
                           for x in s["settings"]),
        )
        for s in configuration.get("sections", [])
    )
    return m.ApplicationDescription(
        id=doc.get("id") or metadata["id"],
        name=metadata["name"],
        version=str(metadata["version"]),
        profiles=tuple(_profile(p) for p in doc["deploymentProfiles"]),
        parameters=_parameters(doc.get("parameters")),
        sections=sections,
        schemas={s["name"]: s for s in configuration.get("schema", [])},
        catalog=metadata["catalog"],
        description=metadata.get("description"),
        api_version=doc["apiVersion"],
        extensions=extensions_of(doc),
        shape=shape,
    )


def _deployment(doc: Mapping[str, Any], shape: Shape) -> m.ApplicationDeployment:
    metadata = doc["metadata"]
    spec = doc["spec"]
    annotations = dict(metadata.get("annotations") or {})
    deployment_id = cast(str, doc.get("id") or annotations.get("id"))
    application_id = cast(str, spec.get("applicationId") or annotations.get("applicationId"))
    annotations.pop("id", None)
    annotations.pop("applicationId", None)
    return m.ApplicationDeployment(
        id=deployment_id,
        name=metadata["name"],
        namespace=metadata["namespace"],
        application_id=application_id,
        profile=_profile(spec["deploymentProfile"]),
        parameters=_parameters(spec.get("parameters")),
        device_id=metadata.get("deviceId"),
        labels=dict(metadata.get("labels") or {}),
        annotations=annotations,
        extensions=extensions_of(spec),
        shape=shape,
    )


def _oct_2024_properties(properties: Mapping[str, Any]) -> dict[str, Any]:
    """Oct-2024 `roles` + `resources` → rc.3 `properties` (what the matcher reads)."""
    resources = properties.get("resources") or {}
    out: dict[str, Any] = {k: properties[k] for k in ("id", "vendor", "modelNumber",
                                                      "serialNumber") if k in properties}
    cpu = resources.get("cpu")
    if cpu:
        architectures = cpu.get("architectures") or []
        entry: dict[str, Any] = {"cores": cpu["cores"]}
        if architectures:
            entry["architecture"] = normalise_architecture(architectures[0])
        out["cpus"] = [entry]
    for key in ("memory", "storage", "peripherals", "interfaces"):
        if key in resources:
            out[key] = resources[key]
    deployment_types = sorted({ROLE_DEPLOYMENT_TYPES[r] for r in properties.get("roles", [])
                               if r in ROLE_DEPLOYMENT_TYPES})
    if deployment_types:
        out["supportedDeploymentTypes"] = deployment_types
        out["supportedRuntimes"] = ["oci"]
    return out


def _capabilities(doc: Mapping[str, Any], shape: Shape) -> m.DeviceCapabilities:
    properties = doc["properties"]
    if shape is Shape.OCT_2024:
        normalised = _oct_2024_properties(properties)
        roles = tuple(properties.get("roles", ()))
    else:
        normalised = dict(properties)
        if "cpus" in normalised:
            normalised["cpus"] = [
                {**cpu, "architecture": normalise_architecture(cpu["architecture"])}
                if "architecture" in cpu else dict(cpu)
                for cpu in normalised["cpus"]
            ]
        roles = ()
    return m.DeviceCapabilities(
        device_id=properties["id"],
        properties=normalised,
        labels=dict(doc.get("labels") or {}),
        extensions=extensions_of(doc),
        roles=roles,
        shape=shape,
    )


def _state(name: str) -> m.DeploymentState:
    return m.DeploymentState(name.lower())


def _status(doc: Mapping[str, Any], shape: Shape) -> m.DeploymentStatus:
    return m.DeploymentStatus(
        deployment_id=doc["deploymentId"],
        state=_state(doc["status"]["state"]),
        components=tuple(m.ComponentStatus(c["name"], _state(c["state"]), c.get("error"))
                         for c in doc["components"]),
        error=doc["status"].get("error"),
        device_id=doc.get("deviceId"),
        adopted_manifest_version=doc.get("adoptedManifestVersion"),
        extensions=extensions_of(doc),
        shape=shape,
    )


def _manifest(doc: Mapping[str, Any], shape: Shape) -> m.StateManifest:
    bundle = doc["bundle"]
    return m.StateManifest(
        manifest_version=doc["manifestVersion"],
        bundle=None if bundle is None else m.BundleRef(bundle["mediaType"], bundle["digest"],
                                                       bundle["url"], bundle.get("sizeBytes")),
        deployments=tuple(m.DeploymentRef(d["deploymentId"], d["digest"], d["url"],
                                          d.get("sizeBytes")) for d in doc["deployments"]),
    )


_NORMALISERS = {
    Kind.APPLICATION_DESCRIPTION: _description,
    Kind.APPLICATION_DEPLOYMENT: _deployment,
    Kind.DEVICE_CAPABILITIES: _capabilities,
    Kind.DEPLOYMENT_STATUS: _status,
    Kind.STATE_MANIFEST: _manifest,
}


def normalise(kind: Kind, shape: Shape, doc: Mapping[str, Any]) -> Any:
    """The internal model of a schema-valid document (ProblemDetail stays a dict)."""
    normaliser = _NORMALISERS.get(kind)
    return normaliser(doc, shape) if normaliser else dict(doc)
