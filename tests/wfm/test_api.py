"""The Margo API of `margo serve`, over real HTTP on loopback, three generations."""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.serverkit import (
    ROOT,
    add_client,
    assert_deployment_in_generation,
    assert_matches_openapi,
    check_response,
    killable_server,
    running_server,
)

from margo.kinds import detect
from margo.loading import load_document
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
CAPS = ROOT / "examples" / "capabilities"


def caps(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / f"{name}.json").read_text())
    return doc


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("wfm")
    shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
    data = root / "data"
    tokens = {name: add_client(data, name) for name in ("site-a", "site-b")}
    with running_server(data, "--source", str(root / "fleet")) as base:
        yield {"base": base, "tokens": tokens, "data": data, "root": root}


def client(server: dict[str, Any], name: str = "site-a") -> httpx.Client:
    """A device's HTTP client; every response it gets is checked against the OpenAPI."""
    return httpx.Client(base_url=server["base"], timeout=10,
                        headers={"Authorization": f"Bearer {server['tokens'][name]}"},
                        event_hooks={"response": [check_response]})


def wait_for_deployments(http: httpx.Client, path: str = "/api/v1/deployments",
                         at_least: int = 1) -> dict[str, Any]:
    """The manifest once it lists `at_least` deployments. A compile on a busy machine (two
    replicas, the whole suite beside them) can take well over 20 s, so the wait is long and
    its failure says what was last served; a test that went on after a shorter wait met a
    device without a branch yet (a Git clone answered 404), which looked like a server bug."""
    seen: list[dict[str, Any]] = [{}]

    def enough() -> bool:
        seen[0] = http.get(path).json()
        return len(seen[0]["deployments"]) >= at_least

    poll_until(f"{at_least} deployments in {path}", enough, timeout=90, interval=0.2,
               describe=lambda: f"the last manifest listed {len(seen[0].get('deployments', []))}")
    return seen[0]


