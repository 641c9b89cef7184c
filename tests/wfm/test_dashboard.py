"""The fleet dashboard over real HTTP: a running `margo serve` with the example fleet, devices
reporting capabilities (one a three-node cluster with its node table) and statuses, hostile
text in every place a device can put text, and the operator token enforced."""

from __future__ import annotations

import html
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from kits.serverkit import ROOT, add_client, running_server
from markupsafe import escape

from tools.polling import poll_until
from wfm.fleet.rollouts import actions_for
from wfm.fleet.sourcecondition import SourceCondition
from wfm.http.dashboard import (
    COOKIE_NAME,
    STATES,
    AppInfo,
    Catalogue,
    _ago,
    _by_severity,
    _commit_view,
    cpu_summary,
    device_kind,
    device_view,
    failing_clauses,
    gpu_count,
    node_count,
    render_page,
)
from wfm.http.sessions import SESSION_SECONDS, Session, SessionKeys
from wfm.identity.operators import Operator, Role
from wfm.store.records import DeviceRow

CAPS = ROOT / "examples" / "capabilities"
OPERATOR = "operator-token"
HOSTILE = '<script>alert("x")</script>'
HOSTILE_ID = "<script>alert(1)</script>"


def caps(name: str, device_id: str, **labels: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / f"{name}.json").read_text())
    doc["properties"]["id"] = device_id
    doc["labels"] = {**doc.get("labels", {}), **labels}
    return doc


