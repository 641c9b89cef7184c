"""Desired state as the device sees it: ApplicationDeployment documents turned into what the
planner and the drivers need (per component: where the package is, how to wait, and the
exact configuration the deployment's parameters give it).

Every desired component carries two fingerprints. `spec_digest` covers what must be
*upgraded* when it changes (package repository and revision); `values_digest` covers what
only needs a *reconfigure* (the values or environment the parameters produce). The planner
compares them with the fingerprints stored on installed releases.

Sealed parameter values (`margo.sealing`) stay sealed here: `values` holds the envelopes,
which only a driver opens, in memory, just before applying (`reconciler.sealed_values`).
`values_digest` covers each envelope by its mac, so sealing the same plaintext again (a new
ciphertext after a key rotation) is no change; `sealed_digest` covers their exact text.

Registry credentials the fleet grants to a deployment (`reconciler.registry_grants`) are
read into `DesiredDeployment.registry_grants`, their passwords sealed likewise. A grant's
registry, user name and password (by its mac) count in `values_digest` when there are grants:
a changed credential is a reconfigure, which is what writes it where an engine keeps it (the
Helm driver's image pull Secret in the cluster); the same password sealed again is no change.
Their envelopes count in every component's `sealed_digest`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from margo import models as m
from margo.component_values import compose_environment, helm_values
from margo.digests import data_digest, digest_of
from margo.errors import DocumentError, Problem
from margo.kinds import Kind
from margo.validation import validate_document
from reconciler.registry_grants import RegistryGrant, parse_grants
from reconciler.sealed_values import digest_form, envelopes

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "DesiredComponent", "DesiredDeployment",
           "DesiredState", "parse_deployment", "parse_duration"]

DEFAULT_TIMEOUT_SECONDS = 300.0  # Helm's own default (5m0s)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def parse_duration(text: str) -> float:
    """A Go/Helm duration (`8m30s`, `90s`, `1h`, `500ms`) in seconds; `ValueError` otherwise."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected a duration like '2m30s', found {text!r}")
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    position, total = 0, 0.0
    for match in _DURATION.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * units[match.group(2)]
        position = match.end()
    if position != len(text):
        raise ValueError(f"expected a duration like '2m30s', found {text!r}")
    return total


@dataclass(frozen=True)
class DesiredComponent:
    """One component of a desired deployment, ready for a driver."""

    name: str
    index: int  # position in the deployment's component list (install order)
    repository: str
    revision: str
    wait: bool
    timeout_seconds: float
    values: Mapping[str, Any]  # Helm values (nested) or Compose environment (flat strings)
    spec_digest: str
    values_digest: str
    extensions: Mapping[str, Any] = field(default_factory=dict)
    #: The digest of the sealed values' exact text, and of the deployment's registry grants
    #: ("" when none is sealed): what the runner's retry key adds, so a value that could not
    #: be opened is tried again as soon as the server sends another envelope (re-sealed to
    #: this device's current key), and a pull the registry refused once a grant changes.
    sealed_digest: str = ""


@dataclass(frozen=True)
class DesiredDeployment:
    """One ApplicationDeployment the device must run."""

    deployment_id: str
    name: str
    namespace: str
    device_id: str | None
    application_id: str
    profile_type: str  # "helm" or "compose"
    components: tuple[DesiredComponent, ...]
    digest: str  # sha256 over the exact document bytes
    document: bytes
    #: Registry credentials the fleet grants to this deployment's pulls (passwords sealed).
    registry_grants: tuple[RegistryGrant, ...] = ()

    def component(self, name: str) -> DesiredComponent | None:
        return next((c for c in self.components if c.name == name), None)


@dataclass(frozen=True)
class DesiredState:
    """Everything a source delivered at one version (a commit, or a manifestVersion)."""

    source: str  # "git" or "margo-rest"
    version: str  # commit id, or the manifestVersion as decimal text
    manifest_version: int | None
    etag: str | None
    deployments: tuple[DesiredDeployment, ...]
    #: Set when this state was accepted only because an operator allowed a rewritten Git
    #: history up to this commit (`source.acceptHistoryRewrite`); adopting it spends that
    #: override, so the same setting cannot let a later rollback through.
    history_rewrite_accepted: str | None = None

    def by_id(self) -> dict[str, DesiredDeployment]:
        return {d.deployment_id: d for d in self.deployments}


