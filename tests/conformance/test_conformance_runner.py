"""The runner's step semantics, each checked against a real HTTP server on loopback that
records what it was sent and answers what a test scripts: context extraction and
substitution, accepted statuses, polling, the rc.2 signing knobs (verified with the WFM's
own verifier), identities per step and per scenario, transport failures, and the inputs it
refuses. The kit's scenarios against `margo serve` are in test_wfm_kit / test_rc2_kit.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from kits.conformancekit import RecordingServer, write_rc2_identity
from kits.pkikit import issue_client_svid, make_lab

from conformance.runner import (
    CERTIFICATE_PLACEHOLDER,
    CertDir,
    Rc2Identity,
    Runner,
    RunnerOptions,
    StepResult,
    SuiteError,
    load_suite,
)
from wfm.identity.signatures import SignatureError, public_key_pem, verify_request

WRONG_DIGEST = "sha-256=:" + base64.b64encode(bytes(32)).decode() + ":"  # not the body's


@pytest.fixture
def wfm() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    write_rc2_identity(tmp_path / "certs")
    return tmp_path / "certs"


def run(server: RecordingServer, cert_dir: Path, *steps: dict[str, Any],
        **options: Any) -> list[StepResult]:
    with Runner(server.base, CertDir.load(cert_dir), RunnerOptions(**options)) as runner:
        return runner.run_scenario({"id": "s", "steps": list(steps)})


def step(**fields: Any) -> dict[str, Any]:
    return {"id": fields.pop("id", "x"), "method": "GET", "endpoint": "/thing",
            "expected_status": 200, **fields}


def verify(server: RecordingServer, index: int, cert_dir: Path) -> str:
    """The WFM's own rc.2 verifier on a recorded request; returns the key id."""
    recorded = server.requests[index]
    key = Rc2Identity.load(cert_dir / "device.key", cert_dir / "device-cert.pem").key
    public = load_pem_public_key(public_key_pem(key.private_key.public_key()).encode())
    return verify_request(method=recorded.method, url=server.base + recorded.path,
                          headers=recorded.headers, body=recorded.body,
                          resolve=lambda kid: public if kid == key.key_id else None, window=60)


def test_context_flows_from_passing_steps_into_later_requests(wfm: RecordingServer,
                                                              certs: Path) -> None:
    wfm.json("GET /list", 200, {"items": [{"id": "a1", "digest": "sha256:ab"}]}, ETag='"e1"')
    wfm.json("POST /items/a1/sha256:ab", 201, {})
    results = run(wfm, certs,
                  step(endpoint="/list", extract_context={"item": "items.0.id",
                                                          "digest": "items.0.digest",
                                                          "etag": "_headers.etag"}),
                  step(method="POST", endpoint="/items/{item}/{digest}", expected_status=201,
                       headers={"If-Match": "{etag}"}, request_body={"of": "{item}", "n": 3}))
    assert [r.verdict for r in results] == ["PASS", "PASS"]
    assert wfm.requests[1].headers["if-match"] == '"e1"'
    assert json.loads(wfm.requests[1].body) == {"of": "a1", "n": 3}


def test_a_failing_step_extracts_nothing_and_fallbacks_fill_the_gap(wfm: RecordingServer,
                                                                    certs: Path) -> None:
    wfm.json("GET /list", 200, {"items": [{"id": "a1"}]})
    results = run(wfm, certs,
                  step(endpoint="/list", extract_context={"deploymentId": "items.0.id"},
                       validations=[{"field": "items", "operation": "array_length_equals",
                                     "value": 2}]),
                  step(endpoint="/d/{deploymentId}/{deploymentDigest}/{unknown}",
                       expected_status=404))
    assert [r.verdict for r in results] == ["FAIL", "PASS"]
    assert "items expected length == 2, got 1" in results[0].reason
    assert wfm.requests[1].path == "/d/deployment-none-00000000/sha256:" + "0" * 64 + "/"


