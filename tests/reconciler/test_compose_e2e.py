"""A Compose box end to end, for real: `margo serve`, then `margo device run` (its own
process) with the Compose driver on the session's Docker engine, a Compose package and
images from the real registry.

The operator deploys, moves to a new revision (a new image tag), reconfigures a parameter
(the container's environment), ships a revision whose start-up fails (its own log lines
arrive in the status), goes back, and deletes. Out of band, the container is killed, stopped
and removed; each time the next cycle repairs it and the status report says so. The device
client is SIGKILLed in the middle of `up`; after its restart it converges with one project,
as the engine's labels show.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    clear_engine,
    compose_package,
    environment,
    inspect,
    web_service,
)
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from kits.registrykit import running_registry

from reconciler.oci import OciClient

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "x-margo-gitops-extensions"
DEVICE = "compose-box"
APP = "com-example-web"

DESCRIPTION = """\
apiVersion: margo.org/v1-alpha1
kind: ApplicationDescription
id: com-example-web
metadata:
  name: Web
  version: 1.0.0
  catalog: {{organization: [{{name: Example Industries}}]}}
deploymentProfiles:
  - type: compose
    id: web-compose
    components:
      - name: web
        properties:
          repository: {repository}
          revision: {revision}
          wait: true
          timeout: 1m0s
parameters:
  greeting:
    value: Hello
    targets: [{{pointer: GREETING, components: [web]}}]
"""

INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {{name: web}}
spec:
  application: {{id: com-example-web}}
  profile: {{type: compose}}
  parameters:
    greeting: {greeting}
  targets: {{devices: [compose-box]}}
"""

#: A web service that takes 4 s to become healthy (the window in which `up --wait` runs).
SLOW = ['sh', '-c', 'echo warming up; sleep 4; trap "kill $c; exit 0" TERM; '
        'httpd -f -p 8080 -h /www & c=$!; wait $c']


@pytest.fixture
def engine(docker_engine: DockerEngine, test_images: ImageSet) -> Iterator[DockerEngine]:
    yield docker_engine
    clear_engine(docker_engine)


class Box:
    """The operator's and the device's view of one Compose box."""

    def __init__(self, server: FleetServer, engine: DockerEngine, fleet: Path,
                 config: Path) -> None:
        self.server, self.engine, self.fleet, self.config = server, engine, fleet, config
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.config.parent / "device.log", "ab")  # noqa: SIM115 (the child has it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
             str(self.config), "--log-level", "warning"], cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT)
        log.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)
            self.process.wait(timeout=60)
        self.process = None

    def release(self, revision: str) -> None:
        app = self.fleet / "apps" / APP / "margo.yaml"
        text = app.read_text()
        current = yaml.safe_load(text)["deploymentProfiles"][0]["components"][0][
            "properties"]["revision"]
        app.write_text(text.replace(f"revision: {current}", f"revision: {revision}"))

    def status(self) -> dict[str, Any] | None:
        response = self.server._http.get(f"/api/fleet/devices/{DEVICE}")
        if response.status_code != 200:
            return None
        found = [d for d in response.json()["deployments"] if d["intent"] == "web"]
        return found[0] if found else None

    def wait(self, what: str, predicate, timeout: float = 90) -> Any:
        def check() -> Any:
            if self.process is not None and self.process.poll() is not None:
                log = (self.config.parent / "device.log").read_text()[-3000:]
                raise AssertionError(f"the device client exited while waiting for {what}: "
                                     f"{log}")
            return predicate()
        return self.server.wait_for(check, timeout, what)

    def settled(self, state: str, digest: str | None = None) -> dict[str, Any]:
        """Until the deployment (at `digest`, when given) is reported in `state`."""
        return self.wait(f"the deployment {state}", lambda: (
            (found := self.status()) and found["state"] == state
            and (digest is None or found["digest"] == digest) and found))

    def running(self, image: str, service: str = "web") -> bool:
        """Whether `service` runs `image`, healthy (read from the engine)."""
        name = self.containers().get(service)
        if name is None:
            return False
        try:
            details = inspect(self.engine, name)
        except RuntimeError as exc:  # listed, then replaced before it could be inspected
            if "No such object" in str(exc):
                return False
            raise
        return details["Config"]["Image"] == image and (
            details["State"].get("Health") or {}).get("Status") == "healthy"

    def reports(self) -> list[dict[str, Any]]:
        """The status reports the server stored for the deployment, in arrival order."""
        found = self.status()
        if found is None:
            return []
        with sqlite3.connect(self.server.data_dir / "wfm.sqlite") as conn:
            rows = conn.execute("SELECT document FROM status_reports WHERE deployment_id = ? "
                                "ORDER BY id", (found["deploymentId"],)).fetchall()
        return [json.loads(row[0]) for row in rows]

    def containers(self) -> dict[str, str]:
        """Service → container, from the engine's labels (every project of ours)."""
        listed = self.engine.text(
            "ps", "-a", "--filter", "label=margo-gitops.dev/managed-by=margo-gitops",
            "--format", '{{.Label "com.docker.compose.project"}} '
                        '{{.Label "com.docker.compose.service"}} {{.Names}}')
        rows = [line.split(" ") for line in listed.splitlines()]
        assert len({r[0] for r in rows}) <= 1, f"more than one project: {rows}"
        return {service: name for _, service, name in rows}


