"""A device id belongs to one client: once its client deletes it, whoever registers it next
starts from an empty history (Git branch, statuses), and no answer tells a client which ids
other clients use."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import ROOT, add_client, running_server

from tools.polling import poll_until

CAPS = ROOT / "examples" / "capabilities"
SECRET = "site-of-alice-7f3a"


def box(device_id: str, site: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / "compose-box-amd64.json").read_text())
    doc["properties"]["id"] = device_id
    doc["labels"]["example.com/site"] = site
    return doc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("reuse")
    shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
    data = root / "data"
    tokens = {name: add_client(data, name) for name in ("alice", "bob")}
    with running_server(data, "--source", str(root / "fleet")) as base:
        yield {"base": base, "tokens": tokens, "data": data}


def http(fleet: dict[str, Any], name: str) -> httpx.Client:
    return httpx.Client(base_url=fleet["base"], timeout=10,
                        headers={"Authorization": f"Bearer {fleet['tokens'][name]}"})


def manifest_with(client: httpx.Client, text: str) -> dict[str, Any]:
    """The client's manifest once one of its deployments holds `text`."""
    found: list[dict[str, Any]] = [{}]

    def ready() -> bool:
        response = client.get("/api/v1/deployments")
        if response.status_code != 200:
            return False
        found[0] = response.json()
        return any(text.encode() in client.get(d["url"]).content
                   for d in found[0]["deployments"])

    poll_until(f"a deployment with {text!r}", ready, timeout=30, interval=0.2)
    return found[0]


def git(*args: str, cwd: Path | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": "/nonexistent"}
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def report(client: httpx.Client, deployment_id: str, version: int, **extra: Any
           ) -> httpx.Response:
    body = {"deploymentId": deployment_id, "adoptedManifestVersion": version,
            "status": {"state": "installed"},
            "components": [{"name": "any", "state": "installed"}], **extra}
    return client.post(f"/api/v1/deployments/{deployment_id}/status", json=body)


def test_a_reused_id_starts_from_an_empty_history(fleet: dict[str, Any],
                                                  tmp_path: Path) -> None:
    with http(fleet, "alice") as alice, http(fleet, "bob") as bob:
        assert alice.put("/api/v1/capabilities/reused-box",
                         json=box("reused-box", SECRET)).status_code == 201
        manifest = manifest_with(alice, SECRET)
        deployment = manifest["deployments"][0]["deploymentId"]
        assert report(alice, deployment, manifest["manifestVersion"]).status_code == 200
        old = git("ls-remote", fleet["base"].replace(
            "http://", f"http://alice:{fleet['tokens']['alice']}@")
            + "/git/devices/reused-box.git").split()[0]
        assert alice.delete("/api/v1/capabilities/reused-box").status_code == 204

        assert bob.put("/api/v1/capabilities/reused-box",
                       json=box("reused-box", "bobs-site")).status_code == 201
        manifest_with(bob, "bobs-site")
        url = fleet["base"].replace("http://", f"http://bob:{fleet['tokens']['bob']}@")
        git("clone", "-q", f"{url}/git/devices/reused-box.git", str(tmp_path / "clone"))
        log = git("log", "-p", "--all", cwd=tmp_path / "clone")
        assert SECRET not in log
        assert old not in git("rev-list", "--all", cwd=tmp_path / "clone")
        roots = git("rev-list", "--max-parents=0", "HEAD", cwd=tmp_path / "clone").split()
        assert len(roots) == 1 and roots[0] != old
        # Alice's commit, now unreachable, cannot be fetched by Bob (protocol v2 wants).
        fetch = subprocess.run(["git", "-c", "protocol.version=2", "fetch", "-q", "origin",
                                old], cwd=tmp_path / "clone", capture_output=True, text=True,
                               env={"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0",
                                    "HOME": "/nonexistent"}, check=False, timeout=60)
        assert fetch.returncode != 0

        # Alice's statuses of that device are gone (current and history): the rows can
        # neither be shown to Bob nor stay attributed to Alice. Bob's own report is his.
        manifest = manifest_with(bob, "bobs-site")
        assert [d["deploymentId"] for d in manifest["deployments"]] == [deployment]
        assert rows(fleet, "SELECT client_id FROM statuses WHERE deployment_id = ?",
                    deployment) == []
        assert rows(fleet, "SELECT client_id FROM status_reports WHERE deployment_id = ?",
                    deployment) == []
        assert report(bob, deployment, manifest["manifestVersion"]).status_code == 200
        assert rows(fleet, "SELECT client_id, device_id FROM statuses WHERE "
                    "deployment_id = ?", deployment) == [("bob", "reused-box")]


def rows(fleet: dict[str, Any], sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(fleet["data"] / "wfm.sqlite")) as db:
        return [tuple(r) for r in db.execute(sql, args).fetchall()]

def test_status_for_another_clients_device_is_like_an_unknown_one(
        fleet: dict[str, Any]) -> None:
    with http(fleet, "alice") as alice, http(fleet, "bob") as bob:
        assert bob.put("/api/v1/capabilities/bobs-box",
                       json=box("bobs-box", "b")).status_code in (200, 201)
        assert alice.put("/api/v1/capabilities/alices-box",
                         json=box("alices-box", "a")).status_code in (200, 201)
        manifest = manifest_with(alice, "Hello from a")
        ours = next(d["deploymentId"] for d in manifest["deployments"]
                    if b"alices-box" in alice.get(d["url"]).content)
        version = manifest["manifestVersion"]
        foreign = report(alice, ours, version, deviceId="bobs-box")
        unknown = report(alice, ours, version, deviceId="nobodys-box")
        assert foreign.status_code == unknown.status_code == 422
        assert (foreign.json()["detail"].replace("bobs-box", "X")
                == unknown.json()["detail"].replace("nobodys-box", "X"))
        assert report(alice, ours, version, deviceId="alices-box").status_code == 200

        # A child under another client's gateway is answered like one under no gateway.
        child = box("bobs-box/child", "a")
        orphan = box("nobodys-box/child", "a")
        under_foreign = alice.put("/api/v1/capabilities/bobs-box/child", json=child)
        under_unknown = alice.put("/api/v1/capabilities/nobodys-box/child", json=orphan)
        assert under_foreign.status_code == under_unknown.status_code == 404
        assert (under_foreign.json()["detail"].replace("bobs-box", "X")
                == under_unknown.json()["detail"].replace("nobodys-box", "X"))
        # Deleting another client's device is answered like deleting an unknown one.
        gone = alice.delete("/api/v1/capabilities/bobs-box")
        never = alice.delete("/api/v1/capabilities/nobodys-box")
        assert gone.status_code == never.status_code == 404
        assert (gone.json()["detail"].replace("bobs-box", "X")
                == never.json()["detail"].replace("nobodys-box", "X"))
        assert bob.get("/api/v1/deployments").status_code == 200
