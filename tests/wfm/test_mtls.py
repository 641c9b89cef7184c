"""rc.3 MIAF identity: `margo serve` over mutual TLS with SPIFFE X.509-SVIDs, on loopback.

Every certificate is minted at run time (pkikit). The server is the real process; the clients
are httpx (and git) presenting SVIDs. Refusals are checked where they happen: in the TLS
handshake (no certificate, untrusted CA, outside the validity period, TLS 1.2) or as a 401
(not an acceptable SVID) / 403 problem (accepted-client policy).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kits.metricskit import held_polls
from kits.pkikit import (
    Lab,
    client_context,
    issue_client_svid,
    issue_svid,
    issue_wfm_svid,
    make_ca,
    make_lab,
    running_tls_server,
    tls_client,
    write_pem,
)
from kits.serverkit import ROOT, check_response, running_server

from margo import spiffe
from margo_cli.main import main as margo_main
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
NOT_AUTHORIZED = "https://docs.margo.org/specification/problem-types#not-authorized"
CAPS = ROOT / "examples" / "capabilities"
NOW = dt.datetime.now(dt.UTC)


def caps(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / f"{name}.json").read_text())
    return doc


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return make_lab(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """mTLS required, clients site-a and site-b accepted by name, the example fleet."""
    root = tmp_path_factory.mktemp("wfm")
    shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
    site_a, site_b = lab.client("site-a"), lab.client("site-b")
    with running_tls_server(root / "data", lab, "--source", str(root / "fleet"),
                            "--accept-clients", "site-a,site-b", ready=site_a) as base:
        yield {"base": base, "data": root / "data", "site-a": site_a, "site-b": site_b,
               "root": root}


def device(server: dict[str, Any], lab: Lab, name: str) -> httpx.Client:
    cert, key = server[name]
    return tls_client(server["base"], cert, key, lab.bundle,
                      event_hooks={"response": [check_response]})


def refused_in_handshake(base: str, lab: Lab, cert: Path | None, key: Path | None,
                         **context: Any) -> bool:
    """True when the server ends the connection during or right after the handshake (with
    TLS 1.3 the client learns of a refused certificate on its first read)."""
    ctx = client_context(cert, key, lab.bundle)
    for name, value in context.items():
        setattr(ctx, name, value)
    with httpx.Client(base_url=base, verify=ctx, timeout=10) as http:
        try:
            http.get("/api/v1/deployments")
        except httpx.TransportError:
            return True
    return False


def wait_for_deployments(http: httpx.Client, at_least: int) -> dict[str, Any]:
    """The manifest once it lists `at_least` deployments (or the last one after 20 s)."""
    seen: list[dict[str, Any]] = [{}]

    def enough() -> bool:
        seen[0] = http.get("/api/v1/deployments").json()
        return len(seen[0]["deployments"]) >= at_least

    with contextlib.suppress(TimeoutError):
        poll_until("the deployments", enough, timeout=20, interval=0.2)
    return seen[0]


def eventually(check: Any, seconds: float = 10) -> None:
    """Policy decisions are cached for two seconds: wait for a change to show."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


# --- margo.spiffe: the rules both ends share ------------------------------------------------


