"""Test kit: one application and its intent in a matrix fleet source, as the operator and
the vendor handle them (`Application`), the profiles the features use (`capacity`,
`GPU_DEPLOYMENT`, ...) and `Change`, the moment an operator acted."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from compiler.secrets import encrypt_secret
from kits.chartkit import deployment_template, publish_chart, write_chart
from kits.dockerkit import (
    compose_package,
    web_service,
)
from kits.matrixparts import PRIVATE_PASSWORD, PRIVATE_USER, FleetHost, MatrixParts
from reconciler.oci import OciClient

# --- a device of one cell ---------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """An operator's change: when it was made, and the digests of the device's deployments
    just before (a settled deployment must have moved on from them)."""

    at: float
    before: dict[str, str] = field(default_factory=dict)


def capacity(cores: float, memory: str = "256Mi", **clauses: Any) -> dict[str, Any]:
    """A profile's `deviceConstraints`: `cores` and `memory`, plus further clauses
    (`eligibilityRules`, `x-margo-gitops-extensions`, ...)."""
    return {"capacityRequirements": {"cpu": {"cores": cores}, "memory": memory}, **clauses}


#: What every matrix application's profile requires unless a test says otherwise.
DEFAULT_CONSTRAINTS = capacity(0.5)

#: A chart Deployment whose pod requests a GPU (extended resources go in limits), for
#: the Helm cells' GPU application (`templates={"deployment.yaml": GPU_DEPLOYMENT}`).
GPU_DEPLOYMENT = deployment_template(
    "          image: registry.example.com/greeter:{{ .Chart.Version }}\n"
    "          resources:\n            requests: {cpu: 50m}\n"
    "            limits: {nvidia.com/gpu: 1}\n")
#: Its profile: half a core, and a node with a GPU available: the documented cluster clause
#: (docs/kubernetes.md, docs/intents.md "Requirements on Kubernetes clusters").
GPU_NODE_CONSTRAINTS = capacity(0.5, **{"x-margo-gitops-extensions": {"cluster": {"nodes": [
    {"capacity": {"resources": {"nvidia.com/gpu": 1}}}]}}})

#: A ConfigMap the API server refuses (its name is not a lowercase DNS subdomain): a Helm
#: upgrade to a chart holding it renders, starts applying and fails, and the release's
#: newest revision is `failed`.
REFUSED_OBJECT = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-Refused
data: {}
"""