def test_accepted_statuses_pass_without_the_success_validations(wfm: RecordingServer,
                                                                certs: Path) -> None:
    wfm.replies["GET /thing"] = (404, {"Content-Type": "application/problem+json"},
                                 b'{"detail": "nope"}')
    checks = [{"field": "name", "operation": "exists"}]
    results = run(wfm, certs, step(accepted_statuses=[404], validations=checks),
                  step(validations=checks))
    assert results[0].verdict == "PASS" and "accepted instead of 200" in results[0].reason
    assert results[1].verdict == "FAIL"
    assert results[1].reason == 'expected HTTP 200, got HTTP 404 ({"detail": "nope"})'


def test_polling_repeats_until_the_condition_holds(wfm: RecordingServer, certs: Path) -> None:
    empty = (200, {"Content-Type": "application/json"}, b'{"deployments": []}')
    wfm.replies["GET /thing"] = [empty, empty, (200, {}, b'{"deployments": [1]}')]
    until = [{"field": "deployments", "operation": "array_length_gte", "value": 1}]
    results = run(wfm, certs, step(poll={"interval_seconds": 10, "timeout_seconds": 30,
                                         "until": until}), poll_interval=0.01)
    assert results[0].verdict == "PASS" and len(wfm.requests) == 3


def test_polling_gives_up_at_its_timeout(wfm: RecordingServer, certs: Path) -> None:
    wfm.json("GET /thing", 200, {"deployments": []})
    until = [{"field": "deployments", "operation": "array_length_gte", "value": 1}]
    results = run(wfm, certs, step(poll={"interval_seconds": 0.05, "timeout_seconds": 0.2,
                                         "until": until}))
    assert results[0].verdict == "FAIL" and "timed out after 0.2s" in results[0].reason


def test_only_the_headers_a_step_names_are_sent(wfm: RecordingServer, certs: Path) -> None:
    """No `Accept: */*` slipped in: "no Accept header" steps must really send none."""
    wfm.json("GET /thing", 200, {})
    run(wfm, certs, step(mtls=True), step(mtls=True, headers={"Accept": "text/plain"}))
    assert "accept" not in wfm.requests[0].headers
    assert "accept-encoding" not in wfm.requests[0].headers
    assert wfm.requests[1].headers["accept"] == "text/plain"


def test_rc2_requests_are_signed_as_the_kit_signs_them(wfm: RecordingServer,
                                                       certs: Path) -> None:
    wfm.json("POST /thing", 201, {})
    wfm.json("GET /thing", 200, {})
    run(wfm, certs, step(method="POST", expected_status=201, request_body={"a": 1}), step())
    post, get = wfm.requests
    assert post.headers["content-digest"].startswith("sha-256=:")
    assert post.headers["signature-input"].startswith(
        'sig1=("@method" "@target-uri" "@authority" "content-digest");created=')
    assert get.headers["signature-input"].startswith('sig1=("@method" "@target-uri" '
                                                     '"@authority");created=')
    assert "content-digest" not in get.headers
    kid = Rc2Identity.load(certs / "device.key", certs / "device-cert.pem").key.key_id
    assert verify(wfm, 0, certs) == verify(wfm, 1, certs) == kid