def fleet_with_web(tmp_path: Path, registry: str, repository: str) -> Path:
    """A fleet source with the web application (at 1.0.0) and no intents."""
    fleet = write_fleet(tmp_path / "fleet", registry=registry, intents={})
    app = fleet / "apps" / APP / "margo.yaml"
    app.parent.mkdir(parents=True)
    app.write_text(DESCRIPTION.format(repository=repository, revision="1.0.0"))
    return fleet


def device_config(home: Path, server: FleetServer, engine: DockerEngine,
                  **extra: Any) -> Path:
    """The Compose box's directory: token, capabilities and device.yaml (plus `extra`)."""
    home.mkdir()
    (home / "token").write_text(server.token)
    (home / "capabilities.json").write_text(json.dumps(capabilities("compose-box-amd64",
                                                                    DEVICE)))
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": DEVICE},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "compose", "compose": engine.compose, "dockerHost": engine.host},
        "dataDir": "data", "capabilities": {"file": "capabilities.json"},
        "schedule": {"interval": "1s"}, **extra}))
    return home / "device.yaml"


@pytest.fixture
def box(engine: DockerEngine, test_images: ImageSet, registry: str,
        tmp_path: Path) -> Iterator[Box]:
    repository = f"oci://{registry}/compose-e2e/web"
    with OciClient() as oci:
        compose_package(oci, repository, "1.0.0", {"web": web_service(test_images.web_1)})
        compose_package(oci, repository, "1.1.0", {"web": web_service(test_images.web_2)})
        compose_package(oci, repository, "1.2.0", {
            "web": web_service(test_images.web_2),
            "migrate": {"image": test_images.crash, "depends_on": []}})
        compose_package(oci, repository, "1.3.0", {
            "web": web_service(test_images.web_2, command=SLOW)})
    fleet = fleet_with_web(tmp_path, registry, repository)
    with fleet_server(tmp_path, fleet=fleet) as server:
        the_box = Box(server, engine, fleet, device_config(tmp_path / DEVICE, server, engine))
        try:
            yield the_box
        finally:
            the_box.stop()