@dataclass
class Application:
    """One application and its intent in a store's fleet source, as the operator and the
    vendor handle them: versions published to the registry (a chart, or a Compose package)
    and added to the source, the intent written, edited and removed. A cell's device has
    one of its own (`MatrixDevice.deploy`, ...); `MatrixDevice.application(name)` gives it
    another, and a mixed fleet's devices share one (`targets` lists them)."""

    host: FleetHost
    parts: MatrixParts
    driver: str
    app_id: str
    intent: str
    namespace: str
    targets: list[str]
    charts: Path                 # where its charts are written
    repo_path: str               # its packages' path in the registry
    versions: list[str] = field(default_factory=list)
    #: version -> (package repository, the profile's deviceConstraints)
    published: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    constraints: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONSTRAINTS))
    #: The greeting is a sensitive parameter (issue 32): the description marks it, and the
    #: intent gives it as a secret encrypted to the fleet key (`deploy`, `reconfigure`).
    sensitive: bool = False
    #: Its packages are in the registry that requires credentials (`private_registry`).
    private: bool = False
    _spec: dict[str, Any] = field(default_factory=dict)

    @property
    def compose(self) -> bool:
        return self.driver == "compose"

    def deploy(self, greeting: str = "Hello", **spec: Any) -> None:
        """Write the intent: the application, on the driver's profile type, in its
        namespace, for its targets, with further `spec` keys (`gracePeriod`, `rollout`,
        `priority`, ...)."""
        self._spec = spec
        value: Any = greeting
        if self.sensitive:
            value = {"secret": encrypt_secret(greeting, [self.host.fleet_key.recipient])}
        self.host.server.edit_intent(self.intent, yaml.safe_dump({
            "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": self.intent},
            "spec": {"application": {"id": self.app_id},
                     "profile": {"type": "compose" if self.compose else "helm"},
                     "namespace": self.namespace,
                     "parameters": {"greeting": value},
                     "targets": {"devices": list(self.targets)}, **spec}}, sort_keys=False))

    def reconfigure(self, greeting: str) -> None:
        if self.sensitive:  # a secret is a whole armored file: the intent is written again
            self.deploy(greeting, **self._spec)
            return
        self.host.server.set_parameter(self.intent, "greeting", greeting)

    def publish(self, version: str, *, constraints: dict[str, Any] | None = None,
                failing: bool = False, templates: dict[str, str] | None = None) -> None:
        """Push the package at `version` and add that application version to the source.
        `constraints`: its profile's deviceConstraints (default: those of the last one
        published). `failing`: a revision that fails on the engine: on render a template
        that does not render, on Helm an object the API server refuses, on Compose a
        service that exits during start-up. `templates`: chart templates to add or
        replace (name -> text)."""
        if constraints is not None:
            self.constraints = constraints
        repository = self._publish_package(version, failing, templates or {})
        self.published[version] = (repository, self.constraints)
        self.host.write_application(self.app_id, version,
                                    self.description(version, repository, self.constraints))
        self.versions.append(version)

    def set_constraints(self, constraints: dict[str, Any], version: str | None = None) -> None:
        """Rewrite the description of `version` (default the newest) with other
        deviceConstraints: the same package, only the profile's requirements differ."""
        version = version or self.versions[-1]
        repository, _ = self.published[version]
        self.constraints = constraints
        self.published[version] = (repository, constraints)
        self.host.write_application(self.app_id, version,
                                    self.description(version, repository, constraints))

    def delete(self) -> None:
        """Remove the intent from the fleet source."""
        self.host.server.remove_intent(self.intent)

    def remove(self) -> None:
        """Take the intent (if still there) and the application out of the fleet source."""
        with contextlib.suppress(FileNotFoundError):
            self.host.server.remove_intent(self.intent)
        self.host.remove_application(self.app_id)

    def _publish_package(self, version: str, failing: bool,
                         templates: dict[str, str]) -> str:
        registry = self.parts.private_registry() if self.private else self.parts.registry()
        credentials = {registry: (PRIVATE_USER, PRIVATE_PASSWORD)} if self.private else {}
        if self.compose:
            _, images = self.parts.docker()
            image = images.web_1 if len(self.versions) % 2 == 0 else images.web_2
            repository = f"oci://{registry}/{self.repo_path}/web"
            services: dict[str, Any] = {"web": web_service(
                image, environment={"GREETING": "${GREETING:-unset}", "APP_VERSION": version})}
            if failing:  # exits 3 during start-up: `up --wait` fails
                services["migrate"] = {"image": images.crash, "depends_on": []}
            with OciClient(credentials=credentials) as oci:
                return compose_package(oci, repository, version, services)
        chart = write_chart(self.charts, "greeter", version, deployment=True,
                            broken=failing and self.driver == "render")
        if failing and self.driver == "helm":
            (chart / "templates" / "refused.yaml").write_text(REFUSED_OBJECT)
        for name, text in templates.items():
            (chart / "templates" / name).write_text(text)
        return publish_chart(registry, chart, repo_path=self.repo_path,
                             credentials=credentials.get(registry))

    def description(self, version: str, repository: str,
                    constraints: dict[str, Any]) -> dict[str, Any]:
        """The application at `version`: one profile for the driver (render and helm
        install a chart, compose a Compose package), a greeting parameter."""
        component = "web" if self.compose else "greeter"
        return {
            "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription",
            "id": self.app_id,
            "metadata": {"name": f"Matrix {self.app_id.removeprefix('com-example-')}",
                         "version": version,
                         "catalog": {"organization": [{"name": "Example Industries"}]}},
            "deploymentProfiles": [{
                "type": "compose" if self.compose else "helm", "id": f"{component}-profile",
                "components": [{"name": component, "properties": {
                    "repository": repository, "revision": version, "wait": True,
                    "timeout": "1m0s"}}],
                "deviceConstraints": constraints}],
            "parameters": {"greeting": {
                **({"sensitive": True} if self.sensitive else {"value": "Hello"}),
                "targets": [{"pointer": "GREETING" if self.compose else "config.greeting",
                             "components": [component]}]}},
        }
