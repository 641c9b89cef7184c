"""The official conformance kit's rc.3 (MIAF) suites against a real `margo serve` over real
mutual TLS, run by our product runner (`margo conformance wfm` / `conformance.runner`).

The gate (kit README sections 2.5 and 9): every step of the newest suite (A1, 29 steps: 19
HTTP, 10 registry) passes, including tb-2 (a handshake without a client certificate must
fail) and svid-refresh (a rotated SVID is accepted), and so does every step of the separate
header-integrity and multi-component files. The PKI is generated at run time (`pkikit`), so
no kit certificate date can break the suite; the kit's own placeholder certificates are
used in one extra test, skipped once they are out of their validity window.

Each suite file runs against its own server, as one client, as the kit runs it: the
multi-component device belongs to the first client that reports it, and header-integrity
checks that a client's first manifest has manifestVersion 1. The multi-component scenario
polls until an operator assigns its deployment; here the fleet source assigns it up front.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.conformancekit import (
    A1_SUITE,
    HEADER_INTEGRITY,
    KIT_MIAF,
    MULTI_COMPONENT,
    fleet_source,
    margo,
    report_line,
    running_wfm,
    valid_now,
)
from kits.pkikit import Lab, issue_client_svid, make_ca, make_lab

from conformance.runner import CertDir, Runner, RunnerOptions, load_suite

TRUST_DOMAIN, WFM_ID, CLIENT = "margo-ctt.test", "margo-ctt-test-wfm", "margo-ctt-test-device"
FAST_POLL = RunnerOptions(poll_interval=0.2)
# What the kit asks an operator to do while the multi-component scenario polls.
MULTI_COMPONENT_ASSIGNMENT = {"cts-multi-component": "multi-component-test-device"}


def kit_cert_dir(lab: Lab, directory: Path, client: str = CLIENT) -> Path:
    """The kit's MIAF layout: the SVID, its CA, and a rotated SVID for the same client."""
    issue_client_svid(lab.ca, lab.wfm_id, client).write(directory, "svid")
    issue_client_svid(lab.ca, lab.wfm_id, client).write(directory, "svid-refreshed")
    shutil.copyfile(lab.bundle, directory / "svid-ca.pem")
    return directory


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return make_lab(tmp_path_factory.mktemp("pki"), TRUST_DOMAIN, WFM_ID)