def test_deploy_update_reconfigure_fail_repair_and_delete(box: Box, test_images: ImageSet) -> None:
    box.server.edit_intent("web", INTENT.format(greeting="Servus"))
    box.start()
    first = box.settled("installed")
    web = box.containers()["web"]
    assert inspect(box.engine, web)["State"]["Health"]["Status"] == "healthy"
    assert environment(box.engine, web)["GREETING"] == "Servus"
    assert inspect(box.engine, web)["Config"]["Image"] == test_images.web_1

    # A new revision: a new image tag, the container replaced.
    box.release("1.1.0")
    second = box.wait("the new revision compiled", lambda: (
        (found := box.status()) and found["digest"] != first["digest"] and found))
    box.wait("the new image running", lambda: box.running(test_images.web_2))
    box.settled("installed", second["digest"])
    web = box.containers()["web"]
    assert box.engine.text("exec", web, "wget", "-q", "-O-", "http://127.0.0.1:8080/") == \
        "web 2.0\n"

    # Reconfigure: the parameter reaches the container's environment.
    _, served = box.server.manifest()
    box.server.set_parameter("web", "greeting", "Moin")
    version = box.server.wait_for_change(served)["manifestVersion"]
    box.wait("reconfigured", lambda: any(r["adoptedManifestVersion"] >= version and
                                         r["status"]["state"] == "installed"
                                         for r in box.reports()))
    assert environment(box.engine, box.containers()["web"])["GREETING"] == "Moin"

    # Out of band: killed, stopped, removed. Each time the next cycle repairs it, and the
    # report that says it is installed again says what was repaired.
    for command, drift in ((("kill",), "{} was stopped (exited with code 137)"),
                           (("stop", "-t", "5"), "{} was stopped (exited with code 0)"),
                           (("rm", "-f"), "every container of the project is gone")):
        victim, seen = box.containers()["web"], len(box.reports())
        box.engine.run(*command, victim)
        report = box.wait(f"repaired after {command[0]}", lambda seen=seen: next(
            (r for r in box.reports()[seen:] if "repaired" in r.get(EXTENSION, {})), None))
        assert report[EXTENSION]["repaired"] == {"web": drift.format(victim)}
        assert report["status"]["state"] == "installed"
        assert box.running(test_images.web_2)

    # A revision whose start-up fails: reported failed with the container's own words.
    box.release("1.2.0")
    failed = box.settled("failed")
    [component] = failed["components"]
    assert component["error"]["code"] == "UPGRADE_FAILED"
    assert "migrate-1 exited with code 3; its last log lines:" in component["error"]["message"]
    assert "fatal: DATABASE_URL is not set" in component["error"]["message"]
    # The dashboard shows that message once (the component's is the deployment's), Compose's
    # progress folded under its first and last lines.
    page = box.server._http.get(f"/devices/{DEVICE}").text
    assert page.count("its last log lines:") == 1, page
    # Back to the good revision.
    box.release("1.1.0")
    box.wait("the failing service gone", lambda: sorted(box.containers()) == ["web"]
             and box.running(test_images.web_2))
    box.settled("installed")

    # Deleted: everything of ours is gone from the engine.
    box.server.remove_intent("web")
    box.wait("removed", lambda: box.status() is None and box.containers() == {})


def test_a_client_killed_in_the_middle_of_up_converges_after_restart(box: Box) -> None:
    box.server.edit_intent("web", INTENT.format(greeting="Hello"))
    box.start()
    box.settled("installed")
    box.release("1.3.0")  # four seconds to become healthy
    box.wait("up in progress", lambda: "health: starting" in box.engine.text(
        "ps", "--format", "{{.Status}}"), timeout=60)
    box.stop(signal.SIGKILL)
    box.start()
    box.wait("converged", lambda: (found := box.status()) and found["state"] == "installed"
             and "warming up" in box.engine.text("logs", box.containers()["web"]), timeout=90)
    assert sorted(box.containers()) == ["web"]  # one project, one container per service
    projects = box.engine.text("ps", "-a", "--format",
                               '{{.Label "com.docker.compose.project"}}').split()
    assert len(set(projects)) == 1


def test_a_private_registry_through_the_device_configuration(
        engine: DockerEngine, test_images: ImageSet, tmp_path: Path) -> None:
    """Package and image from a registry that refuses anonymous pulls; the device names
    its credentials in `registries:`. The password appears nowhere the device or server
    writes: not in the log, the state, the status reports, the server's database or Git."""
    password = "pw-7f3a91c2-not-anywhere"
    with running_registry(tmp_path / "private", users={"deployer": password}) as private:
        image = f"{private}/margo-test/web:1.0"
        engine.run("pull", test_images.web_1)
        engine.run("tag", test_images.web_1, image)
        engine.run("login", "-u", "deployer", "--password-stdin", private,
                   input=password.encode())
        engine.run("push", image)
        engine.run("logout", private)
        engine.run("rmi", image, test_images.web_1)
        repository = f"oci://{private}/compose-e2e/web"
        with OciClient(credentials={private: ("deployer", password)}) as oci:
            compose_package(oci, repository, "1.0.0", {"web": web_service(image)})
        fleet = fleet_with_web(tmp_path, private, repository)
        with fleet_server(tmp_path, fleet=fleet) as server:
            home = tmp_path / DEVICE
            config = device_config(home, server, engine, registries={private: {
                "username": "deployer", "passwordFile": "registry-password"}})
            secret = home / "registry-password"
            secret.write_text(password + "\n")
            secret.chmod(0o600)
            box = Box(server, engine, fleet, config)
            box.server.edit_intent("web", INTENT.format(greeting="Private"))
            box.start()
            try:
                box.settled("installed")
                assert box.running(image)
            finally:
                box.stop()
            leaked = [path for root in (home, tmp_path / "data")
                      for path in root.rglob("*") if path.is_file() and path != secret
                      and password.encode() in path.read_bytes()]
            assert leaked == []
