"""The one internal model every Margo document shape is normalised into.

Code above this layer (compiler, server, reconciler) never looks at spec-generation
differences: `helm.v3` is `helm`, `docker-compose` is `compose`, `metadata.annotations.id`
is `ApplicationDeployment.id`, Oct-2024 `resources.cpu` is a `cpus` entry, `Installed` is
`installed`. Free-form content the spec says to carry verbatim (deviceConstraints,
`x-…-extensions`, labels) is kept as plain JSON-compatible data in source order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from margo.kinds import Shape

__all__ = [
    "ApplicationDeployment",
    "ApplicationDescription",
    "BundleRef",
    "Component",
    "ComponentProperties",
    "ComponentStatus",
    "DeploymentProfile",
    "DeploymentRef",
    "DeploymentState",
    "DeploymentStatus",
    "DeviceCapabilities",
    "Parameter",
    "ParameterTarget",
    "ProfileType",
    "Section",
    "Setting",
    "StateManifest",
]

JSON = Any
Extensions = Mapping[str, JSON]


class ProfileType(StrEnum):
    HELM = "helm"
    COMPOSE = "compose"
    CUSTOM = "custom"


class DeploymentState(StrEnum):
    """Deployment/component states, listed from most to least severe (digest section 11.6)."""

    FAILED = "failed"
    REMOVING = "removing"
    INSTALLING = "installing"
    PENDING = "pending"
    REMOVED = "removed"
    INSTALLED = "installed"

    @property
    def severity(self) -> int:
        return len(DeploymentState) - list(DeploymentState).index(self)


@dataclass(frozen=True, slots=True)
class ComponentProperties:
    """OCI coordinates (rc.2+) or the Oct-2024 compose package location."""

    repository: str | None = None
    revision: str | None = None
    wait: bool | None = None  # None: not stated; the spec default is true
    timeout: str | None = None
    package_location: str | None = None
    key_location: str | None = None

    @property
    def effective_wait(self) -> bool:
        return True if self.wait is None else self.wait


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    properties: ComponentProperties
    extensions: Extensions = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ParameterTarget:
    pointer: str
    components: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Parameter:
    name: str
    targets: tuple[ParameterTarget, ...]
    value: JSON = None
    has_value: bool = False
    #: `sensitive: true` (specification issue #145): the value is a secret, given by an
    #: intent as ciphertext and sealed to each device (docs/secrets.md).
    sensitive: bool = False


@dataclass(frozen=True, slots=True)
class DeploymentProfile:
    type: ProfileType
    components: tuple[Component, ...]
    id: str | None = None
    description: str | None = None
    device_constraints: Mapping[str, JSON] | None = None
    required_resources: Mapping[str, JSON] | None = None
    extensions: Extensions = field(default_factory=dict)

    def component(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)


@dataclass(frozen=True, slots=True)
class Setting:
    parameter: str
    name: str
    schema: str
    description: str | None = None
    immutable: bool = False


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    settings: tuple[Setting, ...]


@dataclass(frozen=True, slots=True)
class ApplicationDescription:
    id: str
    name: str
    version: str
    profiles: tuple[DeploymentProfile, ...]
    parameters: Mapping[str, Parameter]
    sections: tuple[Section, ...]
    schemas: Mapping[str, Mapping[str, JSON]]
    catalog: Mapping[str, JSON]
    description: str | None = None
    api_version: str = "margo.org/v1-alpha1"
    extensions: Extensions = field(default_factory=dict)
    shape: Shape = Shape.RC3

    def profile(self, profile_id: str) -> DeploymentProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def settings(self) -> dict[str, Setting]:
        """Settings by parameter name."""
        return {s.parameter: s for section in self.sections for s in section.settings}

    def sensitive_parameters(self) -> frozenset[str]:
        """Parameters marked `sensitive: true`, or whose setting's schema entry is
        (specification issue #145): their values are secrets (docs/secrets.md)."""
        rules = {name for name, rule in self.schemas.items() if rule.get("sensitive") is True}
        return frozenset({name for name, p in self.parameters.items() if p.sensitive}
                         | {s.parameter for s in self.settings().values() if s.schema in rules
                            and s.parameter in self.parameters})


@dataclass(frozen=True, slots=True)
class ApplicationDeployment:
    id: str
    name: str
    namespace: str
    application_id: str
    profile: DeploymentProfile
    parameters: Mapping[str, Parameter]
    device_id: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    extensions: Extensions = field(default_factory=dict)  # spec-level x-…-extensions
    shape: Shape = Shape.RC3


@dataclass(frozen=True, slots=True)
class DeviceCapabilities:
    """A device as the matcher sees it: rc.3 `properties`, `labels` and extensions."""

    device_id: str
    properties: Mapping[str, JSON]
    labels: Mapping[str, JSON] = field(default_factory=dict)
    extensions: Extensions = field(default_factory=dict)
    roles: tuple[str, ...] = ()  # Oct-2024 roles, kept for display
    shape: Shape = Shape.RC3


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    name: str
    state: DeploymentState
    error: Mapping[str, JSON] | None = None


@dataclass(frozen=True, slots=True)
class DeploymentStatus:
    deployment_id: str
    state: DeploymentState
    components: tuple[ComponentStatus, ...]
    error: Mapping[str, JSON] | None = None
    device_id: str | None = None
    adopted_manifest_version: int | None = None
    extensions: Extensions = field(default_factory=dict)
    shape: Shape = Shape.RC3


@dataclass(frozen=True, slots=True)
class BundleRef:
    media_type: str
    digest: str
    url: str
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class DeploymentRef:
    deployment_id: str
    digest: str
    url: str
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class StateManifest:
    manifest_version: int
    bundle: BundleRef | None
    deployments: tuple[DeploymentRef, ...]
