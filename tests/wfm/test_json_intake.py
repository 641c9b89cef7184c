"""Every JSON body the server takes is parsed strictly (`margo.jsonstrict`): non-finite
numbers, duplicate keys and the like are a 400 problem at the door, nothing is stored, and
the read API, which must serialize what was stored, keeps answering 200."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kits.serverkit import ROOT, add_client, assert_matches_openapi, running_server
from test_fleet_api import fleet_repository, git

from margo import jsonstrict
from reconciler.sources.rest_source import IntegrityError, _parse_manifest
from tools.polling import poll_until
from wfm.http.webhooks import WebhookError, verify_push

CAPS = ROOT / "examples" / "capabilities"
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "2.5E+400"]
SECRET = "s3cret"
DEVICE = "k8s-cluster-gpu"


def caps_text(name: str = DEVICE) -> str:
    return (CAPS / f"{name}.json").read_text()


def finite_only(text: str) -> Any:
    """The response parsed with the strict parser: it fails on anything non-finite."""
    return jsonstrict.loads(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("intake")
    shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
    data = root / "data"
    token = add_client(data, "site-a")
    with running_server(data, "--source", str(root / "fleet")) as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.put(f"/api/v1/capabilities/{DEVICE}", content=caps_text(),
                        headers={"Content-Type": "application/json"}).status_code == 201
        yield {"base": base, "http": http}


def assert_invalid_request(response: httpx.Response, literal: str | None = None) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert_matches_openapi("rc.3", "ProblemDetail", problem)
    assert problem["type"].endswith("#invalid-request")
    if literal is not None:
        assert literal in problem["detail"]


def stored_capabilities(http: httpx.Client) -> dict[str, Any]:
    response = http.get(f"/api/fleet/devices/{DEVICE}")
    assert response.status_code == 200, response.text
    assert http.get("/api/fleet/devices").status_code == 200
    document: dict[str, Any] = finite_only(response.text)["capabilities"]
    return document


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize("where", ["cores", "label", "extra"])
def test_non_finite_numbers_in_a_capability_report_are_refused(
        server: dict[str, Any], literal: str, where: str) -> None:
    http = server["http"]
    before = stored_capabilities(http)
    text = caps_text()
    if where == "cores":
        body = text.replace('"cores": 8', f'"cores": {literal}', 1)
    elif where == "label":
        body = text.replace('"labels": {', f'"labels": {{"example.com/weight": {literal},', 1)
    else:
        body = text.replace('"properties": {', f'"properties": {{"x-extra": [{literal}],', 1)
    assert body != text
    response = http.put(f"/api/v1/capabilities/{DEVICE}", content=body,
                        headers={"Content-Type": "application/json"})
    assert_invalid_request(response, literal.lstrip("-"))
    assert stored_capabilities(http) == before  # nothing stored, and the read API answers


def test_duplicate_keys_are_refused(server: dict[str, Any]) -> None:
    http = server["http"]
    body = caps_text().replace('"properties": {', '"properties": {"memory": "1 Gi",', 1)
    response = http.put(f"/api/v1/capabilities/{DEVICE}", content=body)
    assert_invalid_request(response, "duplicate object key 'memory'")


def test_oct_2024_and_rc2_capability_paths_are_strict_too(server: dict[str, Any]) -> None:
    http = server["http"]
    body = caps_text().replace('"cores": 8', '"cores": NaN', 1)
    for method, path in [("PUT", f"/device/{DEVICE}/capabilities"),
                         ("POST", "/api/v1/clients/site-a/capabilities")]:
        assert_invalid_request(http.request(method, path, content=body), "NaN")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_a_status_report_are_refused(
        server: dict[str, Any], literal: str) -> None:
    http = server["http"]

    def assigned() -> bool:
        return bool(http.get("/api/v1/deployments").json()["deployments"])

    poll_until("a deployment", assigned, timeout=20, interval=0.2)
    manifest = http.get("/api/v1/deployments").json()
    ref = manifest["deployments"][0]
    report = json.dumps({"deploymentId": ref["deploymentId"],
                         "adoptedManifestVersion": "@VERSION@",
                         "status": {"state": "installing"},
                         "components": [{"name": "any", "state": "installing"}]})
    path = f"/api/v1/deployments/{ref['deploymentId']}/status"
    response = http.post(path, content=report.replace('"@VERSION@"', literal))
    assert_invalid_request(response)
    nested = report.replace('"@VERSION@"', str(manifest["manifestVersion"])).replace(
        '"state": "installing"}', f'"state": "installing", "x-progress": {literal}}}', 1)
    assert_invalid_request(http.post(path, content=nested), literal.lstrip("-"))
    device = http.get(f"/api/fleet/devices/{DEVICE}")
    assert device.status_code == 200
    finite_only(device.text)
    assert http.get("/api/fleet/deployments").status_code == 200


# --- the property: whatever numbers a JSON text holds, never a 500 ------------------------

_DIGITS = st.text("0123456789", min_size=1, max_size=400)
_NUMBERS = st.one_of(
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "0.0", "1E-999"]),
    st.builds(lambda sign, digits: sign + digits.lstrip("0") or "0",
              st.sampled_from(["", "-"]), _DIGITS),
    st.builds(lambda sign, whole, frac, exp: f"{sign}{whole}.{frac}e{exp}",
              st.sampled_from(["", "-"]), st.integers(0, 10**6), _DIGITS,
              st.integers(-2000, 2000)),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)
_WHERE = st.sampled_from(["cores", "label", "extra", "nested"])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(number=_NUMBERS, where=_WHERE)
def test_any_json_number_is_stored_finite_or_refused_never_a_500(
        server: dict[str, Any], number: str, where: str) -> None:
    http = server["http"]
    text = caps_text()
    if where == "cores":
        body = text.replace('"cores": 8', f'"cores": {number}', 1)
    elif where == "label":
        body = text.replace('"labels": {', f'"labels": {{"example.com/n": {number},', 1)
    elif where == "extra":
        body = text.replace('"properties": {', f'"properties": {{"x-n": {number},', 1)
    else:
        body = text.replace('"properties": {', f'"properties": {{"x-n": [[{{"v": {number}}}]],',
                            1)
    response = http.put(f"/api/v1/capabilities/{DEVICE}", content=body)
    assert response.status_code < 500, response.text
    if response.status_code < 300:
        stored = stored_capabilities(http)  # strict: every stored number is finite

        def numbers(value: Any) -> Iterator[float]:
            if isinstance(value, dict):
                for item in value.values():
                    yield from numbers(item)
            elif isinstance(value, list):
                for item in value:
                    yield from numbers(item)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield float(value)

        assert all(math.isfinite(n) for n in numbers(stored))
    else:
        assert 400 <= response.status_code < 500
        stored_capabilities(http)  # the read API still answers
    # put the example back for the next example
    assert http.put(f"/api/v1/capabilities/{DEVICE}", content=caps_text()).status_code == 200


# --- the push hook ---------------------------------------------------------------------------


def signed_push(body: bytes) -> dict[str, str]:
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {"X-GitHub-Event": "push", "X-Hub-Signature-256": signature,
            "X-GitHub-Delivery": "1", "Content-Type": "application/json"}


PUSH = ('{"ref": "refs/heads/main", "before": "@B@", "after": "@A@", "deleted": false, '
        '"size": @N@, "repository": {"full_name": "acme/fleet", '
        '"clone_url": "https://example.invalid/acme/fleet.git"}}')


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_verify_push_refuses_non_finite_numbers(literal: str) -> None:
    body = PUSH.replace("@B@", "0" * 40).replace("@A@", "a" * 40).replace("@N@", literal)
    with pytest.raises(WebhookError) as caught:
        verify_push(body.encode(), signed_push(body.encode()), SECRET)
    assert caught.value.status == 400
    assert ("finite double" if literal[0].isdigit() else literal) in str(caught.value)
    assert "999" not in str(caught.value)  # the hook's messages never quote the body


def test_the_push_hook_refuses_non_finite_numbers_over_http(tmp_path: Path) -> None:
    work = fleet_repository(tmp_path / "fleet")
    head = git("rev-parse", "HEAD", cwd=work)
    (tmp_path / "secret").write_text(SECRET + "\n")
    data = tmp_path / "data"
    add_client(data, "edge")
    with running_server(data, "--source-url", str(work), "--source-branch", "main",
                        "--webhook-secret-file", str(tmp_path / "secret")) as base:
        for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
            body = PUSH.replace("@B@", "0" * 40).replace("@A@", head).replace(
                "@N@", literal).encode()
            response = httpx.post(f"{base}/hooks/git", content=body, headers=signed_push(body))
            assert response.status_code == 400, response.text
            assert response.headers["content-type"] == "application/problem+json"
            assert ("finite double" if literal[0].isdigit() else literal) in (
                response.json()["detail"])
        body = PUSH.replace("@B@", "0" * 40).replace("@A@", head).replace("@N@", "1").encode()
        accepted = httpx.post(f"{base}/hooks/git", content=body, headers=signed_push(body),
                              timeout=30)
        assert accepted.status_code == 202, accepted.text
        assert httpx.get(f"{base}/api/fleet/source").status_code == 200


# --- the device side -------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "1e999"])
def test_the_device_refuses_a_manifest_with_non_finite_numbers(literal: str) -> None:
    body = ('{"manifestVersion": @V@, "bundle": null, "deployments": []}'
            .replace("@V@", literal).encode())
    with pytest.raises(IntegrityError, match="not JSON"):
        _parse_manifest(body)