def test_spiffe_ids_parse_strictly_and_build_the_margo_shapes() -> None:
    parsed = spiffe.parse_spiffe_id("spiffe://factory.test/margo/wfm/w1/client/c-1.a_b~")
    assert (parsed.trust_domain, parsed.segments[-1]) == ("factory.test", "c-1.a_b~")
    assert str(spiffe.wfm_id("factory.test", "w1")) == "spiffe://factory.test/margo/wfm/w1"
    client = spiffe.client_id("factory.test", "w1", "dev")
    assert str(client) == "spiffe://factory.test/margo/wfm/w1/client/dev"
    assert spiffe.client_id_of(client, trust_domain="factory.test", wfm="w1") == "dev"
    for bad in ("spiffe://Factory.test/x", "https://factory.test/x", "spiffe://td/a//b",
                "spiffe://td/a/./b", "spiffe://td/a/../b", "spiffe://td/a%2Fb", "spiffe://td/a/",
                "spiffe://td/a?b", "spiffe://td/a#b", "spiffe:///a", "spiffe://td/" + "a" * 2048):
        with pytest.raises(spiffe.SpiffeIdError):
            spiffe.parse_spiffe_id(bad)
    for other in ("spiffe://other.test/margo/wfm/w1/client/dev",
                  "spiffe://factory.test/margo/wfm/w2/client/dev",
                  "spiffe://factory.test/margo/wfm/w1", "spiffe://factory.test/margo/wfm/w1/"
                  "client/dev/extra", "spiffe://factory.test/margo/WFM/w1/client/dev"):
        with pytest.raises(spiffe.SpiffeIdError):
            spiffe.client_id_of(spiffe.parse_spiffe_id(other), trust_domain="factory.test",
                                wfm="w1")
    with pytest.raises(spiffe.SpiffeIdError):
        spiffe.client_id("factory.test", "w1", "..")


def test_svid_profile_and_validity_checks(lab: Lab) -> None:
    good = issue_client_svid(lab.ca, "wfm-1", "dev").cert
    assert str(spiffe.svid_spiffe_id(good)).endswith("/client/dev")
    refusals = {
        "cA=true": issue_client_svid(lab.ca, "wfm-1", "dev", ca_flag=True).cert,
        "keyCertSign": issue_client_svid(lab.ca, "wfm-1", "dev", key_cert_sign=True).cert,
        "exactly one URI SAN": issue_client_svid(
            lab.ca, "wfm-1", "dev", extra_uris=["spiffe://factory.test/other"]).cert,
        "has 0": issue_svid(lab.ca, None, dns_names=["dev.factory.test"]).cert,
        "not a spiffe": issue_svid(lab.ca, "https://factory.test/margo").cert,
    }
    for reason, cert in refusals.items():
        with pytest.raises(spiffe.SvidError, match=reason):
            spiffe.svid_spiffe_id(cert)
    with pytest.raises(spiffe.SvidError, match="expired"):
        spiffe.check_validity(good, NOW + dt.timedelta(days=30))
    with pytest.raises(spiffe.SvidError, match="not valid before"):
        spiffe.check_validity(good, NOW - dt.timedelta(days=1))
    spiffe.check_validity(good)


def test_forwarded_chains_verify_through_intermediates_only_to_the_bundle(lab: Lab) -> None:
    intermediate = make_ca("factory.test", parent=lab.ca)
    svid = issue_client_svid(intermediate, "wfm-1", "dev")
    assert spiffe.verify_svid_chain(svid.cert, svid.intermediates, [lab.ca.cert]).path.endswith(
        "/client/dev")
    with pytest.raises(spiffe.SvidError, match="does not verify"):
        spiffe.verify_svid_chain(svid.cert, [], [lab.ca.cert])  # intermediate withheld
    stranger = issue_client_svid(make_ca("factory.test"), "wfm-1", "dev")
    with pytest.raises(spiffe.SvidError, match="does not verify"):
        spiffe.verify_svid_chain(stranger.cert, [], [lab.ca.cert])
    with pytest.raises(spiffe.SvidError, match="no trust anchors"):
        spiffe.verify_svid_chain(svid.cert, svid.intermediates, [])


