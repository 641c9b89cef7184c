"""A real fleet for the browser tests: `margo serve` with the example fleet and an operator
token, three devices reporting capabilities (a three-node GPU cluster and a one-node cluster
with their node tables, a Compose box) and statuses, and headless Chromium from Debian
driven by Playwright with a fresh profile. No browser is ever downloaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import ROOT, add_client, running_server

from tools.polling import poll_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
OPERATOR = "browser-operator-token"
VIEWPORT = {"width": 1366, "height": 768}


def caps(name: str, device_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ROOT / "examples" / "capabilities" / f"{name}.json")
                                     .read_text())
    doc["properties"]["id"] = device_id
    return doc


def _node(name: str, roles: list[str], cpu: float, memory: str, zone: str, *,
          gpus: int = 0, schedulable: bool = True) -> dict[str, Any]:
    return {"name": name, "roles": roles, "controlPlane": "control-plane" in roles,
            "ready": True, "schedulable": schedulable,
            "architecture": "amd64", "os": "linux",
            "allocatable": {"cpu": int(cpu) + 1, "memory": memory},
            "available": {"cpu": cpu, "memory": memory}, "zone": zone, "taints": [],
            "gpus": [{"resource": "nvidia.com/gpu", "count": gpus, "manufacturer": "NVIDIA",
                      "model": "L4"}] if gpus else []}


def with_cluster(doc: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The device client's cluster report under the root extension (the issue 6 contract)."""
    doc["x-margo-gitops-extensions"] = {"cluster": {
        "metadata": {"id": doc["properties"]["id"], "kubernetesVersion": "v1.31.2",
                     "platform": "k3s"},
        "resources": {"nodeCount": len(nodes), "nodes": nodes}}}
    return doc


@dataclass
class DashboardFleet:
    base: str
    device_http: httpx.Client

    def operator_get(self, path: str) -> Any:
        return httpx.get(self.base + path,
                         headers={"Authorization": f"Bearer {OPERATOR}"}).json()

    def deployment_id(self, device_id: str, intent: str) -> str:
        detail = self.operator_get(f"/api/fleet/devices/{device_id}")
        return str(next(d["deploymentId"] for d in detail["deployments"]
                        if d["intent"] == intent))

    def report(self, device_id: str, intent: str, state: str,
               error: dict[str, Any] | None = None) -> None:
        deployment_id = self.deployment_id(device_id, intent)
        component = {"name": intent, "state": state, **({"error": error} if error else {})}
        response = self.device_http.post(
            f"/api/v1/deployments/{deployment_id}/status",
            json={"deploymentId": deployment_id, "adoptedManifestVersion": 1,
                  "status": {"state": state, **({"error": error} if error else {})},
                  "components": [component]})
        assert response.status_code == 200, response.text


@pytest.fixture(scope="session")
def dashboard_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DashboardFleet]:
    tmp = tmp_path_factory.mktemp("dashboard-fleet")
    shutil.copytree(ROOT / "examples" / "fleet", tmp / "fleet")
    data = tmp / "data"
    token = add_client(data, "edge")
    (tmp / "admin").write_text(OPERATOR)
    devices = {
        "plant-a-cluster": with_cluster(caps("k8s-cluster-gpu", "plant-a-cluster"), [
            _node("cp-1", ["control-plane"], 3.2, "6Gi", "zone-a", schedulable=False),
            _node("worker-1", ["worker"], 7.5, "28Gi", "zone-a"),
            _node("worker-gpu", ["worker"], 15.1, "58Gi", "zone-b", gpus=1)]),
        "plant-a-edge": with_cluster(caps("k8s-single-amd64", "plant-a-edge"), [
            _node("edge-1", ["control-plane", "worker"], 6.5, "27Gi", "zone-c")]),
        "line-box": caps("compose-box-amd64", "line-box"),
    }
    with running_server(data, "--source", str(tmp / "fleet"), "--admin-token-file",
                        str(tmp / "admin")) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        for device_id, doc in devices.items():
            assert http.put(f"/api/v1/capabilities/{device_id}", json=doc).status_code == 201
        fleet = DashboardFleet(base, http)
        poll_until("the fleet compiled", lambda: any(
            d["intent"] == "vision-plant-a" for d in fleet.operator_get(
                "/api/fleet/devices/plant-a-cluster")["deployments"]), timeout=20)
        fleet.report("plant-a-cluster", "hello-everywhere", "installed")
        fleet.report("plant-a-cluster", "vision-plant-a", "installing")
        fleet.report("line-box", "hello-everywhere", "failed",
                     {"code": "E-PULL", "message": "image pull failed: registry unreachable"})
        yield fleet


def _chromium_or_fail() -> Any:
    """The Playwright driver and Debian's Chromium, or a failure that says how to get them
    (a skipped browser test would hide a dashboard nobody looked at)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make venv` installs Debian's chromium package "
                    "(or: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright Python package is missing: `make venv` installs it "
                    "(the test extra of pyproject.toml)")
    return sync_playwright


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


# Module scope: Playwright's sync API holds an event loop open in this thread; ending it with
# the module keeps later tests' asyncio.run() from finding a loop already running.
@pytest.fixture(scope="module")
def browser_context(dashboard_fleet: DashboardFleet,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Chromium with a fresh profile, signed in once through `?token=`."""
    sync_playwright = _chromium_or_fail()
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport=VIEWPORT, locale="en-US", timezone_id="UTC")
        try:
            page = context.new_page()
            page.goto(f"{dashboard_fleet.base}/?token={OPERATOR}")
            page.wait_for_url(f"{dashboard_fleet.base}/")
            page.close()
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser_context: Any) -> Iterator[Any]:
    tab = browser_context.new_page()
    tab.set_default_timeout(15_000)
    try:
        yield tab
    finally:
        tab.close()


# Module scope, as `browser_context`: one Playwright per module.
@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, for tests that need several people at once (each in a
    fresh context of their own: `signed_in_page`)."""
    sync_playwright = _chromium_or_fail()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def signed_in_page(chromium: Any) -> Iterator[Callable[[str, str], Any]]:
    """`open(base, token)`: a tab of a fresh browser context (its own cookies) signed in to
    the dashboard at `base` through `?token=`, on the overview."""
    contexts: list[Any] = []

    def open_as(base: str, token: str) -> Any:
        context = chromium.new_context(viewport=VIEWPORT, locale="en-US", timezone_id="UTC")
        contexts.append(context)
        tab = context.new_page()
        tab.set_default_timeout(15_000)
        tab.goto(f"{base}/?token={token}")
        tab.wait_for_url(f"{base}/")
        return tab

    try:
        yield open_as
    finally:
        for context in contexts:
            context.close()
