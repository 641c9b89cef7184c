"""Which bytes a status report is about, for every kind of device (wfm.fleet.attribution): a real
`margo serve` watching its fleet source; reports sent as each generation's devices send
them, with and without saying what they adopted; devices that follow their Git branch
fetch it with stock `git`.

Issue 28, item 1: rc.2 and Oct-2024 bodies carry no `adoptedManifestVersion`, so their
reports never counted as installed on the current bytes (the device stayed `pending` for
ever and a rollout rolled a good revision back).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.fleetkit import Fleet, app, device, intent
from kits.serverkit import add_client, running_server

from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
RC2 = "/api/v1/clients/plant"


@dataclass
class Server:
    base: str
    token: str
    fleet: Fleet
    http: httpx.Client
    workdir: Path

    def device(self, device_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/fleet/devices/{device_id}")
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc

    def freshness(self, device_id: str) -> str:
        return str(self.device(device_id)["freshness"]["state"])

    def deployment(self, device_id: str) -> dict[str, Any]:
        [deployment] = self.device(device_id)["deployments"]
        return deployment

    def manifest(self, prefix: str = RC2) -> dict[str, Any]:
        response = self.http.get(f"{prefix}/deployments", headers={"Accept": MANIFEST})
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc

    def set_greeting(self, device_id: str, greeting: str) -> None:
        """Edit the device's intent; wait until its branch holds the new bytes."""
        before = self.deployment(device_id)["digest"]
        self.fleet.intents[device_id]["spec"]["parameters"] = {"greeting": greeting}
        self.fleet.write()
        poll_until("the recompiled deployment", lambda: self.deployment(device_id)["digest"]
                   != before, timeout=30, interval=0.1)

    def git_fetch(self, device_id: str) -> str:
        """Clone (or fetch) the device's repository as a stock Git client does; the commit
        it now holds."""
        checkout = self.workdir / f"clone-{device_id}"
        url = self.base.replace("http://", f"http://plant:{self.token}@")
        if checkout.exists():
            _git("-C", str(checkout), "pull", "-q", "--ff-only")
        else:
            _git("clone", "-q", f"{url}/git/devices/{device_id}.git", str(checkout))
        return _git("-C", str(checkout), "rev-parse", "HEAD").strip()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    for device_id in ("rest-box", "git-box", "other-box"):
        fleet.intents[device_id] = intent(device_id, profile={"type": "compose"},
                                          targets={"devices": [device_id]})
    fleet.write()
    data = tmp_path / "data"
    token = add_client(data, "plant")
    with running_server(data, "--source", str(fleet.source), "--watch-source") as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        served = Server(base, token, fleet, http, tmp_path)
        for device_id in ("rest-box", "git-box", "other-box"):
            doc = device(device_id, types=("compose",))
            assert http.put(f"/api/v1/capabilities/{device_id}", json=doc).status_code == 201
            poll_until(f"{device_id}'s deployment", lambda d=device_id: served.device(d)[
                "deployments"], timeout=30, interval=0.1)
        yield served


def rc2_report(deployment_id: str, state: str, **extension: Any) -> dict[str, Any]:
    """An rc.2 DeploymentStatusManifest as another vendor's device sends it (no
    adoptedManifestVersion: the rc.2 body has none), with our extension if given."""
    body: dict[str, Any] = {
        "apiVersion": "deployment.margo.org/v1alpha1", "kind": "DeploymentStatusManifest",
        "deploymentId": deployment_id, "status": {"state": state},
        "components": [{"name": "web-compose", "state": state}]}
    if extension:
        body["x-margo-gitops-extensions"] = extension
    return body


def oct2024_report(deployment_id: str, state: str, **extension: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deploymentId": deployment_id, "status": {"state": state},
                            "components": [{"name": "web-compose", "state": state}]}
    if extension:
        body["x-margo-gitops-extensions"] = extension
    return body


def post_rc2(server: Server, deployment_id: str, body: dict[str, Any]) -> None:
    response = server.http.post(f"{RC2}/deployments/{deployment_id}/status", json=body)
    assert response.status_code == 200, response.text


