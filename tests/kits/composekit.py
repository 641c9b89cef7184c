"""Test kit: Compose ApplicationDeployments for the Compose driver's tests (one component,
`hello-world`, whose GREETING parameter becomes its environment)."""

from __future__ import annotations

import json

from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.releases import release_name

__all__ = ["DEPLOYMENT_ID", "PROJECT", "compose_deployment"]

DEPLOYMENT_ID = "5f3c7a52-1f0e-4c1e-9a37-6f4f3f0c2b11"
PROJECT = release_name(DEPLOYMENT_ID, "hello-world")

_DEPLOYMENT = """\
id: {id}
metadata: {{name: hello, namespace: hello, deviceId: compose-box}}
spec:
  applicationId: com-example-hello
  deploymentProfile:
    type: compose
    components:
      - name: hello-world
        properties: {{repository: "{repository}", revision: {revision},
                     wait: {wait}, timeout: {timeout}}}
  parameters:
    greeting:
      value: {greeting}
      targets: [{{pointer: GREETING, components: [hello-world]}}]
"""


def compose_deployment(repository: str, *, revision: str = "1.0.0", greeting: str = "Hello",
                       wait: bool = True, timeout: str = "0m30s") -> DesiredDeployment:
    """A parsed compose ApplicationDeployment of `repository` at `revision`."""
    return parse_deployment(_DEPLOYMENT.format(
        id=DEPLOYMENT_ID, repository=repository, revision=revision, wait=str(wait).lower(),
        timeout=timeout, greeting=json.dumps(greeting)).encode())