def _component(component: m.Component, index: int, deployment: m.ApplicationDeployment,
               file: str, grants: tuple[RegistryGrant, ...]) -> DesiredComponent:
    props = component.properties
    where = f"{file}: component {component.name!r}"
    repository = props.repository or props.package_location
    if not repository:
        raise ValueError(f"{where}: no 'repository' to install from")
    revision = props.revision or ""
    try:
        timeout = parse_duration(props.timeout) if props.timeout else DEFAULT_TIMEOUT_SECONDS
    except ValueError as exc:
        raise ValueError(f"{where}: timeout: {exc}") from None
    parameters = {name: {"value": p.value,
                         "targets": [{"pointer": t.pointer, "components": list(t.components)}
                                     for t in p.targets]}
                  for name, p in deployment.parameters.items()}
    try:
        if deployment.profile.type == m.ProfileType.COMPOSE:
            values: dict[str, Any] = dict(compose_environment(parameters, component.name))
        else:
            values = helm_values(parameters, component.name)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: parameters: {exc}") from None
    spec = {"repository": repository, "revision": revision}
    sealed = envelopes(values) + [grant.password for grant in grants]
    return DesiredComponent(
        name=component.name, index=index, repository=repository, revision=revision,
        wait=props.wait is not False, timeout_seconds=timeout, values=values,
        spec_digest=data_digest(spec), values_digest=_values_digest(values, grants),
        extensions=dict(component.extensions),
        sealed_digest=data_digest(sealed) if sealed else "")


def _values_digest(values: Mapping[str, Any], grants: Iterable[RegistryGrant]) -> str:
    """`values_digest`: the values (envelopes by mac) and, only when there are any, the
    grants (so digests of deployments without grants are what they always were)."""
    granted = [[g.registry, g.username, digest_form(g.password)] for g in grants]
    if not granted:
        return data_digest(digest_form(values))
    return data_digest({"values": digest_form(values), "registryCredentials": granted})


def parse_deployment(data: bytes, *, file: str = "deployment.yaml") -> DesiredDeployment:
    """Validate one ApplicationDeployment (any spec shape) and prepare it for planning.

    Raises `DocumentError` (located problems) for an invalid document and `ValueError` for a
    valid document the device cannot act on (no repository, unknown profile type, a
    malformed timeout, conflicting parameter targets or unusable registry grants)."""
    report = validate_document(data, file=file, expect=Kind.APPLICATION_DEPLOYMENT)
    if report.problems:
        raise DocumentError(report.problems)
    deployment: m.ApplicationDeployment = report.model
    if deployment.profile.type not in (m.ProfileType.HELM, m.ProfileType.COMPOSE):
        raise ValueError(f"{file}: profile type {str(deployment.profile.type)!r} is not "
                         "supported by this device (helm, compose)")
    names = [c.name for c in deployment.profile.components]
    if len(set(names)) != len(names):
        raise DocumentError([Problem(path=("spec", "deploymentProfile", "components"),
                                     message="component names must be unique", file=file)])
    grants = parse_grants(deployment.extensions, file=file)
    components = tuple(_component(c, i, deployment, file, grants)
                       for i, c in enumerate(deployment.profile.components))
    return DesiredDeployment(
        deployment_id=deployment.id, name=deployment.name, namespace=deployment.namespace,
        device_id=deployment.device_id, application_id=deployment.application_id,
        profile_type=str(deployment.profile.type), components=components,
        digest=digest_of(data), document=data, registry_grants=grants)


def index_deployments(deployments: Iterable[DesiredDeployment]) -> dict[str, DesiredDeployment]:
    """By deployment id; two documents with one id are an error (the source is broken)."""
    out: dict[str, DesiredDeployment] = {}
    for deployment in deployments:
        if deployment.deployment_id in out:
            raise ValueError(f"two documents share deployment id {deployment.deployment_id}")
        out[deployment.deployment_id] = deployment
    return out
