"""The Compose box the device benchmarks share: a private Docker engine, a busybox web
application (a Compose package with a health check and `wait: true`) published to the
registry, a server with an intent per deployment, and the box's configuration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from margo.archive import deterministic_targz
from reconciler.oci import OciClient
from tools.devices import compose_device
from tools.docker.dockerengine import DockerEngine, running_engine
from tools.docker.testimages import push_image, web_image
from tools.fleetserver import FleetServer, fleet_server, write_fleet

__all__ = ["compose_box"]

COMPOSE_APP = """\
apiVersion: margo.org/v1-alpha1
kind: ApplicationDescription
id: com-example-bench-web
metadata:
  name: Bench Web
  version: 1.0.0
  catalog: {{organization: [{{name: Bench}}]}}
deploymentProfiles:
  - type: compose
    id: web
    components:
      - name: web
        properties: {{repository: "oci://{registry}/bench/web", revision: 1.0.0, wait: true,
                     timeout: 1m0s}}
parameters:
  greeting:
    value: Hello
    targets: [{{pointer: GREETING, components: [web]}}]
"""
#: One deployment of the web application: `name`, `greeting` and `device` to fill in.
COMPOSE_INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {{name: {name}}}
spec:
  application: {{id: com-example-bench-web}}
  profile: {{type: compose}}
  parameters:
    greeting: {greeting}
  targets: {{devices: [{device}]}}
"""
COMPOSE_FILE = """\
services:
  web:
    image: {image}
    environment: {{GREETING: "${{GREETING}}"}}
    healthcheck:
      test: ["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8080/"]
      interval: 1s
      retries: 5
"""


def _compose_fleet(work: Path, engine: DockerEngine, registry: str) -> Path:
    """The web image and its Compose package pushed to `registry` (the engine pulls the
    image back, as a device would), and a fleet source holding the application."""
    image = f"{registry}/bench/web-image:1.0"
    web_image(engine, image, "1.0")
    push_image(engine, image)
    engine.run("rmi", image)
    with OciClient() as oci:
        oci.push_artifact(f"oci://{registry}/bench/web", "1.0.0", deterministic_targz(
            {"web/compose.yaml": COMPOSE_FILE.format(image=image).encode()}))
    fleet = write_fleet(work / "compose-fleet", registry=registry, intents={})
    app = fleet / "apps" / "com-example-bench-web" / "margo.yaml"
    app.parent.mkdir(parents=True)
    app.write_text(COMPOSE_APP.format(registry=registry))
    return fleet


@contextmanager
def compose_box(work: Path, registry: str, device_id: str, deployments: int,
                **extra: Any) -> Iterator[tuple[FleetServer, Path]]:
    """The server, with `deployments` web deployments compiled for the box `device_id`,
    and the box's configuration (`extra`: more top-level settings); all stopped after."""
    with running_engine(work / "docker") as engine:
        fleet = _compose_fleet(work, engine, registry)
        with fleet_server(work / "compose-server", fleet=fleet) as server:
            config = compose_device(work / device_id, server, engine, device_id, **extra)
            for index in range(deployments):
                server.edit_intent(f"web-{index}", COMPOSE_INTENT.format(
                    name=f"web-{index}", greeting=f"Hello{index}", device=device_id))
            server.wait_for_deployments(deployments, device_id=device_id, timeout=60)
            yield server, config