def test_the_negative_knobs(wfm: RecordingServer, certs: Path) -> None:
    wfm.json("POST /thing", 400, {})
    post = {"method": "POST", "expected_status": 400, "request_body": {"a": 1}}
    run(wfm, certs, step(**post, tamper_signature=True), step(**post, skip_content_digest=True),
        step(**post, skip_signing=True), step(**post, headers={"Content-Digest": ""}),
        step(**post, headers={"Content-Digest": WRONG_DIGEST}),
        step(**post, headers={"Content-Digest": "garbage"}), step(**post, mtls=True))
    _, no_digest, unsigned, empty_digest, wrong_digest, garbage, mtls = wfm.requests
    with pytest.raises(SignatureError) as refused:
        verify(wfm, 0, certs)
    assert refused.value.status == 401
    assert "content-digest" not in no_digest.headers
    assert '"content-digest"' not in no_digest.headers["signature-input"]
    assert "signature" not in unsigned.headers and "content-digest" in unsigned.headers
    assert empty_digest.headers["content-digest"] == ""
    assert '"content-digest"' not in empty_digest.headers["signature-input"]
    assert wrong_digest.headers["content-digest"] == WRONG_DIGEST  # sent and signed as given
    assert '"content-digest"' in wrong_digest.headers["signature-input"]
    assert garbage.headers["content-digest"] == "garbage"
    assert '"content-digest"' not in garbage.headers["signature-input"]
    assert not {"signature", "signature-input", "content-digest"} & set(mtls.headers)


def test_certificates_injected_and_fresh_identities(wfm: RecordingServer, certs: Path) -> None:
    wfm.json("POST /onboarding", 201, {})
    onboard = {"method": "POST", "endpoint": "/onboarding", "expected_status": 201,
               "request_body": {"certificate": CERTIFICATE_PLACEHOLDER}}
    run(wfm, certs, step(**onboard), step(**onboard, skip_certificate_injection=True),
        step(**onboard, fresh_cert=True))
    own, kept, fresh = (json.loads(r.body)["certificate"] for r in wfm.requests)
    assert base64.b64decode(own) == (certs / "device-cert.pem").read_bytes()
    assert kept == CERTIFICATE_PLACEHOLDER
    assert fresh not in (own, kept) and b"BEGIN CERTIFICATE" in base64.b64decode(fresh)
    kid = Rc2Identity.load(certs / "device.key", certs / "device-cert.pem").key.key_id
    assert f'keyid="{kid}"' not in wfm.requests[2].headers["signature-input"]


def test_without_an_rc2_identity_each_scenario_gets_a_fresh_one(wfm: RecordingServer,
                                                                tmp_path: Path) -> None:
    wfm.json("GET /thing", 200, {})
    with Runner(wfm.base, CertDir.load(tmp_path)) as runner:
        for name in ("one", "two"):
            runner.run_scenario({"id": name, "steps": [step(), step()]})
    key_ids = [r.headers["signature-input"].split('keyid="')[1] for r in wfm.requests]
    assert key_ids[0] == key_ids[1] != key_ids[2] == key_ids[3]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_transport_errors(wfm: RecordingServer, certs: Path) -> None:
    wfm.json("GET /thing", 200, {})
    refused = {"expected_status": 0, "expect_transport_error": True}
    with Runner(f"http://127.0.0.1:{_closed_port()}", CertDir.load(certs)) as runner:
        down = runner.run_scenario({"id": "s", "steps": [step(**refused), step()]})
    answered = run(wfm, certs, step(**refused))
    assert down[0].verdict == "PASS" and "refused as expected (ConnectError" in down[0].reason
    assert down[1].verdict == "FAIL" and down[1].reason.startswith("ConnectError")
    assert answered[0].verdict == "FAIL"
    assert answered[0].reason == "the connection was expected to fail, but the WFM answered " \
                                 "HTTP 200"