def test_trust_bundles_in_pem_and_spiffe_jwk_form(lab: Lab, tmp_path: Path) -> None:
    der = lab.ca.cert.public_bytes(serialization.Encoding.DER)
    jwks = {"spiffe_sequence": 3, "spiffe_refresh_hint": 300, "keys": [
        {"use": "x509-svid", "kty": "EC", "crv": "P-256", "x5c": [base64.b64encode(der).decode()]},
        {"use": "jwt-svid", "kty": "EC", "kid": "ignored"}]}
    (tmp_path / "bundle.json").write_text(json.dumps(jwks))
    assert spiffe.load_trust_bundle(tmp_path / "bundle.json") == [lab.ca.cert]
    assert spiffe.load_trust_bundle(lab.bundle) == [lab.ca.cert]
    for bad in (b"", b"{}", b'{"keys": []}', b'{"keys": [{"use": "jwt-svid"}]}', b"junk",
                b'{"keys": [{"use": "x509-svid", "x5c": ["bm90IGRlcg=="]}]}'):
        with pytest.raises(spiffe.TrustBundleError):
            spiffe.parse_trust_bundle(bad)
    with pytest.raises(spiffe.TrustBundleError):
        spiffe.load_trust_bundle(tmp_path / "missing.pem")


# --- the server ------------------------------------------------------------------------------


def test_a_valid_client_svid_is_accepted_and_served_its_own_state(server: dict[str, Any],
                                                                   lab: Lab) -> None:
    with device(server, lab, "site-a") as http:
        assert http.put("/api/v1/capabilities/k8s-cluster-gpu",
                        json=caps("k8s-cluster-gpu")).status_code in (200, 201)
        manifest = wait_for_deployments(http, at_least=3)
        response = http.get("/api/v1/deployments", headers={"Accept": MANIFEST})
        assert response.status_code == 200
        assert response.headers["content-type"] == MANIFEST
        assert http.get(manifest["deployments"][0]["url"]).status_code == 200
        assert http.get(manifest["bundle"]["url"]).status_code == 200


def test_the_server_presents_its_wfm_svid_over_tls13_only(server: dict[str, Any],
                                                          lab: Lab) -> None:
    host, port = server["base"].removeprefix("https://").split(":")
    context = client_context(*server["site-a"], lab.bundle)
    with socket.create_connection((host, int(port))) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        assert tls.version() == "TLSv1.3"
        presented = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    assert spiffe.svid_spiffe_id(presented) == spiffe.wfm_id(lab.trust_domain, lab.wfm_id)
    assert refused_in_handshake(server["base"], lab, *server["site-a"],
                                maximum_version=ssl.TLSVersion.TLSv1_2)


def test_certificates_the_handshake_refuses(server: dict[str, Any], lab: Lab) -> None:
    base = server["base"]
    assert refused_in_handshake(base, lab, None, None)  # no client certificate at all
    assert refused_in_handshake(base, lab, *lab.client(
        "site-a", "expired", not_before=NOW - dt.timedelta(days=2),
        not_after=NOW - dt.timedelta(minutes=1)))
    assert refused_in_handshake(base, lab, *lab.client(
        "site-a", "not-yet", not_before=NOW + dt.timedelta(hours=1)))
    assert refused_in_handshake(base, lab, *lab.client(
        "site-a", "untrusted", ca=make_ca(lab.trust_domain)))
    assert not refused_in_handshake(base, lab, *server["site-a"])


def test_svids_of_the_wrong_shape_get_401(server: dict[str, Any], lab: Lab) -> None:
    td = lab.trust_domain
    wrong = {
        "trust domain": issue_svid(lab.ca, "spiffe://other.test/margo/wfm/wfm-1/client/site-a"),
        "names WFM": issue_client_svid(lab.ca, "wfm-2", "site-a"),
        "cA=true": issue_client_svid(lab.ca, "wfm-1", "site-a", ca_flag=True),
        "exactly one URI SAN": issue_client_svid(lab.ca, "wfm-1", "site-a",
                                                 extra_uris=[f"spiffe://{td}/x"]),
        "not a Margo client ID": issue_svid(lab.ca, f"spiffe://{td}/margo/wfm/wfm-1"),
        "not a spiffe": issue_svid(lab.ca, f"https://{td}/margo/wfm/wfm-1/client/site-a"),
    }
    for reason, svid in wrong.items():
        cert, key = svid.write(lab.directory, "wrong")
        with tls_client(server["base"], cert, key, lab.bundle) as http:
            response = http.get("/api/v1/deployments")
        assert response.status_code == 401, reason
        assert reason in response.json()["detail"]
        assert response.headers["content-type"] == "application/problem+json"