def post_oct2024(server: Server, device_id: str, deployment_id: str,
                 body: dict[str, Any]) -> None:
    response = server.http.post(f"/device/{device_id}/deployment/{deployment_id}/status",
                                json=body)
    assert response.status_code == 201, response.text


def test_an_rc2_report_naming_nothing_counts_for_the_manifest_the_client_was_handed(
        server: Server) -> None:
    server.manifest()  # the device polls: version 1 is handed out
    deployment = server.deployment("rest-box")
    post_rc2(server, deployment["deploymentId"], rc2_report(deployment["deploymentId"],
                                                            "installed"))
    assert server.freshness("rest-box") == "current"
    applied = server.deployment("rest-box")["applied"]
    assert applied["current"] and applied["via"].startswith("handed out: manifestVersion")

    server.set_greeting("rest-box", "bonjour")
    # Reported before the device polled the new state: about the bytes it was handed.
    post_rc2(server, deployment["deploymentId"], rc2_report(deployment["deploymentId"],
                                                            "installing"))
    assert server.freshness("rest-box") == "pending"
    server.manifest()  # now it has the new state
    post_rc2(server, deployment["deploymentId"], rc2_report(deployment["deploymentId"],
                                                            "installed"))
    assert server.freshness("rest-box") == "current"


def test_a_report_naming_its_manifest_version_is_about_what_that_version_held(
        server: Server) -> None:
    old = server.manifest()["manifestVersion"]
    deployment_id = server.deployment("rest-box")["deploymentId"]
    server.set_greeting("rest-box", "hallo")
    # The branch moves before the compile publishes the client's next manifest version: a
    # poll in between is served the previous one (a device would get it on its next poll).
    new = poll_until("the next manifest version", lambda: (
        version := server.manifest()["manifestVersion"]) > old and version, timeout=30)
    post_rc2(server, deployment_id, rc2_report(deployment_id, "installed",
                                               adoptedManifestVersion=old))
    assert server.freshness("rest-box") == "pending"
    assert server.deployment("rest-box")["applied"]["via"] == f"manifestVersion {old}"
    post_rc2(server, deployment_id, rc2_report(deployment_id, "installed",
                                               adoptedManifestVersion=new))
    assert server.freshness("rest-box") == "current"


def test_an_oct2024_report_counts_for_the_commit_its_git_fetch_delivered(
        server: Server) -> None:
    commit = server.git_fetch("git-box")
    deployment_id = server.deployment("git-box")["deploymentId"]
    body = oct2024_report(deployment_id, "Installed")
    post_oct2024(server, "git-box", deployment_id, body)
    assert server.freshness("git-box") == "current"
    assert server.deployment("git-box")["applied"]["via"] == f"handed out: commit {commit[:12]}"

    server.set_greeting("git-box", "hej")
    post_oct2024(server, "git-box", deployment_id, oct2024_report(deployment_id, "Installing"))
    assert server.freshness("git-box") == "pending"  # the new commit was not fetched yet
    newer = server.git_fetch("git-box")
    assert newer != commit
    post_oct2024(server, "git-box", deployment_id, oct2024_report(deployment_id, "Installed"))
    assert server.freshness("git-box") == "current"


def test_a_claimed_commit_must_be_on_the_devices_own_branch(server: Server) -> None:
    """A device saying it applied a commit is believed only for a commit of its own
    branch: another device's commit (or an invented one) leaves the bytes unknown."""
    own = server.git_fetch("git-box")
    foreign = server.git_fetch("other-box")
    deployment_id = server.deployment("git-box")["deploymentId"]
    post_oct2024(server, "git-box", deployment_id,
                 oct2024_report(deployment_id, "Installed", adoptedCommit=foreign))
    applied = server.deployment("git-box")["applied"]
    assert (applied["digest"], applied["current"]) == (None, False)
    assert "not on the device's branch" in applied["via"]
    assert server.freshness("git-box") == "pending"
    post_oct2024(server, "git-box", deployment_id,
                 oct2024_report(deployment_id, "Installed", adoptedCommit=own))
    assert server.freshness("git-box") == "current"
    assert server.deployment("git-box")["applied"]["via"] == f"commit {own[:12]}"
