"""Test helpers for the Helm side of the device client: small real charts, published to the
real OCI registry, and desired deployments that install them.

Charts are written as files, packaged and pushed with the real Helm engine, exactly as a
vendor would publish them. Deployments are real ApplicationDeployment documents parsed by
`reconciler.desired.parse_deployment`, and steps come from the real planner, so the driver
tests exercise the same path a device takes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.base import Driver
from reconciler.planner import Plan, plan
from tools.charts import EXAMPLE_CHARTS, chart_digest, publish_chart, publish_example_charts

__all__ = ["EXAMPLE_CHARTS", "actions", "chart_digest", "converge", "deployment_template",
           "greeter", "make_deployment", "publish_chart", "publish_example_charts",
           "write_chart"]

ROOT = Path(__file__).resolve().parents[2]

DEPLOYMENT_ID = "5f0c7a52-7f5e-4c1e-9d43-0b5a1d9e2a10"

CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-config
  labels:
    app.kubernetes.io/instance: {{ .Release.Name }}
data:
  greeting: {{ .Values.config.greeting | quote }}
  replicas: {{ .Values.replicaCount | quote }}
  chartVersion: {{ .Chart.Version | quote }}
"""

# On the real control plane the scheduler places the pods and kwok makes them Ready; a CPU
# request larger than any node (`cpu=...` in write_chart) keeps them Pending, which is how
# the tests show a readiness wait that never succeeds.
def deployment_template(container: str, *, replicas: str = "1", pod: str = "") -> str:
    """A chart's Deployment template, named and selected by the release, around one container
    `app`: `container` holds its lines after the name (indented 10 spaces), `pod` the pod
    spec's lines before the containers (indented 6). The charts of every Helm test share it."""
    return ("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {{ .Release.Name }}\n"
            f"spec:\n  replicas: {replicas}\n  selector:\n"
            "    matchLabels: {app.kubernetes.io/instance: {{ .Release.Name }}}\n"
            "  template:\n    metadata:\n"
            "      labels: {app.kubernetes.io/instance: {{ .Release.Name }}}\n"
            f"    spec:\n{pod}      containers:\n        - name: app\n{container}")


DEPLOYMENT = deployment_template(
    "          image: registry.example.com/greeter:{{ .Chart.Version }}\n"
    "          resources:\n            requests: {cpu: {{ .Values.cpu | quote }}}\n",
    replicas="{{ .Values.replicaCount }}")

# Fails at render time with Helm's own message, unless config.token is set.
BROKEN = '{{ required "config.token must be set" .Values.config.token }}\n'

SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["replicaCount", "config"],
    "properties": {
        "replicaCount": {"type": "integer", "minimum": 1, "maximum": 10},
        "config": {
            "type": "object",
            "properties": {"greeting": {"type": "string", "maxLength": 32}},
        },
    },
}


def write_chart(root: Path, name: str = "greeter", version: str = "1.0.0", *,
                greeting: str = "Hello", deployment: bool = False, broken: bool = False,
                schema: bool = True, cpu: str = "50m") -> Path:
    """Write a chart directory `root/<name>-<version>/` and return it.

    Always: a ConfigMap showing `.Values.config.greeting`, `.Values.replicaCount` and the
    chart version, a NOTES.txt and a helper template (neither is a manifest). Options add
    a Deployment whose pods request `cpu` (by default small: they run; larger than any node:
    they stay Pending), a template that fails to render, and the values.schema.json
    (replicaCount 1..10, greeting at most 32 characters)."""
    chart = root / f"{name}-{version}"
    templates = chart / "templates"
    templates.mkdir(parents=True, exist_ok=True)
    (chart / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": name, "version": version, "appVersion": version,
        "description": f"{name} test chart", "type": "application"}, sort_keys=False))
    (chart / "values.yaml").write_text(yaml.safe_dump(
        {"replicaCount": 1, "cpu": cpu, "config": {"greeting": greeting}}, sort_keys=False))
    if schema:
        (chart / "values.schema.json").write_text(json.dumps(SCHEMA, indent=2))
    (templates / "_helpers.tpl").write_text('{{- define "greeter.name" -}}greeter{{- end -}}\n')
    (templates / "NOTES.txt").write_text("{{ .Release.Name }} says {{ .Values.config.greeting }}\n")
    (templates / "configmap.yaml").write_text(CONFIGMAP)
    if deployment:
        (templates / "deployment.yaml").write_text(DEPLOYMENT)
    if broken:
        (templates / "broken.yaml").write_text(BROKEN)
    return chart


def make_deployment(components: Mapping[str, tuple[str, str]], *,
                    parameters: Mapping[str, tuple[Any, str, list[str]]] | None = None,
                    namespace: str = "edge", deployment_id: str = DEPLOYMENT_ID,
                    wait: bool = False, timeout: str | None = None) -> DesiredDeployment:
    """A parsed ApplicationDeployment (newest shape) with helm components.

    `components`: name -> (repository, revision), in install order. `parameters`: name ->
    (value, pointer, [component names])."""
    properties: dict[str, Any] = {"wait": wait}
    if timeout is not None:
        properties["timeout"] = timeout
    document = {
        "id": deployment_id,
        "metadata": {"name": "greeter-deployment", "namespace": namespace,
                     "deviceId": "edge-device-1"},
        "spec": {
            "applicationId": "com-example-greeter",
            "deploymentProfile": {"type": "helm", "components": [
                {"name": name, "properties": {"repository": repository, "revision": revision,
                                              **properties}}
                for name, (repository, revision) in components.items()]},
            "parameters": {
                name: {"value": value, "targets": [{"pointer": pointer, "components": targets}]}
                for name, (value, pointer, targets) in (parameters or {}).items()},
        },
    }
    return parse_deployment(yaml.safe_dump(document, sort_keys=False).encode())


def greeter(repository: str, revision: str = "1.0.0", *, greeting: str | None = None,
            replicas: Any = None, **options: Any) -> DesiredDeployment:
    """One-component deployment of a greeter chart, optionally setting its values."""
    parameters: dict[str, tuple[Any, str, list[str]]] = {}
    if greeting is not None:
        parameters["greeting"] = (greeting, "config.greeting", ["greeter"])
    if replicas is not None:
        parameters["replicas"] = (replicas, "replicaCount", ["greeter"])
    return make_deployment({"greeter": (repository, revision)}, parameters=parameters,
                           **options)


def converge(driver: Driver, desired: list[DesiredDeployment]) -> Plan:
    """Plan `desired` against what `driver` reports installed and apply every change, each
    read back from the engine (`Driver.confirm`), as the device's runner does (minus status
    reporting). Returns the plan that was applied."""
    the_plan = plan(desired, driver.installed())
    for deployment_plan in the_plan.deployments:
        for step in deployment_plan.changes:
            driver.apply(step, deployment_plan.deployment)
            driver.confirm(step, deployment_plan.deployment)
    return the_plan


def actions(the_plan: Plan) -> list[str]:
    """`action:component` for every change in a plan (for compact assertions)."""
    return [f"{step.action}:{step.component}" for step in the_plan.changes]