def test_requests_without_credentials_are_refused(server: dict[str, Any]) -> None:
    response = httpx.get(f"{server['base']}/api/v1/deployments")
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert_matches_openapi("rc.3", "ProblemDetail", response.json())
    bad = httpx.get(f"{server['base']}/api/v1/deployments",
                    headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401


def test_a_fresh_client_gets_manifest_version_1_with_a_null_bundle(
        server: dict[str, Any]) -> None:
    with client(server, "site-b") as http:
        response = http.get("/api/v1/deployments", headers={"Accept": MANIFEST})
        assert response.status_code == 200
        body = response.json()
        assert body == {"manifestVersion": 1, "bundle": None, "deployments": []}
        assert_matches_openapi("rc.3", "UnsignedAppStateManifest", body)
        assert response.headers["etag"] == f'"{sha256(response.content)}"'


def test_capabilities_created_then_updated_then_rejected(server: dict[str, Any]) -> None:
    with client(server) as http:
        doc = caps("k8s-single-amd64")
        assert http.put("/api/v1/capabilities/k8s-single-amd64", json=doc).status_code == 201
        assert http.put("/api/v1/capabilities/k8s-single-amd64", json=doc).status_code == 200
        bad = copy.deepcopy(doc)
        bad["properties"]["supportedDeploymentTypes"] = ["docker-swarm"]
        response = http.put("/api/v1/capabilities/k8s-single-amd64", json=bad)
        assert response.status_code == 422
        problem = response.json()
        assert problem["type"] == ("https://docs.margo.org/specification/problem-types"
                                   "#semantic-error")
        assert problem["errors"][0]["field"] == "$.properties.supportedDeploymentTypes[0]"
        assert_matches_openapi("rc.3", "ProblemDetail", problem)
        mismatch = http.put("/api/v1/capabilities/someone-else", json=doc)
        assert mismatch.status_code == 422
        assert http.put("/api/v1/capabilities/x", content=b"{not json").status_code == 400
        orphan = copy.deepcopy(doc)
        orphan["properties"]["id"] = "no-gateway/child"
        response = http.put("/api/v1/capabilities/no-gateway/child", json=orphan)
        assert response.status_code == 404
        assert response.json()["type"].endswith("#gateway-not-found")


#: The generation each device of these tests speaks (the API its capabilities went through).
GENERATION_OF = {"k8s-cluster-gpu": "rc.3", "k8s-single-amd64": "rc.3",
                 "compose-box-amd64": "rc.2", "legacy-box-oct2024": "oct-2024"}


def assert_in_their_generations(documents: list[bytes]) -> None:
    """Each served ApplicationDeployment in the shape of its device's generation."""
    for data in documents:
        device_id = load_document(data).value["metadata"].get("deviceId")
        assert_deployment_in_generation(GENERATION_OF[device_id], data)


def test_desired_state_flows_from_capabilities_to_the_manifest(server: dict[str, Any]) -> None:
    with client(server) as http:
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        manifest = wait_for_deployments(http, at_least=4)
        response = http.get("/api/v1/deployments", headers={"Accept": MANIFEST})
        assert response.headers["content-type"] == MANIFEST
        assert response.headers["cache-control"] == "private"
        etag = response.headers["etag"]
        assert etag == f'"{sha256(response.content)}"'
        manifest = response.json()
        assert_matches_openapi("rc.3", "UnsignedAppStateManifest", manifest)
        assert manifest["bundle"]["mediaType"] == "application/vnd.margo.bundle.v1+tar+gzip"
        again = http.get("/api/v1/deployments", headers={"If-None-Match": etag})
        assert (again.status_code, again.content) == (304, b"")
        assert http.get("/api/v1/deployments", headers={"Accept": "text/plain"}).status_code == 406
        assert http.get("/api/v1/deployments",
                        headers={"Accept": "text/plain, application/*;q=0.5"}).status_code == 200
        files = {}
        for ref in manifest["deployments"]:
            yaml_response = http.get(ref["url"])
            assert yaml_response.status_code == 200
            assert sha256(yaml_response.content) == ref["digest"]
            assert yaml_response.headers["etag"] == f'"{ref["digest"]}"'
            assert yaml_response.headers["cache-control"] == "private, max-age=31536000, immutable"
            assert yaml_response.headers["vary"] == "Accept-Encoding"
            assert yaml_response.headers["content-type"].startswith("application/yaml")
            files[f"{ref['deploymentId']}.yaml"] = yaml_response.content
        assert_in_their_generations(list(files.values()))
        bundle = http.get(manifest["bundle"]["url"])
        assert sha256(bundle.content) == manifest["bundle"]["digest"]
        with tarfile.open(fileobj=io.BytesIO(bundle.content)) as tar:
            assert {m.name: tar.extractfile(m).read() for m in tar} == files  # type: ignore[union-attr]
        assert gzip.decompress(bundle.content)
        missing = http.get(f"/api/v1/deployments/{manifest['deployments'][0]['deploymentId']}/"
                           f"sha256:{'0' * 64}")
        assert missing.status_code == 404
        assert missing.json()["type"].endswith("#deployment-not-found")
        assert http.get(f"/api/v1/bundles/sha256:{'0' * 64}").json()["type"].endswith(
            "#invalid-bundle")


def test_status_reports(server: dict[str, Any]) -> None:
    with client(server) as http:
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        manifest = wait_for_deployments(http, at_least=1)
        ref = manifest["deployments"][0]
        report = {"deploymentId": ref["deploymentId"],
                  "adoptedManifestVersion": manifest["manifestVersion"],
                  "status": {"state": "installing"},
                  "components": [{"name": "any", "state": "installing"}]}
        path = f"/api/v1/deployments/{ref['deploymentId']}/status"
        first = http.post(path, json=report)
        assert first.status_code == 200
        assert http.post(path, json=report).status_code == 200  # idempotent
        as_text = {**report, "adoptedManifestVersion": str(manifest["manifestVersion"])}
        assert http.post(path, json=as_text).status_code == 200  # the conformance kit's form
        unknown = http.post("/api/v1/deployments/never-assigned/status",
                            json={**report, "deploymentId": "never-assigned"})
        assert unknown.status_code == 422
        assert http.post(path, json={**report, "status": {"state": "running"}}).status_code == 422
        no_version = {k: v for k, v in report.items() if k != "adoptedManifestVersion"}
        assert http.post(path, json=no_version).status_code == 422
    with client(server, "site-b") as other:
        assert other.post(path, json=report).status_code == 422  # not theirs
        assert other.get(ref["url"]).status_code == 404
        taken = other.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        assert taken.status_code == 403


def test_rc2_paths_are_scoped_to_the_path_client(server: dict[str, Any]) -> None:
    with client(server) as http:
        rc2 = "/api/v1/clients/site-a"
        body = caps("compose-box-amd64")
        assert http.post(f"{rc2}/capabilities", json=body).status_code == 201
        assert http.put(f"{rc2}/capabilities/compose-box-amd64", json=body).status_code == 201
        manifest = wait_for_deployments(http, f"{rc2}/deployments", at_least=1)
        assert_matches_openapi("rc.2", "UnsignedAppStateManifest", manifest)

        def box_documents() -> list[bytes] | None:
            """The manifest once it names the box's deployments (the client's other
            devices' may come first), each fetched; the box speaks rc.2."""
            found = http.get(f"{rc2}/deployments").json()["deployments"]
            documents = [http.get(ref["url"]).content for ref in found]
            return documents if any(b"compose-box-amd64" in d for d in documents) else None

        assert_in_their_generations(poll_until("the box's deployments", box_documents,
                                               timeout=90, interval=0.2))
        manifest = http.get(f"{rc2}/deployments").json()
        assert all(ref["url"].startswith(f"{rc2}/deployments/") for ref in
                   manifest["deployments"])
        report = {"apiVersion": "deployment.margo.org/v1alpha1",
                  "kind": "DeploymentStatusManifest",
                  "deploymentId": manifest["deployments"][0]["deploymentId"],
                  "status": {"state": "installed"},
                  "components": [{"name": "hello-world-compose", "state": "installed"}]}
        assert_matches_openapi("rc.2", "DeploymentStatusManifest", report)
        path = f"{rc2}/deployments/{report['deploymentId']}/status"
        assert http.post(path, json=report).status_code == 200
        assert http.post(path.replace("/deployments/", "/deployment/"),
                         json={**report, "status": {"state": "removing"}}).status_code == 200
        assert http.get(manifest["deployments"][0]["url"]).status_code == 200
        assert http.get("/api/v1/clients/site-b/deployments").status_code == 403


def test_a_device_whose_client_moves_to_rc2_gets_rc2_documents(
        server: dict[str, Any]) -> None:
    """The same capability document through the rc.2 API: the device now speaks rc.2 (the
    read API says so) and its documents are rewritten in that shape; the REST digests and
    the bundle are those bytes."""
    doc = caps("k8s-single-arm64")

    def documents_in(generation: str) -> list[bytes] | None:
        manifest = http.get("/api/v1/deployments").json()
        served = [http.get(ref["url"]).content for ref in manifest["deployments"]]
        mine = [d for d in served if b"deviceId: k8s-single-arm64" in d]
        shapes = {detect(load_document(d).value).shape for d in mine}
        return mine if mine and shapes == {generation} else None

    with client(server, "site-b") as http:
        assert http.put("/api/v1/capabilities/k8s-single-arm64", json=doc).status_code == 201
        poll_until("rc.3 documents", lambda: documents_in("rc.3"), timeout=90, interval=0.2)
        moved = http.put("/api/v1/clients/site-b/capabilities/k8s-single-arm64", json=doc)
        assert moved.status_code == 201
        for data in poll_until("rc.2 documents", lambda: documents_in("rc.2"), timeout=90,
                               interval=0.2):
            assert_deployment_in_generation("rc.2", data)
        manifest = http.get("/api/v1/deployments").json()
        bundle = http.get(manifest["bundle"]["url"]).content
        with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
            assert sorted(sha256(tar.extractfile(m).read())  # type: ignore[union-attr]
                          for m in tar) == sorted(r["digest"] for r in manifest["deployments"])
    detail = httpx.get(f"{server['base']}/api/fleet/devices/k8s-single-arm64").json()
    assert detail["shape"] == "rc.2"


def test_oct_2024_paths_and_oauth_tokens(server: dict[str, Any], tmp_path: Path) -> None:
    token = server["tokens"]["site-a"]
    response = httpx.post(f"{server['base']}/oauth/token",
                          data={"grant_type": "client_credentials", "client_id": "site-a",
                                "client_secret": token})
    assert response.status_code == 200
    access = response.json()["access_token"]
    assert response.json()["token_type"] == "Bearer"
    bad = httpx.post(f"{server['base']}/oauth/token",
                     data={"grant_type": "client_credentials", "client_id": "site-a",
                           "client_secret": "wrong"})
    assert bad.status_code == 401
    with httpx.Client(base_url=server["base"],
                      headers={"Authorization": f"Bearer {access}"}) as http:
        old = json.loads((ROOT / "examples" / "capabilities" / "legacy-box-oct2024.json")
                         .read_text())
        assert http.post("/device/legacy-box-oct2024/capabilities", json=old).status_code == 201
    # Its branch (what an Oct-2024 device clones) holds Oct-2024 documents.
    files = poll_until("the old box's branch", lambda: branch_files(
        server, "legacy-box-oct2024", tmp_path / f"clone-{time.monotonic_ns()}") or None,
        timeout=90, interval=0.2)
    for data in files.values():
        assert_deployment_in_generation("oct-2024", data)
    # Its documents name no device, so a sibling reading the client's REST manifest would
    # take them for its own: they stay on the box's branch.
    box = {yaml.safe_load(data)["metadata"]["annotations"]["id"] for data in files.values()}
    with client(server) as http:
        assert http.put("/api/v1/capabilities/k8s-single-amd64",
                        json=caps("k8s-single-amd64")).status_code in (200, 201)
        manifest = wait_for_deployments(http)
    assert box and not box & {ref["deploymentId"] for ref in manifest["deployments"]}
    # ... and the box's reports about them are still its own.
    deployment = sorted(box)[0]
    report = {"apiVersion": "deployment.margo.org/v1alpha1",
              "kind": "DeploymentStatusManifest", "deploymentId": deployment,
              "status": {"state": "Installed"}, "components": []}
    posted = httpx.post(f"{server['base']}/device/legacy-box-oct2024/deployment/{deployment}"
                        "/status", json=report, headers={"Authorization": f"Bearer {access}"})
    assert posted.status_code == 201, posted.text


def branch_files(server: dict[str, Any], device_id: str, into: Path) -> dict[str, bytes]:
    """The documents of a device's branch, cloned over Git HTTP as its client would."""
    import subprocess

    url = server["base"].replace("http://", f"http://site-a:{server['tokens']['site-a']}@")
    env = {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": str(into.parent)}
    subprocess.run(["git", "clone", "-q", f"{url}/git/devices/{device_id}.git", str(into)],
                   capture_output=True, env=env, check=False)
    return {p.name: p.read_bytes() for p in into.glob("*.yaml")}


def test_manifest_version_survives_a_restart_and_grows_on_change(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    headers = {"Authorization": f"Bearer {token}"}
    with running_server(data, "--source", str(tmp_path / "fleet")) as base, \
            httpx.Client(base_url=base, headers=headers) as http:
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        manifest = wait_for_deployments(http, at_least=3)
        version = manifest["manifestVersion"]
        assert version >= 1
    with running_server(data, "--source", str(tmp_path / "fleet")) as base, \
            httpx.Client(base_url=base, headers=headers) as http:
        time.sleep(0.5)
        assert http.get("/api/v1/deployments").json()["manifestVersion"] == version
        moved = caps("k8s-cluster-gpu")  # another site: the greeting changes
        moved["labels"]["example.com/site"] = "plant-z"
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=moved)
        current = poll_until("the next manifest", lambda: (
            found if (found := http.get("/api/v1/deployments").json())["manifestVersion"]
            > version else None), timeout=20, interval=0.2)
        assert current["manifestVersion"] == version + 1
        assert len(current["deployments"]) == 3  # vision-plant-a no longer targeted


def test_acknowledged_reports_survive_sigkill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "edge")
    headers = {"Authorization": f"Bearer {token}"}
    acknowledged = []
    with killable_server(data) as (base, process), \
            httpx.Client(base_url=base, headers=headers, timeout=5) as http:
        for i in range(40):
            doc = caps("compose-box-amd64")
            doc["properties"]["id"] = f"box-{i}"
            if http.put(f"/api/v1/capabilities/box-{i}", json=doc).status_code == 201:
                acknowledged.append(f"box-{i}")
        process.kill()
        process.wait()
    with running_server(data) as base, httpx.Client(base_url=base, headers=headers) as http:
        for device_id in acknowledged:
            doc = caps("compose-box-amd64")
            doc["properties"]["id"] = device_id
            assert http.put(f"/api/v1/capabilities/{device_id}", json=doc).status_code == 200
    assert len(acknowledged) == 40


def test_devices_clone_their_own_repository_over_git_http(server: dict[str, Any],
                                                          tmp_path: Path) -> None:
    import subprocess

    with client(server) as http:
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))

        def gpu_documents() -> list[bytes] | None:
            """The GPU cluster's own documents once it has its three: the manifest also
            lists the client's other devices' deployments (other tests add them), so a
            count of the whole manifest can be reached before this device's branch exists
            (then the clone below met a 404, on replicas, under the full suite)."""
            refs = http.get("/api/v1/deployments").json()["deployments"]
            documents = [http.get(ref["url"]).content for ref in refs]
            mine = [d for d in documents if b"k8s-cluster-gpu" in d]
            return mine if len(mine) >= 3 else None

        served = poll_until("the GPU cluster's three deployments", gpu_documents,
                            timeout=90, interval=0.2)
    token = server["tokens"]["site-a"]
    url = server["base"].replace("http://", f"http://site-a:{token}@")
    env = {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": str(tmp_path)}
    clone = subprocess.run(["git", "clone", "-q", f"{url}/git/devices/k8s-cluster-gpu.git",
                            str(tmp_path / "gpu")], capture_output=True, text=True, env=env,
                           check=False)
    assert clone.returncode == 0, clone.stderr
    files = {p.name: p.read_bytes() for p in (tmp_path / "gpu").glob("*.yaml")}
    assert sorted(files.values()) == sorted(served)
    refs = subprocess.run(["git", "ls-remote", f"{url}/git/devices/k8s-cluster-gpu.git"],
                          capture_output=True, text=True, env=env, check=True).stdout
    assert {line.split()[1] for line in refs.splitlines()} == {
        "HEAD", "refs/heads/devices/k8s-cluster-gpu"}
    other = server["base"].replace("http://", f"http://site-b:{server['tokens']['site-b']}@")
    refused = subprocess.run(["git", "ls-remote", f"{other}/git/devices/k8s-cluster-gpu.git"],
                             capture_output=True, text=True, env=env, check=False)
    assert refused.returncode != 0


def test_rc2_onboarding(server: dict[str, Any]) -> None:
    import base64

    from cryptography import x509

    response = httpx.get(f"{server['base']}/api/v1/onboarding/certificate")
    assert response.status_code == 200
    ca = x509.load_pem_x509_certificate(base64.b64decode(response.json()["certificate"]))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    device_cert = base64.b64encode(base64.b64decode(response.json()["certificate"])).decode()
    onboarded = httpx.post(f"{server['base']}/api/v1/onboarding", json={
        "apiVersion": "onboarding.margo.org/v1alpha1", "kind": "OnboardingRequest",
        "certificate": device_cert})
    assert onboarded.status_code == 201
    client_id, token = onboarded.json()["clientId"], onboarded.json()["token"]
    manifest = httpx.get(f"{server['base']}/api/v1/clients/{client_id}/deployments",
                         headers={"Authorization": f"Bearer {token}"})
    assert manifest.status_code == 200 and manifest.json()["manifestVersion"] == 1
    bad = httpx.post(f"{server['base']}/api/v1/onboarding", json={"certificate": "not base64!"})
    assert bad.status_code == 400
