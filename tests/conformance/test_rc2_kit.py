"""The kit's rc.2 core group (B1: the core Postman collection, 31 response examples turned
into signed steps with derived negative cases) against a real `margo serve`: TLS, bearer
tokens off, onboarding closed, the device's key imported by the operator beforehand (so the
"fresh certificate is rejected" step can pass while the device's own onboarding succeeds).

Three of the 31 derived steps cannot pass against a correct WFM, whatever it does, because
the kit derives them as the *same valid request* as a success step while expecting an
error; which three depends only on whether the client has a deployment:

* with one, "bundle 400 Invalid request", "bundle 404" and "deployment YAML 404" re-fetch
  the bundle and YAML the manifest just named (200);
* without one, "bundle 304" sends `If-None-Match: *` for the all-zero fallback digest (404
  is right: no such bundle), "bundle 400" gets 404 for the same reason, and the status
  report for the fallback deployment id gets our 422 (the rc.2 and rc.3 OpenAPI documents
  list 422, not 404, for a semantic error; the kit accepts only 200/400/404).

The tests assert exactly those verdicts, so any other step failing fails the test.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.conformancekit import (
    B1_COLLECTION,
    fleet_source,
    margo,
    report_line,
    running_wfm,
    write_rc2_identity,
)
from kits.pkikit import Lab, client_context, make_lab

from conformance.postman import DEVICE_CAPABILITIES_BODY
from conformance.runner import CertDir, Rc2Identity, Runner, load_suite
from reconciler.signing import SigningAuth
from tools.polling import poll_until

DEVICE = "kit-rc2-device"
# Response-example ids of the core collection (see the module docstring).
BUNDLE_304, BUNDLE_400, BUNDLE_404 = ("5755e4a7-8329-4ceb-b210-8c41e6423569",
                                      "a7d2c754-66c3-4e45-aecb-987e481d9343",
                                      "80315591-d033-4c57-8d63-9979889e6317")
YAML_404 = "e0358da8-3b31-4278-af5f-84d5e347bacd"
STATUS_200 = "6283ddb7-ae5b-4602-ae16-fa7b3aff0bc0"
ONBOARDING_ITEM, ONBOARDING_403 = ("0dd06053-e16c-419a-a533-f8cddb42471a",
                                   "e89bca4b-f257-434a-8397-d604c2b42eb8")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return make_lab(tmp_path_factory.mktemp("pki"))


def rc2_wfm(lab: Lab, root: Path, *, assign: bool,
            onboarding: str = "closed") -> tuple[Path, Rc2Identity, list[str]]:
    """A cert dir with the device identity, the key imported as client DEVICE, and the
    `margo serve` options: TLS without client certificates, no bearer tokens."""
    certs = root / "certs"
    identity = write_rc2_identity(certs)
    margo("clients", "import", DEVICE, "--cert", str(certs / "device-cert.pem"), "--data",
          str(root / "data"))
    source = fleet_source(root / "fleet", {"kit-rc2": DEVICE} if assign else {})
    args = lab.serve_args("--client-cert", "optional", "--bearer-tokens", "off",
                          "--onboarding", onboarding, "--source", str(source))
    return certs, identity, args


def assign_deployment(base: str, lab: Lab, identity: Rc2Identity) -> dict[str, Any]:
    """The precondition the collection needs for its deployment steps: the device has
    reported (signed) and the operator's assignment has reached its manifest."""
    body = copy.deepcopy(DEVICE_CAPABILITIES_BODY)
    body["properties"]["id"] = DEVICE
    with httpx.Client(base_url=base, verify=client_context(None, None, lab.bundle),
                      auth=SigningAuth(identity.key), timeout=10) as http:
        assert http.post(f"/api/v1/clients/{DEVICE}/capabilities",
                         json=body).status_code == 201
        def assigned() -> dict[str, Any] | None:
            manifest: dict[str, Any] = http.get(f"/api/v1/clients/{DEVICE}/deployments").json()
            return manifest if manifest["deployments"] else None

        return poll_until("the deployment assigned", assigned, timeout=20)


@pytest.fixture
def wfm_with_deployment(lab: Lab, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    certs, identity, args = rc2_wfm(lab, tmp_path, assign=True)
    with running_wfm(tmp_path / "data", *args) as base:
        assign_deployment(base, lab, identity)
        yield base, certs


def run_b1(base: str, certs: Path) -> dict[str, tuple[str, int]]:
    """The core group through the runner: step id -> (verdict, HTTP status)."""
    with Runner(base, CertDir.load(certs)) as runner:
        report = runner.run_suite(load_suite(B1_COLLECTION, "core"))
    report_line(report, "B1 (rc.2 core group, signed)")
    assert len(report.results) == 31
    return {r.step: (r.verdict, r.actual) for r in report.results}


def failures(results: dict[str, tuple[str, int]]) -> dict[str, int]:
    return {step: actual for step, (verdict, actual) in results.items() if verdict == "FAIL"}


def test_rc2_core_group_with_a_deployment(wfm_with_deployment: tuple[str, Path]) -> None:
    results = run_b1(*wfm_with_deployment)
    assert failures(results) == {BUNDLE_400: 200, BUNDLE_404: 200, YAML_404: 200}, results
    # What the deployment made meaningful: a real status report, bundle and YAML.
    assert results[STATUS_200] == ("PASS", 200)
    assert results[BUNDLE_304] == ("PASS", 304)
    assert results["36fdd629-6c79-4991-86a2-49be8dbcf96f"] == ("PASS", 200)  # YAML
    # The negative knobs each drew the documented error from the real verifier.
    assert results["5fc47546-2c1a-4956-9b6a-cfdfb31b88f6"] == ("PASS", 401)  # tampered
    assert results["f206fb46-f592-45ea-a6f1-6569371ee515"] == ("PASS", 400)  # no digest
    assert results["066c0155-a489-428e-9535-dabb36c7aaf6"] == ("PASS", 401)  # fresh key
    assert results[ONBOARDING_403] == ("PASS", 403)


def test_rc2_core_group_without_deployments(lab: Lab, tmp_path: Path) -> None:
    certs, _, args = rc2_wfm(lab, tmp_path, assign=False)
    with running_wfm(tmp_path / "data", *args) as base:
        results = run_b1(base, certs)
    assert failures(results) == {STATUS_200: 422, BUNDLE_304: 404, BUNDLE_400: 404}, results


def test_open_onboarding_fails_the_rejected_certificate_step(lab: Lab, tmp_path: Path) -> None:
    """A WFM that onboards any certificate fails "client rejected" (the runner's fresh,
    never-imported key gets 201); a group naming just that item runs only its examples."""
    certs, _, args = rc2_wfm(lab, tmp_path, assign=False, onboarding="open")
    group = tmp_path / "onboarding.group.json"
    group.write_text(json.dumps({"name": "onboarding", "testCases": [ONBOARDING_ITEM]}))
    with running_wfm(tmp_path / "data", *args) as base, \
            Runner(base, CertDir.load(certs)) as runner:
        report = runner.run_suite(load_suite(B1_COLLECTION, str(group)))
    verdicts = {r.step: (r.verdict, r.actual) for r in report.results}
    assert verdicts == {"0b95ee4e-dc64-4119-b07e-69c3342da26a": ("PASS", 201),
                        "f9e10c20-8474-47ec-81c0-fc7c0823891d": ("PASS", 400),
                        ONBOARDING_403: ("FAIL", 201)}