@pytest.fixture
def mtls_wfm(lab: Lab, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A fresh `margo serve` requiring client certificates, the kit's client accepted, the
    multi-component application assigned to the kit's device; and a cert dir for it."""
    certs = kit_cert_dir(lab, tmp_path / "certs")
    source = fleet_source(tmp_path / "fleet", MULTI_COMPONENT_ASSIGNMENT)
    with running_wfm(tmp_path / "data", *lab.serve_args("--source", str(source),
                                                        "--accept-clients", CLIENT),
                     probe=(certs / "svid-cert.pem", certs / "svid-key.pem")) as base:
        yield base, certs


def test_newest_rc3_suite_passes_over_mutual_tls(mtls_wfm: tuple[str, Path],
                                                 package_ref: str) -> None:
    """A1 through the shipped command, exactly as a vendor runs it; the 10 registry steps
    read the kit's package from the local registry."""
    base, certs = mtls_wfm
    run = margo("conformance", "wfm", "--base-url", base, "--suite", str(A1_SUITE),
                "--cert-dir", str(certs), "--registry-ref", package_ref, "--poll-interval",
                "0.2", check=False)
    lines = run.stdout.splitlines()
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [line for line in lines if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert len(steps) == 29 and all(line.startswith("PASS ") for line in steps)
    assert "wfm-identity-trust-bundle/wfm-identity-tb-2: the connection was refused" in run.stdout
    assert lines[-1] == "wfm-supplier.json: 29 steps run, 29 passed, 0 failed, 0 skipped"
    print(f"conformance kit A1 (rc.3, mTLS): {lines[-1]}")


@pytest.mark.parametrize("suite", [HEADER_INTEGRITY, MULTI_COMPONENT], ids=lambda p: p.stem)
def test_older_rc3_files_pass_over_mutual_tls(mtls_wfm: tuple[str, Path], suite: Path) -> None:
    base, certs = mtls_wfm
    with Runner(base, CertDir.load(certs), FAST_POLL) as runner:
        report = runner.run_suite(load_suite(suite))
    report_line(report, f"{suite.stem} (rc.3, mTLS)")
    assert report.passed, [r.line() for r in report.results if r.verdict != "PASS"]
    assert len(report.results) == {"header-integrity": 2, "multi-component-deployment": 4}[
        suite.stem]
    if suite == MULTI_COMPONENT:  # the YAML checked was the assigned one, not a fallback id
        assert report.results[2].endpoint.startswith("/api/v1/deployments/")
        assert "deployment-none" not in report.results[2].endpoint


def test_a_wfm_without_client_certificates_fails_tb2_and_only_tb2(lab: Lab,
                                                                  tmp_path: Path) -> None:
    """The transport check can fail: a server that lets a certificate-less handshake in
    (`--client-cert optional`) answers tb-2 with a 401 instead of refusing the connection."""
    certs = kit_cert_dir(lab, tmp_path / "certs")
    scenario = next(s for s in load_suite(A1_SUITE).scenarios
                    if s["id"] == "wfm-identity-trust-bundle")
    with running_wfm(tmp_path / "data", *lab.serve_args("--accept-clients", CLIENT,
                                                        "--client-cert", "optional")) as base, \
            Runner(base, CertDir.load(certs), FAST_POLL) as runner:
        results = runner.run_scenario(scenario)
    verdicts = {r.step: (r.verdict, r.reason) for r in results}
    assert verdicts["wfm-identity-tb-1"][0] == "PASS"
    assert verdicts["wfm-identity-tb-2"][0] == "FAIL"
    assert "answered HTTP 401" in verdicts["wfm-identity-tb-2"][1]


def test_a_rotated_svid_from_another_trust_domain_fails_svid_refresh(lab: Lab,
                                                                     tmp_path: Path) -> None:
    """svid-2 presents the refreshed SVID, not the current one: one minted by a CA the WFM
    does not trust makes exactly that step fail."""
    certs = kit_cert_dir(lab, tmp_path / "certs")
    stranger = make_ca(TRUST_DOMAIN, name="an untrusted CA")
    issue_client_svid(stranger, WFM_ID, CLIENT).write(certs, "svid-refreshed")
    scenario = next(s for s in load_suite(A1_SUITE).scenarios
                    if s["id"] == "wfm-identity-svid-refresh")
    with running_wfm(tmp_path / "data", *lab.serve_args("--accept-clients", CLIENT),
                     probe=(certs / "svid-cert.pem", certs / "svid-key.pem")) as base, \
            Runner(base, CertDir.load(certs), FAST_POLL) as runner:
        results = runner.run_scenario(scenario)
    assert [r.verdict for r in results] == ["PASS", "FAIL"], [r.line() for r in results]
    assert results[1].actual == 0  # the handshake itself was refused


def test_the_suite_with_the_kits_own_certificates(tmp_path: Path) -> None:
    """The kit's placeholder MIAF identities (CA, WFM SVID, client SVID) against our server,
    as its README describes: trust ca.pem, serve wfm-svid-cert.pem, accept the client."""
    files = [KIT_MIAF / n for n in ("ca.pem", "wfm-svid-cert.pem", "client-svid-cert.pem")]
    if not all(f.exists() for f in files):
        pytest.skip(f"the kit's certificates are not at {KIT_MIAF}")
    expired = valid_now(*files)
    if expired:
        pytest.skip(expired)
    certs = tmp_path / "certs"
    certs.mkdir()
    shutil.copyfile(KIT_MIAF / "client-svid-cert.pem", certs / "svid-cert.pem")
    shutil.copyfile(KIT_MIAF / "client-svid-key.pem", certs / "svid-key.pem")
    shutil.copyfile(KIT_MIAF / "ca.pem", certs / "svid-ca.pem")
    source = fleet_source(tmp_path / "fleet", MULTI_COMPONENT_ASSIGNMENT)
    with running_wfm(tmp_path / "data", "--tls-cert", str(KIT_MIAF / "wfm-svid-cert.pem"),
                     "--tls-key", str(KIT_MIAF / "wfm-svid-key.pem"), "--trust-bundle",
                     str(KIT_MIAF / "ca.pem"), "--accept-clients", CLIENT, "--source",
                     str(source), probe=(certs / "svid-cert.pem", certs / "svid-key.pem")) as base:
        run = margo("conformance", "wfm", "--base-url", base, "--suite", str(A1_SUITE),
                    "--cert-dir", str(certs), "--poll-interval", "0.2", "--json", check=False)
    report = json.loads(run.stdout)
    failed = [r for r in report["results"] if r["verdict"] == "FAIL"]
    skipped = {r["step"] for r in report["results"] if r["verdict"] == "SKIP"}
    assert not failed, failed
    assert len(skipped) == 10 and all(s.startswith("ar-") for s in skipped)  # no registry here
    assert report["summary"]["passed"] == 19
    print(f"conformance kit A1 with the kit's certificates: {report['summary']}")