def test_steps_that_cannot_run_say_why(wfm: RecordingServer, certs: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_REF", raising=False)
    with Runner("https://127.0.0.1:9", CertDir.load(certs)) as runner:
        results = runner.run_scenario({"id": "s", "steps": [
            step(mtls=True), {"id": "o", "oras": {"cmd": "manifest"}}, {"id": "e"}]})
    assert [r.verdict for r in results] == ["FAIL", "SKIP", "FAIL"]
    assert "needs svid-cert.pem and svid-key.pem" in results[0].reason
    assert "REGISTRY_REF" in results[1].reason
    assert results[2].reason == "the step has no endpoint"


def test_a_malformed_step_fails_and_the_run_goes_on(wfm: RecordingServer, certs: Path) -> None:
    wfm.json("GET /thing", 200, {})
    results = run(wfm, certs, step(accepted_statuses=["often"]), step(validations=["x"]),
                  step())
    assert [r.verdict for r in results] == ["FAIL", "FAIL", "PASS"]
    assert results[0].reason.startswith("malformed step: ValueError")
    assert results[1].reason.startswith("malformed step: AttributeError")


def test_mtls_steps_present_the_svid_or_the_refreshed_one(tmp_path: Path) -> None:
    """Over TLS, to a server that asks for (and verifies) client certificates: `mtls`
    presents svid-cert.pem, `svid_source: refreshed` the rotated one, other steps none."""
    lab = make_lab(tmp_path / "pki")
    certs = tmp_path / "certs"
    certs.mkdir()
    current = issue_client_svid(lab.ca, lab.wfm_id, "kit")
    rotated = issue_client_svid(lab.ca, lab.wfm_id, "kit")
    current.write(certs, "svid")
    rotated.write(certs, "svid-refreshed")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(lab.wfm_cert), str(lab.wfm_key))
    tls.load_verify_locations(str(lab.bundle))
    tls.verify_mode = ssl.CERT_OPTIONAL
    with RecordingServer(tls) as server, \
            Runner(server.base, CertDir.load(certs)) as runner:
        server.json("GET /thing", 200, {})
        results = runner.run_scenario({"id": "s", "steps": [
            step(mtls=True), step(mtls=True, svid_source="refreshed"), step()]})
    assert [r.verdict for r in results] == ["PASS"] * 3
    serials = [int(r.peer_serial, 16) if r.peer_serial else None for r in server.requests]
    assert serials == [current.cert.serial_number, rotated.cert.serial_number, None]


def test_a_refreshed_step_without_a_rotated_svid_says_so(wfm: RecordingServer,
                                                         certs: Path) -> None:
    wfm.json("GET /thing", 200, {})
    results = run(wfm, certs, step(mtls=True, svid_source="refreshed"))
    assert results[0].verdict == "PASS"
    assert "the current SVID was presented, as the kit's runner does" in results[0].reason


def test_unusable_cert_dirs_are_refused(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(SuiteError, match="is not a directory"):
        CertDir.load(tmp_path / "missing")
    other = write_rc2_identity(tmp_path / "other")
    (certs / "device-cert.pem").write_bytes(other.certificate_pem)
    with pytest.raises(SuiteError, match="does not hold the public key"):
        CertDir.load(certs)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "svid-cert.pem").write_text("not a certificate")
    (tmp_path / "bad" / "svid-key.pem").write_text("not a key")
    with pytest.raises(SuiteError, match="not a usable certificate and key"):
        CertDir.load(tmp_path / "bad")


def test_suites_and_groups(tmp_path: Path) -> None:
    suite = tmp_path / "kit" / "testcases" / "suite.json"
    suite.parent.mkdir(parents=True)
    suite.write_text(json.dumps([{"id": "a", "steps": [{"id": "a1"}, {"id": "a2"}]},
                                 {"id": "b", "steps": [{"id": "b1"}]}]))
    group = tmp_path / "kit" / "groups" / "picked" / "group.json"
    group.parent.mkdir(parents=True)
    group.write_text(json.dumps({"name": "picked", "testCases": ["a2", "b"]}))
    picked = load_suite(suite, "picked")
    assert picked.name == "picked" and picked.step_count == 2
    assert [[s["id"] for s in sc["steps"]] for sc in picked.scenarios] == [["a2"], ["b1"]]
    assert load_suite(suite).step_count == 3
    with pytest.raises(SuiteError, match="no group 'nope'"):
        load_suite(suite, "nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SuiteError, match="is not JSON"):
        load_suite(tmp_path / "bad.json")
    (tmp_path / "odd.json").write_text('{"steps": []}')
    with pytest.raises(SuiteError, match="neither a scenario list"):
        load_suite(tmp_path / "odd.json")