def test_the_accepted_client_policy(server: dict[str, Any], lab: Lab,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    stranger = lab.client("stranger")
    with tls_client(server["base"], *stranger, lab.bundle) as http:
        refused = http.get("/api/v1/deployments")
        assert refused.status_code == 403
        assert refused.json()["type"] == NOT_AUTHORIZED
        check_response(refused)
        # The operator registers it (same data directory, server running): accepted.
        assert margo_main(["clients", "import", "stranger", "--cert", str(stranger[0]),
                           "--data", str(server["data"])]) == 0
        eventually(lambda: http.get("/api/v1/deployments").status_code == 200)
        # Retired: refused again whatever proves it, with the Margo problem type.
        assert margo_main(["clients", "retire", "stranger", "--data", str(server["data"])]) == 0
        eventually(lambda: http.get("/api/v1/deployments").status_code == 403)
        problem = http.get("/api/v1/deployments").json()
        assert "retired" in problem["detail"]
        assert problem["title"] == "Client Relationship Retired"
        assert problem["type"].endswith("#not-authorized")
    capsys.readouterr()


def test_a_retired_clients_held_poll_is_refused(server: dict[str, Any], lab: Lab,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A waiting poll (issue 34) over mutual TLS, held, then its client retired beside the
    server: refused within seconds (403), not held to the end of its wait. Its SVID was
    accepted once, on a connection that stays open, and the policy's decision is cached:
    the server reads the client afresh (`wfm.http.callers.Callers.readmit`)."""
    held_one = lab.client("held-one")
    assert margo_main(["clients", "import", "held-one", "--cert", str(held_one[0]),
                       "--data", str(server["data"])]) == 0
    with tls_client(server["base"], *held_one, lab.bundle) as http:
        eventually(lambda: http.get("/api/v1/deployments").status_code == 200)
        etag = http.get("/api/v1/deployments").headers["etag"]
        answered: list[tuple[httpx.Response, float]] = []
        thread = threading.Thread(target=lambda: answered.append((http.get(
            "/api/v1/deployments", headers={"If-None-Match": etag, "Prefer": "wait=50"},
            timeout=70), time.monotonic())), daemon=True)
        thread.start()
        with device(server, lab, "site-a") as observer:
            poll_until("the poll held", lambda: held_polls(observer) >= 1)
        assert margo_main(["clients", "retire", "held-one", "--data",
                           str(server["data"])]) == 0
        retired_at = time.monotonic()
        thread.join(timeout=60)
    [(response, at)] = answered
    assert response.status_code == 403 and response.json()["type"] == NOT_AUTHORIZED
    assert at - retired_at < 10, f"refused {at - retired_at:.1f} s after the retirement"
    capsys.readouterr()


def test_a_rotated_client_svid_is_accepted_without_reregistration(server: dict[str, Any],
                                                                    lab: Lab) -> None:
    refreshed = lab.client("site-b", "site-b-refreshed", key_type="ec-p384")
    with tls_client(server["base"], *refreshed, lab.bundle) as http:
        assert http.get("/api/v1/deployments").status_code == 200


def test_one_client_never_reaches_another_clients_state(server: dict[str, Any], lab: Lab,
                                                        tmp_path: Path) -> None:
    with device(server, lab, "site-a") as http:
        http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        manifest = wait_for_deployments(http, at_least=3)
    ref = manifest["deployments"][0]
    report = {"deploymentId": ref["deploymentId"], "adoptedManifestVersion": 1,
              "status": {"state": "installed"}, "components": [{"name": "x",
                                                                "state": "installed"}]}
    with device(server, lab, "site-b") as other:
        theirs = other.get("/api/v1/deployments").json()
        assert all(d["deploymentId"] != ref["deploymentId"] for d in theirs["deployments"])
        assert other.get(ref["url"]).status_code == 404
        assert other.get(manifest["bundle"]["url"]).status_code == 404
        status = other.post(f"/api/v1/deployments/{ref['deploymentId']}/status", json=report)
        assert status.status_code == 422
        taken = other.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps("k8s-cluster-gpu"))
        assert taken.status_code == 403
        assert other.delete("/api/v1/capabilities/k8s-cluster-gpu").status_code == 404
        # rc.2 paths name a client: only one's own.
        assert other.get("/api/v1/clients/site-a/deployments").status_code == 403
    git = _git_with_svid(server, lab, tmp_path)
    url = f"{server['base']}/git/devices/k8s-cluster-gpu.git"
    assert git("site-a", "ls-remote", url).returncode == 0
    denied = git("site-b", "ls-remote", url)
    assert denied.returncode != 0


def _git_with_svid(server: dict[str, Any], lab: Lab, home: Path) -> Any:
    env = {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": str(home)}

    def git(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        cert, key = server[name]
        return subprocess.run(
            ["git", "-c", f"http.sslCert={cert}", "-c", f"http.sslKey={key}",
             "-c", f"http.sslCAInfo={lab.bundle}", *args],
            capture_output=True, text=True, env=env, check=False, timeout=60)

    return git


def test_optional_client_certificates_and_tokens(lab: Lab, tmp_path: Path) -> None:
    """`--client-cert optional`: the handshake admits anyone, the rc.3 API still needs an
    SVID; bearer tokens are off with TLS unless turned on."""
    data = tmp_path / "data"
    assert margo_main(["clients", "add", "dev", "--data", str(data), "--json"]) == 0
    with running_tls_server(data, lab, "--client-cert", "optional",
                            "--accept-clients", "*") as base:
        with tls_client(base, None, None, lab.bundle) as anonymous:
            assert anonymous.get("/healthz").status_code == 200
            assert anonymous.get("/api/v1/deployments").status_code == 401
            assert anonymous.get("/api/v1/onboarding/certificate").status_code == 200
            token = anonymous.get("/api/v1/deployments",
                                  headers={"Authorization": "Bearer anything"})
            assert token.status_code == 401
        with tls_client(base, *lab.client("anyone"), lab.bundle) as http:
            assert http.get("/api/v1/deployments").status_code == 200  # namespace policy


def test_client_cert_header_only_from_a_configured_proxy(lab: Lab, tmp_path: Path) -> None:
    """Plain HTTP behind a TLS-terminating proxy at 127.0.0.2: its RFC 9440 Client-Cert is
    verified against the bundle; the same header from 127.0.0.1 is stripped."""
    intermediate = make_ca(lab.trust_domain, parent=lab.ca)
    svid = issue_client_svid(intermediate, lab.wfm_id, "proxied")
    chain = ", ".join(":" + base64.b64encode(c.public_bytes(serialization.Encoding.DER))
                      .decode() + ":" for c in svid.intermediates)
    header = {"Client-Cert": _sf_binary(svid.cert), "Client-Cert-Chain": chain}
    stranger = issue_client_svid(make_ca(lab.trust_domain), lab.wfm_id, "proxied")
    with running_server(tmp_path / "data", "--trust-bundle", str(lab.bundle), "--trust-domain",
                        lab.trust_domain, "--wfm-id", lab.wfm_id, "--accept-clients", "*",
                        "--trusted-proxy", "127.0.0.2", "--bearer-tokens", "off") as base:
        via_proxy = httpx.Client(base_url=base, timeout=10, transport=httpx.HTTPTransport(
            local_address="127.0.0.2"))
        direct = httpx.Client(base_url=base, timeout=10)
        with via_proxy, direct:
            assert via_proxy.get("/api/v1/deployments", headers=header).status_code == 200
            assert direct.get("/api/v1/deployments", headers=header).status_code == 401
            untrusted = via_proxy.get("/api/v1/deployments",
                                      headers={"Client-Cert": _sf_binary(stranger.cert)})
            assert untrusted.status_code == 401
            assert "does not verify" in untrusted.json()["detail"]
            withheld = via_proxy.get("/api/v1/deployments",
                                     headers={"Client-Cert": _sf_binary(svid.cert)})
            assert withheld.status_code == 401  # the intermediate is needed
            garbled = via_proxy.get("/api/v1/deployments", headers={"Client-Cert": "abc"})
            assert garbled.status_code == 401


def _sf_binary(cert: x509.Certificate) -> str:
    return ":" + base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode() + ":"


def test_trust_bundle_and_wfm_svid_rotate_without_restart(lab: Lab, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    bundle = tmp_path / "active-bundle.pem"
    shutil.copy(lab.bundle, bundle)
    successor = make_ca(lab.trust_domain)
    old_client, new_client = lab.client("dev"), lab.client("dev", "dev-new", ca=successor)
    both = write_pem(tmp_path / "both.pem", lab.ca.cert, successor.cert)
    only_new = write_pem(tmp_path / "new.pem", successor.cert)
    rotated = Lab(lab.directory, lab.ca, lab.wfm_id, lab.wfm, both, lab.wfm_cert, lab.wfm_key)
    with running_tls_server(tmp_path / "data", lab, "--trust-bundle", str(bundle),
                            "--accept-clients", "dev", ready=old_client) as base:
        assert refused_in_handshake(base, rotated, *new_client)
        rotate = ["trust", "rotate", "--target", str(bundle), "--data", str(tmp_path / "data")]
        assert margo_main([*rotate, "--bundle", str(only_new)]) == 0
        assert not refused_in_handshake(base, rotated, *new_client)
        assert refused_in_handshake(base, rotated, *old_client)  # replaced, not merged
        # A broken file written behind the tool's back keeps the last good anchors.
        bundle.write_text("not a bundle")
        assert not refused_in_handshake(base, rotated, *new_client)
        # The WFM's own SVID rotates too: new handshakes present the new certificate.
        fresh = issue_wfm_svid(lab.ca, lab.wfm_id)
        write_pem(lab.wfm_key.with_suffix(".next"), fresh.key)
        write_pem(lab.wfm_cert.with_suffix(".next"), fresh.cert)
        lab.wfm_key.with_suffix(".next").replace(lab.wfm_key)
        lab.wfm_cert.with_suffix(".next").replace(lab.wfm_cert)
        host, port = base.removeprefix("https://").split(":")
        context = client_context(*new_client, both)
        with socket.create_connection((host, int(port))) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            served = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
        assert served.serial_number == fresh.cert.serial_number
    capsys.readouterr()


def test_tls12_only_when_enabled(lab: Lab, tmp_path: Path) -> None:
    good = lab.client("dev")
    with running_tls_server(tmp_path / "data", lab, "--tls12", "--accept-clients", "dev",
                            ready=good) as base:
        context = client_context(*good, lab.bundle)
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        with httpx.Client(base_url=base, verify=context, timeout=10) as http:
            assert http.get("/api/v1/deployments").status_code == 200


def test_serve_refuses_inconsistent_identity_options(lab: Lab, tmp_path: Path) -> None:
    cases = {
        ("--tls-cert", str(lab.wfm_cert)): "go together",
        (*lab.serve_args(), "--wfm-id", "someone-else"): "not spiffe://",
        (*lab.serve_args(), "--trust-domain", "other.test"): "not spiffe://",
        ("--accept-clients", "*"): "need --trust-domain",
        ("--trust-domain", "t.test", "--wfm-id", "w", "--trusted-proxy", "10.0.0.1"):
            "needs --trust-bundle",
        ("--signature-window", "0"): "must be positive",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as refused:
            margo_main(["serve", "--port", "1", "--data", str(tmp_path / "never"), *args])
        assert message in str(refused.value.code), (args, refused.value.code)
    assert not (tmp_path / "never").exists()
