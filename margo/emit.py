"""The internal model → documents in the shape of each spec generation (rc.3, rc.2, Oct-2024).

Documents are built as dicts in a fixed field order and serialized by `margo.canonical`,
never by text templating, so the bytes (and therefore digests) are stable. Content the
spec says to copy verbatim (deviceConstraints, x-…-extensions) is copied as it came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from margo import models as m
from margo.canonical import Cached, canonical_json, canonical_yaml
from margo.kinds import Shape

__all__ = [
    "CONSTRAINTS_EXTENSION",
    "OCT_2024_DEPLOYMENT_API_VERSION",
    "capabilities_document",
    "deployment_document",
    "deployment_yaml",
    "emitted_shape",
    "manifest_document",
    "profile_type_spelling",
    "status_document",
]

#: The `apiVersion` of rc.2 and Oct-2024 ApplicationDeployments: every official example of
#: both spells it so (the rc.2 OpenAPI's `default: margo.org` names no version; rc.3 dropped
#: the field).
DEPLOYMENT_API_VERSION = "application.margo.org/v1alpha1"
OCT_2024_DEPLOYMENT_API_VERSION = DEPLOYMENT_API_VERSION
#: How each shape spells a profile type; a type missing from a shape cannot be emitted in it.
_SPELLINGS: dict[str, dict[m.ProfileType, str]] = {
    Shape.OCT_2024: {m.ProfileType.HELM: "helm.v3", m.ProfileType.COMPOSE: "docker-compose"},
    Shape.RC2: {m.ProfileType.HELM: "helm", m.ProfileType.COMPOSE: "compose"},
    Shape.RC3: {m.ProfileType.HELM: "helm", m.ProfileType.COMPOSE: "compose",
                m.ProfileType.CUSTOM: "custom"},
}
#: Where an rc.2 document keeps its profile's `deviceConstraints`: the rc.2 profile has no
#: such field (the rc.2 OpenAPI closes it) but takes `x-…-extensions`, and the compiler reads
#: what a file on a device takes back from the file itself (`compiler.storedfiles`).
CONSTRAINTS_EXTENSION = ("x-margo-gitops-extensions", "deviceConstraints")
_HEAD = f"apiVersion: {DEPLOYMENT_API_VERSION}\nkind: ApplicationDeployment\n".encode()


def profile_type_spelling(shape: str, profile_type: m.ProfileType) -> str | None:
    """How `shape` spells a profile type; None when that generation has no such type."""
    return _SPELLINGS.get(shape, {}).get(profile_type)


def emitted_shape(data: bytes) -> Shape | None:
    """The shape of a document `deployment_yaml` wrote, told from its first lines (rc.3
    begins with its id; rc.2 and Oct-2024 with apiVersion and kind, then the id or the
    metadata); None for anything else."""
    if data.startswith(b"id: "):
        return Shape.RC3
    if not data.startswith(_HEAD):
        return None
    rest = data[len(_HEAD):]
    if rest.startswith(b"id: "):
        return Shape.RC2
    return Shape.OCT_2024 if rest.startswith(b"metadata:\n") else None


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
    """An ApplicationDeployment as a dict in the shape of a spec generation: `rc.3` (the
    default), `rc.2` or `oct-2024`, for devices that speak those.

    `spec_key`, when given, must identify the content of `spec` (e.g. the digest of the
    description, the profile id and the parameter values): its YAML text is then produced
    once and reused for every device that gets the same spec (`margo.canonical.Cached`).
    `ValueError` for a shape that cannot hold the deployment (a profile type it lacks):
    callers that emit for devices check `profile_type_spelling` first and say why.
    """
    builder = _BUILDERS.get(shape)
    if builder is None:
        raise ValueError(f"cannot emit an ApplicationDeployment in shape {shape!r}")
    spelling = profile_type_spelling(shape, deployment.profile.type)
    if spelling is None:
        raise ValueError(f"profile type {deployment.profile.type} has no {shape} spelling")
    return builder(deployment, spelling, spec_key)


def _oct_2024(deployment: m.ApplicationDeployment, spelling: str,
              spec_key: Any) -> dict[str, Any]:
    """Oct-2024: ids in annotations, no device id, no constraints and no extensions
    anywhere (its schema closes every object)."""
    annotations = {"id": deployment.id, "applicationId": deployment.application_id,
                   **dict(sorted(deployment.annotations.items()))}
    metadata: dict[str, Any] = {"annotations": annotations, "name": deployment.name,
                                "namespace": deployment.namespace}
    if deployment.labels:
        metadata["labels"] = dict(sorted(deployment.labels.items()))
    profile: dict[str, Any] = {
        "type": spelling,
        "components": [_component(c, extensions=False) for c in deployment.profile.components],
    }
    spec: dict[str, Any] = {"deploymentProfile": profile}
    if deployment.parameters:
        spec["parameters"] = _parameters(deployment.parameters)
    return {"apiVersion": DEPLOYMENT_API_VERSION, "kind": "ApplicationDeployment",
            "metadata": metadata, "spec": _maybe_cached(spec, spec_key, Shape.OCT_2024)}


def _rc2(deployment: m.ApplicationDeployment, spelling: str,
         spec_key: Any) -> dict[str, Any]:
    """rc.2 (the rc.2 OpenAPI's `appDeploymentManifest`): apiVersion and kind, the id on
    top, `metadata.deviceId` and `metadata.annotations` (both required there), the
    application id in `spec` and, as the intermediate examples have it, in the annotations;
    constraints in an extension (`CONSTRAINTS_EXTENSION`)."""
    metadata = _metadata(deployment)
    metadata["annotations"] = {"applicationId": deployment.application_id,
                               **dict(sorted(deployment.annotations.items()))}
    profile = _profile(deployment.profile, spelling, constraints=False)
    if deployment.profile.device_constraints is not None:
        ours, field = CONSTRAINTS_EXTENSION
        profile[ours] = {**profile.get(ours, {}), field: deployment.profile.device_constraints}
    spec = _spec(deployment, profile)
    return {"apiVersion": DEPLOYMENT_API_VERSION, "kind": "ApplicationDeployment",
            "id": deployment.id, "metadata": metadata,
            "spec": _maybe_cached(spec, spec_key, Shape.RC2)}


def _rc3(deployment: m.ApplicationDeployment, spelling: str,
         spec_key: Any) -> dict[str, Any]:
    """rc.3: no apiVersion or kind, the id on top, constraints in the profile."""
    metadata = _metadata(deployment)
    if deployment.annotations:
        metadata["annotations"] = dict(sorted(deployment.annotations.items()))
    spec = _spec(deployment, _profile(deployment.profile, spelling, constraints=True))
    return {"id": deployment.id, "metadata": metadata,
            "spec": _maybe_cached(spec, spec_key, Shape.RC3)}


def _metadata(deployment: m.ApplicationDeployment) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": deployment.name, "namespace": deployment.namespace}
    if deployment.device_id is not None:
        metadata["deviceId"] = deployment.device_id
    if deployment.labels:
        metadata["labels"] = dict(sorted(deployment.labels.items()))
    return metadata


def _profile(profile: m.DeploymentProfile, spelling: str, *,
             constraints: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": spelling,
        "components": [_component(c, extensions=True) for c in profile.components],
    }
    if constraints and profile.device_constraints is not None:
        out["deviceConstraints"] = profile.device_constraints
    out.update(profile.extensions)
    return out


def _spec(deployment: m.ApplicationDeployment, profile: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"applicationId": deployment.application_id,
                            "deploymentProfile": profile}
    if deployment.parameters:
        spec["parameters"] = _parameters(deployment.parameters)
    spec.update(deployment.extensions)
    return spec


_BUILDERS: dict[str, Callable[[m.ApplicationDeployment, str, Any], dict[str, Any]]] = {
    Shape.OCT_2024: _oct_2024, Shape.RC2: _rc2, Shape.RC3: _rc3}


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
