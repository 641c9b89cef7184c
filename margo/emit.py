"""The internal model → documents in the newest spec shape (or Oct-2024 for old devices).

Documents are built as dicts in a fixed field order and serialized by `margo.canonical`,
never by text templating, so the bytes (and therefore digests) are stable. Content the
spec says to copy verbatim (deviceConstraints, x-…-extensions) is copied as it came.
"""

from __future__ import annotations

from typing import Any

from margo import models as m
from margo.canonical import Cached, canonical_json, canonical_yaml
from margo.kinds import Shape

__all__ = [
    "OCT_2024_DEPLOYMENT_API_VERSION",
    "capabilities_document",
    "deployment_document",
    "deployment_yaml",
    "manifest_document",
    "status_document",
]

OCT_2024_DEPLOYMENT_API_VERSION = "application.margo.org/v1alpha1"
_OCT_2024_TYPES = {m.ProfileType.HELM: "helm.v3", m.ProfileType.COMPOSE: "docker-compose"}


def _properties(props: m.ComponentProperties) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if props.repository is not None:
        out["repository"] = props.repository
    if props.revision is not None:
        out["revision"] = props.revision
    if props.wait is not None:
        out["wait"] = props.wait
    if props.timeout is not None:
        out["timeout"] = props.timeout
    if props.package_location is not None:
        out["packageLocation"] = props.package_location
    if props.key_location is not None:
        out["keyLocation"] = props.key_location
    return out


def _component(component: m.Component, *, extensions: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": component.name, "properties": _properties(component.properties)}
    if extensions:
        out.update(component.extensions)
    return out


def _parameters(parameters: dict[str, m.Parameter] | Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted(parameters):
        parameter = parameters[name]
        out[name] = {
            "value": parameter.value,
            "targets": [{"pointer": t.pointer, "components": list(t.components)}
                        for t in parameter.targets],
        }
    return out


def deployment_document(deployment: m.ApplicationDeployment, *, shape: str = Shape.RC3,
                        spec_key: Any = None) -> dict[str, Any]:
    """An ApplicationDeployment as a dict: `rc.3` (default) or `oct-2024` for old devices.

    `spec_key`, when given, must identify the content of `spec` (e.g. the digest of the
    description, the profile id and the parameter values): its YAML text is then produced
    once and reused for every device that gets the same spec (`margo.canonical.Cached`).
    """
    profile = deployment.profile
    if shape == Shape.OCT_2024:
        if profile.type not in _OCT_2024_TYPES:
            raise ValueError(f"profile type {profile.type} has no Oct-2024 spelling")
        annotations = {"id": deployment.id, "applicationId": deployment.application_id,
                       **dict(sorted(deployment.annotations.items()))}
        metadata: dict[str, Any] = {"annotations": annotations, "name": deployment.name,
                                    "namespace": deployment.namespace}
        if deployment.labels:
            metadata["labels"] = dict(sorted(deployment.labels.items()))
        oct_profile: dict[str, Any] = {
            "type": _OCT_2024_TYPES[profile.type],
            "components": [_component(c, extensions=False) for c in profile.components],
        }
        spec: dict[str, Any] = {"deploymentProfile": oct_profile}
        if deployment.parameters:
            spec["parameters"] = _parameters(deployment.parameters)
        return {"apiVersion": OCT_2024_DEPLOYMENT_API_VERSION, "kind": "ApplicationDeployment",
                "metadata": metadata, "spec": _maybe_cached(spec, spec_key, shape)}
    if shape != Shape.RC3:
        raise ValueError(f"cannot emit an ApplicationDeployment in shape {shape!r}")
    metadata = {"name": deployment.name, "namespace": deployment.namespace}
    if deployment.device_id is not None:
        metadata["deviceId"] = deployment.device_id
    if deployment.labels:
        metadata["labels"] = dict(sorted(deployment.labels.items()))
    if deployment.annotations:
        metadata["annotations"] = dict(sorted(deployment.annotations.items()))
    profile_doc: dict[str, Any] = {
        "type": str(profile.type),
        "components": [_component(c, extensions=True) for c in profile.components],
    }
    if profile.device_constraints is not None:
        profile_doc["deviceConstraints"] = profile.device_constraints
    profile_doc.update(profile.extensions)
    spec = {"applicationId": deployment.application_id, "deploymentProfile": profile_doc}
    if deployment.parameters:
        spec["parameters"] = _parameters(deployment.parameters)
    spec.update(deployment.extensions)
    return {"id": deployment.id, "metadata": metadata,
            "spec": _maybe_cached(spec, spec_key, shape)}


def _maybe_cached(spec: dict[str, Any], key: Any, shape: str) -> dict[str, Any]:
    return spec if key is None else Cached(("spec", shape, key), spec)


def deployment_yaml(deployment: m.ApplicationDeployment, *, shape: str = Shape.RC3,
                    spec_key: Any = None) -> bytes:
    """Canonical YAML bytes of an ApplicationDeployment (what digests are computed over)."""
    return canonical_yaml(deployment_document(deployment, shape=shape, spec_key=spec_key))


def capabilities_document(caps: m.DeviceCapabilities) -> dict[str, Any]:
    """rc.3 DeviceCapabilitiesManifest (with the customary apiVersion/kind, which rc.3
    servers accept and older servers require)."""
    doc: dict[str, Any] = {"apiVersion": "device.margo.org/v1alpha1",
                           "kind": "DeviceCapabilitiesManifest",
                           "properties": dict(caps.properties)}
    if caps.labels:
        doc["labels"] = dict(sorted(caps.labels.items()))
    doc.update(caps.extensions)
    return doc


def _error(error: Any) -> dict[str, Any] | None:
    return dict(error) if error else None


def status_document(status: m.DeploymentStatus) -> dict[str, Any]:
    """rc.3 DeploymentStatusManifest."""
    doc: dict[str, Any] = {"deploymentId": status.deployment_id}
    if status.device_id is not None:
        doc["deviceId"] = status.device_id
    if status.adopted_manifest_version is not None:
        doc["adoptedManifestVersion"] = status.adopted_manifest_version
    state: dict[str, Any] = {"state": str(status.state)}
    if status.error:
        state["error"] = _error(status.error)
    doc["status"] = state
    components = []
    for component in status.components:
        item: dict[str, Any] = {"name": component.name, "state": str(component.state)}
        if component.error:
            item["error"] = _error(component.error)
        components.append(item)
    doc["components"] = components
    doc.update(status.extensions)
    return doc


def manifest_document(manifest: m.StateManifest) -> dict[str, Any]:
    """UnsignedAppStateManifest; serialize with `manifest_json` for the ETag'd body."""
    bundle: dict[str, Any] | None = None
    if manifest.bundle is not None:
        bundle = {"mediaType": manifest.bundle.media_type, "digest": manifest.bundle.digest,
                  "url": manifest.bundle.url}
        if manifest.bundle.size_bytes is not None:
            bundle["sizeBytes"] = manifest.bundle.size_bytes
    deployments = []
    for ref in manifest.deployments:
        item: dict[str, Any] = {"deploymentId": ref.deployment_id, "digest": ref.digest,
                                "url": ref.url}
        if ref.size_bytes is not None:
            item["sizeBytes"] = ref.size_bytes
        deployments.append(item)
    return {"manifestVersion": manifest.manifest_version, "bundle": bundle,
            "deployments": deployments}


def manifest_json(manifest: m.StateManifest) -> bytes:
    """The exact manifest body bytes (JCS), whose digest is the ETag."""
    return canonical_json(manifest_document(manifest))
