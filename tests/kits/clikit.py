"""A small fleet on a real `margo serve` (loopback, operator token), for the tests of the
commands that ask a server: `margo get`, `margo describe`, shell completion
(`tests/cli/conftest.py` shares one per session).

Three devices (`edge-a` and `edge-b` run Compose, `gpu-1` Helm with a GPU), labelled by
site; intents `web` (every Compose device, staged in two waves), `gpu` (Helm devices of
plant-a) and `broken` (a file the compiler refuses). `edge-a` reports `web` failed with a
multi-line error carrying escape sequences, the others installed; then `web` changes, so
its rollout assigns the devices to waves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kits.fleetkit import Fleet, app, device, intent
from kits.serverkit import add_client, running_server
from tools.polling import poll_until

#: What edge-a reports for `web`: lines, an escape sequence, a tab.
MULTILINE_ERROR = ("image pull failed: manifest unknown\n  \x1b[31mpulling web\x1b[0m 3/5\n"
                   "\tcompose: exit status 1")
TOKEN = "operator-token"
DEVICES = {
    "edge-a": device("edge-a", types=("compose",), labels={"site": "plant-a", "tier": "edge"}),
    "edge-b": device("edge-b", types=("compose",), labels={"site": "plant-b", "tier": "edge"}),
    "gpu-1": device("gpu-1", gpu=True, labels={"site": "plant-a"}),
}
BROKEN = ("apiVersion: margo-gitops.dev/v1alpha1\nkind: DeploymentIntent\n"
          "metadata: {name: broken}\nspec: {application: {id: com-example-app}, bogus: 1}\n")


@dataclass(frozen=True)
class CliFleet:
    """The server's URL, the operator token's file, a client of the device API."""

    url: str
    token_file: Path
    devices: httpx.Client

    def server(self) -> list[str]:
        """The options that point a command at this server."""
        return ["--url", self.url, "--token-file", str(self.token_file)]

    def read(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()


def _fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent(
        "web", profile={"type": "compose"}, parameters={"greeting": "v1"},
        rollout={"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
                 "soak": "1h"})
    fleet.intents["web"]["metadata"]["labels"] = {"team": "shop"}
    fleet.intents["gpu"] = intent("gpu", profile={"type": "helm"}, targets={"selectors": [
        {"labelSelector": {"matchExpressions": [
            {"key": "site", "operator": "In", "values": ["plant-a"]}]}}]})
    fleet.raw_files["deployments/broken.yaml"] = BROKEN
    fleet.write()
    return fleet


def _report(http: httpx.Client, deployment: dict[str, Any], state: str,
            message: str | None = None) -> None:
    error = {"error": {"code": "E_PULL", "message": message}} if message else {}
    response = http.post(f"/api/v1/deployments/{deployment['deploymentId']}/status", json={
        "deploymentId": deployment["deploymentId"], "adoptedManifestVersion": 1,
        "status": {"state": state, **error},
        "components": [{"name": "web-compose", "state": state}]})
    assert response.status_code == 200, response.text


@contextmanager
def cli_fleet_server(root: Path) -> Iterator[CliFleet]:
    """The fleet under `root`, served, reported on, and its rollout under way."""
    fleet = _fleet(root / "fleet")
    data = root / "data"
    token = add_client(data, "edge")
    token_file = root / "operator-token"
    token_file.write_text(TOKEN + "\n")
    with running_server(data, "--source", str(fleet.source), "--watch-source",
                        "--admin-token-file", str(token_file)) as url, \
            httpx.Client(base_url=url, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        for device_id, doc in DEVICES.items():
            assert http.put(f"/api/v1/capabilities/{device_id}", json=doc).status_code == 201
        cli = CliFleet(url, token_file, http)
        listed = poll_until("three deployments", lambda: len(
            cli.read("/api/fleet/deployment-list")["deployments"]) == 3 or None, timeout=30)
        assert listed
        for deployment in cli.read("/api/fleet/deployment-list")["deployments"]:
            failed = deployment["deviceId"] == "edge-a"
            _report(http, deployment, "failed" if failed else "installed",
                    MULTILINE_ERROR if failed else None)
        fleet.intents["web"]["spec"]["parameters"]["greeting"] = "v2"
        fleet.write()
        poll_until("web's rollout to place its devices in waves", lambda: any(
            w["devices"] for w in cli.read("/api/fleet/rollouts/web").get("waves", [])),
            timeout=30)
        yield cli