def node(name: str, roles: list[str], cpu: tuple[float, float], memory: tuple[str, str],
         zone: str, *, ready: bool = True, schedulable: bool = True,
         gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One node as the device client reports it (the cluster extension's `nodes`)."""
    return {"name": name, "roles": roles, "controlPlane": "control-plane" in roles,
            "ready": ready, "schedulable": schedulable, "architecture": "amd64", "os": "linux",
            "allocatable": {"cpu": cpu[1], "memory": memory[1]},
            "available": {"cpu": cpu[0], "memory": memory[0]},
            "gpus": gpus or [], "zone": zone, "taints": [], "labels": {}}


def cluster_document(device_id: str) -> dict[str, Any]:
    """A three-node k3s cluster with one NVIDIA GPU worker, as the device client reports it."""
    doc = caps("k8s-cluster-gpu", device_id)
    doc["x-margo-gitops-extensions"] = {"cluster": {
        "metadata": {"id": device_id, "kubernetesVersion": "v1.31.2", "platform": "k3s"},
        "resources": {"nodeCount": 3, "nodes": [
            node("cp-1", ["control-plane"], (3.25, 4), ("5Gi", "8Gi"), "zone-a",
                 schedulable=False),
            node("worker-1", ["worker"], (7.5, 8), ("28Gi", "31Gi"), "zone-a", ready=False),
            node("worker-gpu", ["worker"], (15.1, 16), ("50Gi", "62Gi"), "zone-b",
                 gpus=[{"resource": "nvidia.com/gpu", "count": 1, "manufacturer": "NVIDIA",
                        "model": "L4"}]),
        ]}}}
    return doc


@dataclass
class Fleet:
    base: str
    device_http: httpx.Client
    data: Path

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {OPERATOR}", **kwargs.pop("headers", {})}
        return httpx.get(self.base + path, headers=headers, **kwargs)

    def deployment_id(self, device_id: str, intent: str) -> str:
        detail = self.get(f"/api/fleet/devices/{device_id}").json()
        return str(next(d["deploymentId"] for d in detail["deployments"]
                        if d["intent"] == intent))

    def report(self, deployment_id: str, state: str, components: list[dict[str, Any]],
               error: dict[str, Any] | None = None) -> None:
        status: dict[str, Any] = {"state": state, **({"error": error} if error else {})}
        response = self.device_http.post(
            f"/api/v1/deployments/{deployment_id}/status",
            json={"deploymentId": deployment_id, "adoptedManifestVersion": 1,
                  "status": status, "components": components})
        assert response.status_code == 200, response.text


def wait_for(predicate: Any, what: str) -> None:
    poll_until(what, predicate, timeout=20)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("dashboard")
    shutil.copytree(ROOT / "examples" / "fleet", tmp / "fleet")
    data = tmp / "data"
    token = add_client(data, "edge")
    (tmp / "admin").write_text(OPERATOR + "\n")
    with running_server(data, "--source", str(tmp / "fleet"), "--admin-token-file",
                        str(tmp / "admin")) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        hostile_box = caps("compose-box-amd64", "hostile-box", **{"example.com/note": HOSTILE})
        hostile_box["properties"]["vendor"] = HOSTILE
        for device_id, doc, path in (
                ("plant-a-cluster", cluster_document("plant-a-cluster"), "/api/v1"),
                ("plant-a-edge", caps("k8s-single-amd64", "plant-a-edge"), "/api/v1"),
                ("hostile-box", hostile_box, "/api/v1/clients/edge")):  # an rc.2 device
            response = http.put(f"{path}/capabilities/{device_id}", json=doc)
            assert response.status_code in (200, 201), response.text
        fleet = Fleet(base, http, data)

        def compiled() -> bool:
            intents = {d: {x["intent"] for x in fleet.get(f"/api/fleet/devices/{d}")
                           .json()["deployments"]} for d in ("plant-a-cluster", "hostile-box")}
            return ("vision-plant-a" in intents["plant-a-cluster"]
                    and "hello-everywhere" in intents["hostile-box"])

        wait_for(compiled, "the first compile")
        fleet.report(fleet.deployment_id("plant-a-cluster", "hello-everywhere"), "installed",
                     [{"name": "hello-world", "state": "installed"}])
        fleet.report(fleet.deployment_id("hostile-box", "hello-everywhere"), "failed",
                     [{"name": "hello-world", "state": "failed",
                       "error": {"code": "E-PULL", "message": HOSTILE}}],
                     error={"code": "E-PULL", "source": "compose", "message": HOSTILE})
        yield fleet


def row(page: str, attribute: str, value: str) -> str:
    """The table row or article carrying data-<attribute>="value" (escaped as the page does)."""
    match = re.search(rf'<(tr|article)[^>]*data-{attribute}="{re.escape(html.escape(value))}"'
                      r'[^>]*>(.*?)</\1>', page, re.S)
    assert match, f"no {attribute}={value!r} in the page"
    return match.group(2)


def text(fragment: str) -> str:
    """Visible text of an HTML fragment, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


# --- pages ---------------------------------------------------------------------------------

def test_overview_lists_devices_kinds_nodes_gpus_and_counts(fleet: Fleet) -> None:
    response = fleet.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert '<html lang="en">' in page and "<h1>Fleet overview</h1>" in page
    cluster = text(row(page, "device", "plant-a-cluster"))
    assert "Kubernetes cluster (k3s v1.31.2)" in cluster
    assert re.search(r"cluster \(k3s v1\.31\.2\) 3 1 ", cluster), cluster  # nodes, GPUs
    assert "1 installed" in cluster and "ago" in cluster
    box = text(row(page, "device", "hostile-box"))
    assert "Compose box" in box and "1 failed" in box
    edge = text(row(page, "device", "plant-a-edge"))
    assert "Kubernetes cluster 1 0 " in edge  # nodes from the label, no GPU
    counts = fleet.get("/api/fleet/deployments").json()
    totals = text(re.search(r'data-testid="total-states">(.*?)</span></p>', page, re.S)[1])
    assert f"{counts['total']} deployments" in text(page)
    for state, count in counts["byState"].items():
        assert f"{count} {state}" in totals
    gpu = text(row(page, "application", "com-example-gpu-inference"))
    assert "Vision Inference" in gpu and "plant-a-cluster pending" in gpu
    assert "plant-a-edge" not in gpu


def test_device_page_shows_nodes_deployments_eligibility_and_history(fleet: Fleet) -> None:
    page = fleet.get("/devices/plant-a-cluster").text
    assert "<h1>Device" in page and '>Available CPU</th>' in page
    assert "32 cores: 16 amd64, 8 amd64, 8 amd64" in text(page)
    cp = text(row(page, "node", "cp-1"))
    assert cp.startswith("cp-1 control-plane Ready no amd64 3.25 of 4 5Gi of 8Gi")
    assert text(row(page, "node", "worker-1")).startswith("worker-1 worker Not ready yes")
    gpu_node = text(row(page, "node", "worker-gpu"))
    assert "1 x NVIDIA L4" in gpu_node and gpu_node.endswith("zone-b")
    hello = text(row(page, "deployment",
                     fleet.deployment_id("plant-a-cluster", "hello-everywhere")))
    assert "installed" in hello and "hello-world: installed" in hello
    assert "vision-plant-a: eligible" in text(row(page, "intent", "vision-plant-a"))
    history = text(page.split('id="history-heading"')[1])
    assert "plant-a-cluster: add" in history and "Fleet-Source:" not in history

    edge = fleet.get("/devices/plant-a-edge").text
    vision = text(row(edge, "intent", "vision-plant-a"))
    assert "vision-plant-a: not eligible" in vision
    assert "profile gpu-inference-helm" in vision and "NVIDIA" in vision
    assert "Required Actual" in vision  # the clause table's headers

    box = fleet.get("/devices/hostile-box").text
    assert "client edge · speaks rc.2 ·" in text(box)  # the API its client called
    assert "client edge · speaks rc.3 ·" in text(page)
    failed = text(row(box, "deployment", fleet.deployment_id("hostile-box", "hello-everywhere")))
    assert "failed" in failed and "E-PULL" in failed and HOSTILE in failed
    line = text(row(box, "intent", "line-monitor"))
    assert "not targeted" in line and "k8s.margo-gitops.dev/nodes" in line


def test_application_page_says_where_it_runs_and_where_it_cannot(fleet: Fleet) -> None:
    page = fleet.get("/applications/com-example-gpu-inference").text
    runs = text(page.split('id="runs-heading"')[1].split("</section>")[0])
    assert "plant-a-cluster vision-plant-a" in runs and "pending" in runs
    edge = text(row(page, "device", "plant-a-edge"))
    assert "intent vision-plant-a: not eligible" in edge and "NVIDIA" in edge
    box = text(row(page, "device", "hostile-box"))
    assert "not targeted" in box and "example.com/site" in box and "plant-b" in box
    assert "plant-a-cluster" not in text(page.split('id="blocked-heading"')[1])


def test_unknown_device_and_application_are_404_pages(fleet: Fleet) -> None:
    for path, what in (("/devices/nope", "device 'nope'"),
                       ("/applications/com-example-nope", "application 'com-example-nope'")):
        response = fleet.get(path)
        assert response.status_code == 404
        assert response.headers["content-type"].startswith("text/html")
        assert f"There is no {what} in this fleet." in text(response.text)
    hostile = fleet.get("/devices/" + quote("<img src=x onerror=alert(1)>"))
    assert hostile.status_code == 404
    assert "<img src=x" not in hostile.text and "&lt;img src=x" in hostile.text


def test_device_supplied_text_is_escaped_everywhere(fleet: Fleet) -> None:
    pages = {path: fleet.get(path).text for path in (
        "/", "/devices/hostile-box", "/applications/com-example-hello-world")}
    for path, page in pages.items():
        assert "<script>alert" not in page, path
        assert page.count("<script") == 1, path  # only the page's own refresh script
    escaped = str(escape(HOSTILE))
    device = pages["/devices/hostile-box"]
    assert f"{escaped} / M-1" in device  # the vendor, shown as text
    # the label and the deployment's error too (its component's, the same, is shown once)
    assert device.count(escaped) >= 3
    assert escaped in pages["/applications/com-example-hello-world"]  # the error


def test_hostile_ids_render_as_text_in_every_template() -> None:
    """Device ids are restricted to RFC 3986 unreserved characters by the API (the last test
    checks that), so ids with markup can only reach the templates through a bug elsewhere:
    render each page with such ids to prove autoescaping holds for ids too."""
    doc = caps("compose-box-amd64", HOSTILE_ID, **{"a/b": HOSTILE})
    doc["x-margo-gitops-extensions"] = cluster_document("x")["x-margo-gitops-extensions"]
    doc["x-margo-gitops-extensions"]["cluster"]["resources"]["nodes"][0]["name"] = HOSTILE
    device = device_view(DeviceRow(HOSTILE_ID, HOSTILE, doc, "d", "rc.3", 0.0),
                         {"states": {HOSTILE: 1, "failed": 1}, "deployments": 2})
    deployment = {"device": HOSTILE_ID, "deploymentId": HOSTILE, "intent": HOSTILE,
                  "applicationId": HOSTILE, "state": HOSTILE, "reportedAt": 1.0,
                  "components": [{"name": HOSTILE, "state": HOSTILE,
                                  "error": {"code": HOSTILE, "message": HOSTILE}}],
                  "error": {"code": HOSTILE, "message": HOSTILE}}
    explanation = {"intent": HOSTILE, "status": "not eligible", "application": HOSTILE,
                   "profile": None, "targeting": [{"message": HOSTILE, "required": HOSTILE,
                                                   "actual": [HOSTILE]}],
                   "attempts": [], "problems": [], "note": HOSTILE}
    info = AppInfo(HOSTILE, HOSTILE, (HOSTILE,), HOSTILE, (HOSTILE,))
    pages = [
        render_page("overview.html", nonce="n", path="/", title=HOSTILE, devices=[device],
                    counts={"total": 2, "byState": {HOSTILE: 1},
                            "byApplication": {HOSTILE: {HOSTILE: 1}}},
                    catalogue=Catalogue({HOSTILE: info}, error=HOSTILE),
                    applications=[(HOSTILE, info, [deployment])],
                    source=SourceCondition("invalid", HOSTILE, HOSTILE, [HOSTILE], 2, 0.0),
                    source_kind=HOSTILE,
                    rollouts=[{"intent": HOSTILE, "status": HOSTILE, "reason": HOSTILE,
                               "openWave": 0, "plot": "0,0 1,1", "actions": ["pause", "abort"],
                               "waves": [{"name": HOSTILE, "devices": 1, "moved": 1,
                                          "installed": 1, "failed": 0, "stale": 0,
                                          "pending": 0, "held": 0}]}],
                    # an OIDC subject is the issuer's text: the header shows it escaped
                    session=Session(Operator(HOSTILE, Role.OPERATOR, "oidc"), "b", True,
                                    HOSTILE)),
        render_page("device.html", nonce="n", path="/", title=HOSTILE, device=device,
                    deployments=[deployment], eligibility_error=None,
                    explanations=[(explanation, failing_clauses(explanation))],
                    history=[_commit_view({"commit": HOSTILE, "time": 0,
                                           "message": f"{HOSTILE}\n\n{HOSTILE}"})]),
        render_page("application.html", nonce="n", path="/", title=HOSTILE, app_id=HOSTILE,
                    info=info, runs=[deployment], states={HOSTILE: 1},
                    blocked=[(HOSTILE_ID, explanation, failing_clauses(explanation))],
                    unexplained=[(HOSTILE_ID, HOSTILE)], source_error=HOSTILE),
        render_page("message.html", nonce="n", path=HOSTILE, title=HOSTILE, message=HOSTILE,
                    continue_to=HOSTILE, login_hint=True),
    ]
    for page in pages:
        assert "<script>alert" not in page and page.count("<script") == 1
        assert "&lt;script&gt;alert" in page
    # the forms of the hostile rollout: its name quoted in their address, escaped in the text
    assert 'action="/rollouts/%3Cscript%3Ealert%28%22x%22%29%3C/script%3E/pause"' in pages[0]
    assert 'data-operator="&lt;script&gt;' in pages[0]
    assert html.escape(HOSTILE_ID, quote=False) in pages[0]
    assert "/devices/%3Cscript%3Ealert%281%29%3C/script%3E" in pages[0]  # links quoted too
    assert "state-unknown" in pages[0] and all(s in STATES for s in ("failed", "pending"))


def test_pages_carry_a_csp_whose_nonce_is_the_refresh_scripts(fleet: Fleet) -> None:
    response = fleet.get("/devices/plant-a-cluster")
    nonce = re.search(r"'nonce-([^']+)'", response.headers["content-security-policy"])
    assert nonce and f'<script nonce="{nonce[1]}">' in response.text
    assert response.headers["cache-control"] == "no-store"
    assert fleet.get("/").headers["content-security-policy"] != response.headers[
        "content-security-policy"]  # a fresh nonce per response
    css = fleet.get("/dashboard/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


# --- the operator token --------------------------------------------------------------------

def test_without_the_operator_token_nothing_is_shown(fleet: Fleet) -> None:
    for path in ("/", "/devices/plant-a-cluster", "/applications/com-example-hello-world"):
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        # the right token, sealed by another server's key
                        {"Cookie": f"{COOKIE_NAME}={SessionKeys(b'k' * 32).seal(OPERATOR)}"},
                        {"Cookie": f"{COOKIE_NAME}={OPERATOR}"}):
            response = httpx.get(fleet.base + path, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.headers["www-authenticate"].startswith("Bearer")
            for secret in ("plant-a-edge", "hostile-box", "Kubernetes", "hello-everywhere"):
                assert secret not in response.text, (path, secret)
            assert "?token=" in text(response.text)
    wrong = httpx.get(fleet.base + "/?token=wrong")
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers


def test_token_query_sets_an_httponly_strict_cookie_that_opens_the_pages(fleet: Fleet) -> None:
    response = httpx.get(fleet.base + f"/devices/plant-a-cluster?token={OPERATOR}&x=1")
    assert response.status_code == 200
    cookie = response.headers["set-cookie"]
    name, _, value = cookie.split(";")[0].partition("=")
    assert name == COOKIE_NAME and value and OPERATOR not in cookie  # sealed, not the token
    attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/", f"max-age={SESSION_SECONDS}"} <= attributes
    assert "Signed in to the dashboard as admin-token (admin)." in text(response.text)
    assert 'content="0; url=/devices/plant-a-cluster?x=1"' in response.text
    assert "plant-a-cluster" not in text(response.text.split("<main")[1]).replace(
        "/devices/plant-a-cluster", "")  # continues; shows nothing itself
    odd = httpx.get(fleet.base + f"/devices/a%3Fb?token={OPERATOR}")
    assert 'url=/devices/a%3Fb"' in odd.text  # the path stays a path when continuing
    jar = {COOKIE_NAME: value}
    with httpx.Client(base_url=fleet.base, cookies=jar) as browser:
        assert browser.get("/devices/plant-a-cluster").status_code == 200
        assert browser.get("/").status_code == 200
        assert browser.get("/api/fleet/devices").status_code == 401  # not an API credential


def test_an_open_server_without_source_shows_an_empty_fleet(tmp_path: Path) -> None:
    data = tmp_path / "data"
    add_client(data, "edge")
    with running_server(data) as base:
        response = httpx.get(base + "/")
        assert response.status_code == 200
        page = text(response.text)
        assert "No device has reported its capabilities yet." in page
        assert "The fleet source cannot be read: no fleet source is configured" in page
        assert httpx.get(base + "/applications/x").status_code == 404
        # Everyone is an admin, and the pages' forms are bound to an anonymous session.
        assert "Open server: no credentials, everyone is an admin" in page
        assert "Sign out" not in page and response.cookies.get(COOKIE_NAME)
        assert httpx.get(base + "/?token=anything").status_code == 200  # no tokens to check


def test_the_actions_shown_are_those_the_role_and_the_rollouts_state_allow() -> None:
    rollout = {"intent": "web", "status": "paused", "reason": "", "openWave": 0, "plot": "",
               "actions": list(actions_for("paused")),
               "waves": [{"name": "canary", "devices": 1, "moved": 1, "installed": 0,
                          "failed": 0, "stale": 0, "pending": 1, "held": 0}]}

    def shown(session: Session | None) -> list[str]:
        page = render_page("overview.html", nonce="n", path="/", title="t", devices=[],
                           counts={"total": 0, "byState": {}, "byApplication": {}},
                           catalogue=Catalogue(), applications=[], source=None,
                           source_kind="none", rollouts=[rollout], session=session)
        return re.findall(r'data-action="(\w+)"', page)

    def session(role: Role, *, open_server: bool = False) -> Session:
        return Session(Operator("someone", role, "token"), "b", not open_server, "t",
                       open_server=open_server)

    assert shown(session(Role.OPERATOR)) == ["resume", "abort"]
    assert shown(session(Role.ADMIN, open_server=True)) == ["resume", "abort"]
    assert shown(session(Role.VIEWER)) == [] and shown(None) == []
    assert [actions_for(s) for s in ("progressing", "paused", "rolled back", "complete")] == [
        ("pause", "abort"), ("resume", "abort"), (), ()]


def test_an_intent_waiting_for_capacity_is_shown_with_the_numbers(tmp_path: Path) -> None:
    from kits.fleetkit import Fleet as Source
    from kits.fleetkit import app, device, intent

    source = Source(tmp_path / "source")
    source.apps["com-example-app"] = app(
        constraints={"capacityRequirements": {"cpu": {"cores": 1}, "memory": "512Mi"}},
        compose=False, parameters={})
    source.intents.update({n: intent(n) for n in ("w-one", "w-two")})
    source.write()
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source", str(source.source)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        response = http.put("/api/v1/capabilities/box",
                            json=device("box", cores=1, memory="512Mi"))
        assert response.status_code in (200, 201), response.text
        wait_for(lambda: [d["intent"] for d in http.get("/api/fleet/devices/box").json()
                          ["deployments"]] == ["w-one"], "the compile")
        page = http.get("/devices/box").text
    waiting = text(row(page, "intent", "w-two"))
    assert "w-two: waiting for capacity" in waiting
    assert ("needs 1 core; the device has 1, of which 1 is assigned to w-one") in waiting
    assert "w-one: eligible" in text(row(page, "intent", "w-one"))


def test_an_upgrade_held_for_capacity_is_shown_with_the_numbers(tmp_path: Path) -> None:
    """Issue 28: x moves to 2.0.0 (1.5 cores), y's upgrade no longer fits and is held."""
    from kits.fleetkit import Fleet as Source
    from kits.fleetkit import app, device, intent

    from margo.canonical import canonical_yaml

    def version(number: str, cores: float) -> dict[str, Any]:
        return app(version=number, revision=number, compose=False, parameters={},
                   constraints={"capacityRequirements": {"cpu": {"cores": cores}}})

    source = Source(tmp_path / "source")
    source.apps["com-example-app"] = version("1.0.0", 1)
    source.intents.update({n: intent(n) for n in ("x", "y")})
    source.write()
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source", str(source.source), "--watch-source") as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        response = http.put("/api/v1/capabilities/box", json=device("box", cores=2.5))
        assert response.status_code in (200, 201), response.text

        def digests() -> dict[str, str]:
            return {d["intent"]: d["digest"] for d in
                    http.get("/api/fleet/devices/box").json()["deployments"]}
        wait_for(lambda: sorted(digests()) == ["x", "y"], "the first compile")
        before = digests()
        upgrade = source.source / "apps" / "com-example-app" / "2.0.0" / "margo.yaml"
        upgrade.parent.mkdir()
        upgrade.write_bytes(canonical_yaml(version("2.0.0", 1.5)))
        wait_for(lambda: digests()["x"] != before["x"], "x's upgrade")
        assert digests()["y"] == before["y"]
        page = http.get("/devices/box").text
        explained = http.get("/api/fleet/explain", params={"intent": "y"}).json()
    held = text(row(page, "intent", "y"))
    assert "y: held for capacity" in held
    assert "needs 1.5 cores; the device has 2.5, of which 1.5 are assigned to x" in held
    assert "the device keeps running 1.0.0 until 2.0.0 fits" in held
    [entry] = explained["devices"][0]["intents"]
    assert (entry["status"], entry["heldAt"]) == ("held for capacity", "1.0.0")


# --- the pure parts ------------------------------------------------------------------------

def test_device_kind_nodes_and_gpus_from_types_cluster_and_labels() -> None:
    cluster = cluster_document("c")
    body = cluster["x-margo-gitops-extensions"]["cluster"]
    assert device_kind({"supportedDeploymentTypes": ["compose"]}, None) == "Compose box"
    assert device_kind({"supportedDeploymentTypes": ["helm"]}, None) == "Kubernetes cluster"
    assert device_kind({"supportedDeploymentTypes": ["compose"]}, body) == (
        "Kubernetes cluster + Compose box")
    assert device_kind({}, None) == "unknown"
    assert node_count(body, {"k8s.margo-gitops.dev/nodes": 7}) == 3
    assert node_count({"resources": {"nodeCount": 5}}, {}) == 5
    assert node_count(None, {"k8s.margo-gitops.dev/nodes": 7}) == 7
    assert node_count(None, {"k8s.margo-gitops.dev/nodes": True}) is None
    assert gpu_count({}, body, {"k8s.margo-gitops.dev/gpus": 9}) == 1
    assert gpu_count({}, None, {"k8s.margo-gitops.dev/gpus": 2}) == 2
    assert gpu_count({"peripherals": [{"type": "gpu"}, {"type": "usb"}, {"type": "gpu"}]},
                     None, {}) == 2
    assert cpu_summary({"cpus": [{"cores": 3.8, "architecture": "arm64"}]}) == (
        "3.8 cores: 3.8 arm64")
    assert cpu_summary({}) == "-"


def test_failing_clauses_keep_every_clause_with_values_in_explain_order() -> None:
    failure = {"message": "m", "required": ["plant-a"], "actual": None}
    clauses = failing_clauses({
        "targeting": [failure], "attempts": [{"profile": "p1", "failures": [failure, failure]}],
        "problems": [{"path": "$.spec", "message": "bad", "expected": None, "found": None}],
        "capacity": [failure], "note": "kept for the grace period"})
    assert [c.where for c in clauses] == ["targeting", "profile p1", "profile p1", "capacity",
                                         "$.spec", "note"]
    assert clauses[0].has_values and clauses[0].required == ["plant-a"]
    assert clauses[3].has_values
    assert not clauses[4].has_values and not clauses[5].has_values
    assert failing_clauses({"targeting": [], "attempts": [], "problems": []}) == []


def test_commit_view_drops_trailers_and_states_order_by_severity() -> None:
    view = _commit_view({"commit": "a" * 40, "time": 0, "message":
                         "dev: add x\n\n- x.yaml: add (intent added)\n\n"
                         "Fleet-Source: sha256:1\nInputs-Digest: sha256:2\n"})
    assert view["summary"] == "dev: add x" and view["body"] == "- x.yaml: add (intent added)"
    assert _commit_view({"commit": "b", "time": 0, "message": "one line"})["body"] == ""
    assert _by_severity({"installed": 2, "failed": 1, "pending": 0, "weird": 1}) == [
        ("failed", 1), ("installed", 2), ("weird", 1)]
    assert _ago(100.0, now=3700.0) == "1 h ago" and _ago(None) == "never"
    assert _ago(100.0, now=142.0) == "42 s ago"


def test_the_hostile_fixture_is_really_unusable_through_the_api(fleet: Fleet) -> None:
    """The stored hostile id must be one the API refuses, or the escaping test proves less."""
    doc = caps("compose-box-amd64", HOSTILE_ID)
    response = fleet.device_http.put("/api/v1/capabilities/" + quote(HOSTILE_ID, safe=""),
                                     json=doc)
    assert response.status_code == 422


def test_a_device_without_an_encryption_key_is_told_why_it_gets_no_secret(
        tmp_path: Path) -> None:
    """Issue 32: a device that reported no encryption key cannot receive a sensitive value;
    its page and the application's say why, and the value appears nowhere on either."""
    import pyrage
    from kits.fleetkit import Fleet as Source
    from kits.fleetkit import app, device, intent

    from compiler.secrets import FleetKey, encrypt_secret, new_identity_text, write_identity_file
    from margo.sealing import EXTENSION, key_report

    key_file = tmp_path / "fleet.key"
    write_identity_file(key_file, new_identity_text())
    plaintext = "s3cr3t-for-the-dashboard"
    source = Source(tmp_path / "source")
    source.apps["com-example-app"] = app(parameters={"password": {
        "sensitive": True, "targets": [{"pointer": "db.password", "components": ["web"]}]}})
    source.intents["db"] = intent("db", parameters={"password": {"secret": encrypt_secret(
        plaintext, [FleetKey.load(key_file).recipient])}})
    source.write()
    data = tmp_path / "data"
    token = add_client(data, "edge")
    keyed = device("keyed")
    keyed[EXTENSION] = key_report(str(pyrage.x25519.Identity.generate().to_public()))
    with running_server(data, "--source", str(source.source), "--fleet-key",
                        str(key_file)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        for name, doc in (("keyed", keyed), ("plain", device("plain"))):
            response = http.put(f"/api/v1/capabilities/{name}", json=doc)
            assert response.status_code in (200, 201), response.text
        wait_for(lambda: [d["intent"] for d in http.get("/api/fleet/devices/keyed").json()
                          ["deployments"]] == ["db"], "the compile")
        device_page = http.get("/devices/plain").text
        app_page = http.get("/applications/com-example-app").text
    said = text(row(device_page, "intent", "db"))
    assert "reported no encryption key" in said and "password" in said, said
    assert "reported no encryption key" in text(app_page)
    assert plaintext not in device_page + app_page
