"""What a Compose-only device loads: a real `margo device once` (its own process, the REST
source, the Compose driver on the session's Docker engine) installs a deployment from the
real registry, and afterwards its process holds none of what only other devices, or the
fleet side, need.

A structural fact, not a measurement: `bench/device_memory.py` measures the resident
memory this keeps down (docs/benchmarks.md); a module that comes back shows up here as its
name, whatever it costs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.dockerkit import DockerEngine, ImageSet, clear_engine, compose_package, web_service
from kits.fleetserver import fleet_server, write_fleet

from reconciler.oci import OciClient
from tools.devices import compose_device

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "light-box"

APP = """\
apiVersion: margo.org/v1-alpha1
kind: ApplicationDescription
id: com-example-light
metadata:
  name: Light
  version: 1.0.0
  catalog: {{organization: [{{name: Example Industries}}]}}
deploymentProfiles:
  - type: compose
    id: light-compose
    components:
      - name: web
        properties: {{repository: "{repository}", revision: 1.0.0, wait: true,
                     timeout: 1m0s}}
"""
INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {name: light}
spec:
  application: {id: com-example-light}
  profile: {type: compose}
  targets: {devices: [light-box]}
"""

#: Runs the real entry point, then says which modules the process ended up with.
PROBE = """\
import json, sys
from margo_cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"exit": code, "modules": sorted(sys.modules)}))
"""

#: Only other drivers, another source, another identity, telemetry export or the fleet
#: side need these (prefixes of module names).
NOT_LOADED = (
    "helm_python", "reconciler.helm_engine", "reconciler.charts", "reconciler.drivers.helm",
    "reconciler.drivers.render", "reconciler.kubernetes", "reconciler.telemetry.helmplugin",
    "pygit2", "reconciler.sources.git_source", "cryptography", "http_message_signatures",
    "reconciler.identity", "reconciler.signing", "opentelemetry", "compiler", "wfm",
    "authoring", "conformance", "jinja2", "starlette", "uvicorn", "argcomplete", "rich")


@pytest.fixture
def engine(docker_engine: DockerEngine, test_images: ImageSet) -> Iterator[DockerEngine]:
    yield docker_engine
    clear_engine(docker_engine, test_images.web_1)


def device_home(tmp_path: Path, registry: str, test_images: ImageSet) -> Path:
    """The fleet source: the application (its package pushed to the registry) and the
    intent deploying it on the box."""
    repository = f"oci://{registry}/device-imports/web"
    with OciClient() as oci:
        compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
    fleet = write_fleet(tmp_path / "fleet", registry=registry,
                        intents={"light": INTENT})
    (fleet / "apps" / "com-example-light").mkdir(parents=True)
    (fleet / "apps" / "com-example-light" / "margo.yaml").write_text(
        APP.format(repository=repository))
    return fleet


def test_a_compose_device_loads_no_helm_kubernetes_git_crypto_or_fleet_side(
        engine: DockerEngine, test_images: ImageSet, registry: str, tmp_path: Path) -> None:
    fleet = device_home(tmp_path, registry, test_images)
    with fleet_server(tmp_path, fleet=fleet) as server:
        config = compose_device(tmp_path / DEVICE, server, engine, DEVICE)
        server.wait_for_deployments(1, device_id=DEVICE, timeout=60)
        done = subprocess.run(
            [sys.executable, "-c", PROBE, "device", "once", "--json", "--config",
             str(config)], cwd=ROOT, capture_output=True, text=True,
            timeout=180, check=False)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    cycle, probe = json.loads(lines[0]), json.loads(lines[1])
    assert probe["exit"] == 0, (cycle, done.stderr)
    assert [step["action"] for step in cycle["steps"]] == ["install"]
    modules = probe["modules"]
    # What it ran is there (else the probe proves nothing) ...
    assert {"reconciler.drivers.compose", "reconciler.sources.rest_source",
            "margo_cli.device_command"} <= set(modules)
    # ... and nothing else.
    loaded = [m for m in modules if any(m == p or m.startswith(p + ".") for p in NOT_LOADED)]
    assert loaded == []
