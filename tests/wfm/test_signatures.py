"""rc.2 identity: certificate onboarding, then RFC 9421 signed requests with Content-Digest,
against a real `margo serve` on loopback (bearer tokens off, so a signature is the only way in).

Requests are signed with `http-message-signatures` the way the conformance kit signs them
(label sig1; "@method" "@target-uri" "@authority" "content-digest"; created; keyid = hex
SHA-256 of the SPKI; no alg), and once by hand from the README's description of the kit, so
the server is not merely checked against the library it uses.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from http_message_signatures import HTTPMessageSigner
from http_message_signatures.resolvers import MappingKeyResolver
from kits.metricskit import held_polls, renewals
from kits.pkikit import (
    PrivateKey,
    make_lab,
    make_self_signed,
    running_tls_server,
    tls_client,
    write_pem,
)
from kits.serverkit import ROOT, check_response, running_server

from margo.rfc9421 import ALGORITHMS, key_id
from margo_cli.main import main as margo_main
from tools.polling import poll_until

ONBOARDING = {"apiVersion": "onboarding.margo.org/v1alpha1", "kind": "OnboardingRequest"}
KEY_TYPES = {"ecdsa-p256-sha256": "ec-p256", "ecdsa-p384-sha384": "ec-p384",
             "rsa-v1_5-sha256": "rsa-2048", "rsa-pss-sha256": "rsa-2048"}
KIT_COMPONENTS = ("@method", "@target-uri", "@authority")
NOW = dt.datetime.now(dt.UTC)


class Device:
    """An rc.2 device: a key, its self-signed certificate, and (once onboarded) a client id."""

    def __init__(self, algorithm: str = "ecdsa-p256-sha256", **cert: Any):
        self.algorithm = algorithm
        self.key: PrivateKey
        self.key, self.cert = make_self_signed(KEY_TYPES[algorithm], **cert)
        self.kid = key_id(self.key.public_key())
        self.client_id = ""

    @property
    def certificate(self) -> str:
        """As the kit sends it: base64 of the PEM."""
        return base64.b64encode(self.cert.public_bytes(serialization.Encoding.PEM)).decode()

    def onboard(self, http: httpx.Client) -> httpx.Response:
        response = http.post("/api/v1/onboarding", json={**ONBOARDING,
                                                          "certificate": self.certificate})
        if response.status_code == 201:
            self.client_id = response.json()["clientId"]
        return response

    def request(self, http: httpx.Client, method: str, path: str, body: Any = None, *,
                created: dt.datetime | None = None,
                components: tuple[str, ...] = KIT_COMPONENTS,
                sign_as: Device | None = None) -> httpx.Request:
        content = json.dumps(body).encode() if body is not None else None
        request = http.build_request(method, path, content=content, headers={
            "Content-Type": "application/json"} if content else {})
        signer_device = sign_as or self
        signer = HTTPMessageSigner(
            signature_algorithm=ALGORITHMS[self.algorithm],
            key_resolver=MappingKeyResolver(public_keys={},
                                            private_keys={self.kid: signer_device.key}))
        signer.sign(request, key_id=self.kid, label="sig1", include_alg=False,
                    created=created, covered_component_ids=components, body=content)
        return request

    def send(self, http: httpx.Client, method: str, path: str, body: Any = None,
             **options: Any) -> httpx.Response:
        return http.send(self.request(http, method, path, body, **options))

    @property
    def rc2(self) -> str:
        return f"/api/v1/clients/{self.client_id}"


def caps(device_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        (ROOT / "examples" / "capabilities" / "compose-box-amd64.json").read_text())
    doc = copy.deepcopy(doc)
    doc["properties"]["id"] = device_id
    return doc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("wfm")
    shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
    with running_server(root / "data", "--source", str(root / "fleet"),
                        "--bearer-tokens", "off") as base:
        yield {"base": base, "data": root / "data"}


@pytest.fixture
def http(server: dict[str, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server["base"], timeout=10,
                      event_hooks={"response": [check_response]}) as client:
        yield client


def test_onboarding_400_403_201(http: httpx.Client) -> None:
    ca = http.get("/api/v1/onboarding/certificate")
    assert ca.status_code == 200
    assert b"BEGIN CERTIFICATE" in base64.b64decode(ca.json()["certificate"])
    device = Device()
    unreadable = [{**ONBOARDING, "certificate": "not base64!"},
                  {**ONBOARDING, "certificate": base64.b64encode(b"junk").decode()},
                  {**ONBOARDING, "certificate": ""}, ONBOARDING,
                  {**ONBOARDING, "apiVersion": "v1", "certificate": device.certificate},
                  {**ONBOARDING, "kind": "WrongKind", "certificate": device.certificate}]
    for body in unreadable:
        response = http.post("/api/v1/onboarding", json=body)
        assert response.status_code == 400, body
        assert response.json()["type"].endswith("#invalid-request")
    assert http.post("/api/v1/onboarding", content=b"{not json").status_code == 400
    expired = Device(not_before=NOW - dt.timedelta(days=10), not_after=NOW - dt.timedelta(days=1))
    for refused in (expired, _ed25519_device()):
        response = refused.onboard(http)
        assert response.status_code == 403
        assert response.json()["type"].endswith("#not-authorized")
    first = device.onboard(http)
    assert first.status_code == 201
    assert set(first.json()) == {"clientId"}  # no token: bearer tokens are off
    assert device.onboard(http).json()["clientId"] == device.client_id  # a retry
    pem = device.cert.public_bytes(serialization.Encoding.PEM).decode()
    der = base64.b64encode(device.cert.public_bytes(serialization.Encoding.DER)).decode()
    for spelling in (pem, der):
        again = http.post("/api/v1/onboarding", json={**ONBOARDING, "certificate": spelling})
        assert again.json()["clientId"] == device.client_id


def _ed25519_device() -> Any:
    device = Device()
    device.key, device.cert = make_self_signed("ed25519")
    return device


@pytest.mark.parametrize("algorithm", sorted(KEY_TYPES))
def test_each_algorithm_signs_accepted_requests(http: httpx.Client, algorithm: str) -> None:
    device = Device(algorithm)
    assert device.onboard(http).status_code == 201
    device_id = f"box-{algorithm}"
    created = device.send(http, "POST", f"{device.rc2}/capabilities", caps(device_id))
    assert created.status_code == 201, created.text
    manifest = device.send(http, "GET", f"{device.rc2}/deployments")
    assert manifest.status_code == 200 and manifest.json()["manifestVersion"] >= 1
    assert device.send(http, "GET", "/api/v1/deployments").status_code == 200  # rc.3 path too
    unsigned = http.get(f"{device.rc2}/deployments")
    assert unsigned.status_code == 401
    assert unsigned.headers["www-authenticate"].startswith("Signature")


def test_a_request_signed_exactly_as_the_kit_describes(http: httpx.Client) -> None:
    """README section 2.2, by hand: the base lines, P1363 r||s, the three headers."""
    device = Device()
    device.onboard(http)
    body = json.dumps(caps("box-by-hand")).encode()
    url = str(http.base_url).rstrip("/") + f"{device.rc2}/capabilities"
    authority = url.split("/")[2]
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
    params = (f'("@method" "@target-uri" "@authority" "content-digest");created='
              f'{int(time.time())};keyid="{device.kid}"')
    base = "\n".join(['"@method": POST', f'"@target-uri": {url}', f'"@authority": {authority}',
                      f'"content-digest": {digest}', f'"@signature-params": {params}'])
    r, s = decode_dss_signature(device.key.sign(base.encode(), ec.ECDSA(hashes.SHA256())))
    signature = base64.b64encode(r.to_bytes(32, "big") + s.to_bytes(32, "big")).decode()
    response = http.post(url, content=body, headers={
        "Content-Type": "application/json", "Content-Digest": digest,
        "Signature-Input": f"sig1={params}", "Signature": f"sig1=:{signature}:"})
    assert response.status_code == 201, response.text


def test_tampering_replay_and_unknown_keys_are_refused(http: httpx.Client) -> None:
    device = Device()
    device.onboard(http)
    path = f"{device.rc2}/capabilities"

    tampered_body = device.request(http, "POST", path, caps("box-tamper"))
    tampered_body.stream = httpx.ByteStream(tampered_body.content.replace(b"amd64", b"arm64"))
    refused = http.send(tampered_body)
    assert refused.status_code == 400 and "Content-Digest" in refused.json()["detail"]

    no_digest = device.request(http, "POST", path, caps("box-tamper"))
    del no_digest.headers["Content-Digest"]
    assert http.send(no_digest).status_code == 400

    tampered_signature = device.request(http, "POST", path, caps("box-tamper"))
    value = tampered_signature.headers["Signature"]
    raw = bytearray(base64.b64decode(value.split(":")[1]))
    raw[5] ^= 0xFF
    tampered_signature.headers["Signature"] = "sig1=:" + base64.b64encode(raw).decode() + ":"
    assert http.send(tampered_signature).status_code == 401

    old = NOW.replace(microsecond=0) - dt.timedelta(seconds=400)
    replayed = device.send(http, "GET", f"{device.rc2}/deployments", created=old)
    assert replayed.status_code == 401
    future = device.send(http, "GET", f"{device.rc2}/deployments",
                         created=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5))
    assert future.status_code == 401

    stranger = Device()  # the kit's fresh_cert: a key never onboarded
    stranger.client_id = device.client_id
    unknown = stranger.send(http, "GET", f"{device.rc2}/deployments")
    assert unknown.status_code == 401 and "keyid" in unknown.json()["detail"]
    impostor = device.send(http, "GET", f"{device.rc2}/deployments", sign_as=stranger)
    assert impostor.status_code == 401  # device's keyid, someone else's key

    uncovered = device.send(http, "GET", f"{device.rc2}/deployments",
                            components=("@method", "@authority"))
    assert uncovered.status_code == 401
    elsewhere = device.request(http, "GET", f"{device.rc2}/deployments")
    moved = http.build_request("GET", f"{device.rc2}/deployments?x=1",
                               headers={k: v for k, v in elsewhere.headers.items()
                                        if k.lower().startswith("signature")})
    assert http.send(moved).status_code == 401


def test_one_client_never_reaches_another_clients_state(http: httpx.Client) -> None:
    owner, other = Device(), Device()
    owner.onboard(http)
    other.onboard(http)
    assert owner.send(http, "POST", f"{owner.rc2}/capabilities", caps("box-owned")).status_code \
        == 201
    manifest = poll_until("the deployment assigned", lambda: (
        found if (found := owner.send(http, "GET", f"{owner.rc2}/deployments").json())[
            "deployments"] else None), timeout=20, interval=0.2)
    ref = manifest["deployments"][0]
    other_path = f"{other.rc2}/deployments/{ref['deploymentId']}/{ref['digest']}"
    assert other.send(http, "GET", other_path).status_code == 404
    bundle = manifest["bundle"]["url"].replace(owner.rc2, other.rc2)
    assert other.send(http, "GET", bundle).status_code == 404
    # Naming the owner's client id in the path does not help.
    assert other.send(http, "GET", f"{owner.rc2}/deployments").status_code == 403
    assert other.send(http, "GET", ref["url"]).status_code == 403
    taken = other.send(http, "PUT", f"{other.rc2}/capabilities/box-owned", caps("box-owned"))
    assert taken.status_code == 403
    report = {"apiVersion": "deployment.margo.org/v1alpha1", "kind": "DeploymentStatusManifest",
              "deploymentId": ref["deploymentId"], "status": {"state": "installed"},
              "components": [{"name": "x", "state": "installed"}]}
    status = other.send(http, "POST", f"{other.rc2}/deployments/{ref['deploymentId']}/status",
                        report)
    assert status.status_code == 422


def test_a_retired_client_is_refused(http: httpx.Client, server: dict[str, Any],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    device = Device()
    device.onboard(http)
    assert device.send(http, "GET", f"{device.rc2}/deployments").status_code == 200
    assert margo_main(["clients", "retire", device.client_id, "--data",
                       str(server["data"])]) == 0
    refused = device.send(http, "GET", f"{device.rc2}/deployments")
    assert refused.status_code == 403 and refused.json()["type"].endswith("#not-authorized")
    assert device.onboard(http).status_code == 403
    capsys.readouterr()


def test_a_retired_clients_held_poll_is_refused(http: httpx.Client, server: dict[str, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A signed waiting poll (issue 34), held, then the client retired beside the server:
    refused within seconds (403), not held to the end of its wait. Its signature was
    verified once, with the client as it was then: the server reads the client afresh
    (`wfm.http.callers.Callers.readmit`)."""
    device = Device()
    device.onboard(http)
    etag = device.send(http, "GET", f"{device.rc2}/deployments").headers["etag"]
    request = device.request(http, "GET", f"{device.rc2}/deployments")
    request.headers.update({"If-None-Match": etag, "Prefer": "wait=50"})  # (not signed)
    request.extensions["timeout"] = httpx.Timeout(70).as_dict()
    answered: list[tuple[httpx.Response, float]] = []
    with httpx.Client(timeout=70) as waiting:
        thread = threading.Thread(target=lambda: answered.append(
            (waiting.send(request), time.monotonic())), daemon=True)
        thread.start()
        poll_until("the signed poll held", lambda: held_polls(http) >= 1)
        assert margo_main(["clients", "retire", device.client_id, "--data",
                           str(server["data"])]) == 0
        retired_at = time.monotonic()
        thread.join(timeout=60)
    [(response, at)] = answered
    assert response.status_code == 403 and response.json()["type"].endswith("#not-authorized")
    assert at - retired_at < 10, f"refused {at - retired_at:.1f} s after the retirement"
    capsys.readouterr()


def test_closed_onboarding_window_and_https(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Over TLS (client certificates optional): closed onboarding admits only imported keys,
    and a 10-second window refuses a 30-second-old signature the default would take."""
    lab = make_lab(tmp_path / "pki")
    data = tmp_path / "data"
    device = Device("ecdsa-p384-sha384")
    with running_tls_server(data, lab, "--client-cert", "optional", "--onboarding", "closed",
                            "--signature-window", "10") as base, \
            tls_client(base, None, None, lab.bundle) as http:
        assert device.onboard(http).status_code == 403
        cert = write_pem(tmp_path / "device-cert.pem", device.cert)
        assert margo_main(["clients", "import", "line-7", "--cert", str(cert), "--data",
                           str(data)]) == 0
        onboarded = device.onboard(http)
        assert (onboarded.status_code, device.client_id) == (201, "line-7")
        path = f"{device.rc2}/deployments"
        assert device.send(http, "GET", path).status_code == 200  # https @target-uri
        stale = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(seconds=30)
        assert device.send(http, "GET", path, created=stale).status_code == 401
    capsys.readouterr()


def test_a_signed_waiting_poll_is_never_renewed(http: httpx.Client) -> None:
    """A signed poll answered 304 after its wait, sent again byte for byte on the same
    connection, is verified again (`wfm.admission.parking` renews only unsigned requests):
    once its signature has aged past the server's window, it is refused, never held again
    as a renewal of the request it was."""
    device = Device()
    device.onboard(http)
    etag = device.send(http, "GET", f"{device.rc2}/deployments").headers["etag"]
    window = 300 + 5  # `IdentitySettings.signature_window`, and the clock skew allowed
    created = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(seconds=window - 3)
    request = device.request(http, "GET", f"{device.rc2}/deployments", created=created)
    request.headers.update({"If-None-Match": etag, "Prefer": "wait=1"})  # (not signed)
    renewed = renewals(http)
    held = http.send(request)
    assert (held.status_code, held.headers.get("preference-applied")) == (304, "wait=1")
    time.sleep(max(0.0, (created + dt.timedelta(seconds=window + 1)
                         - dt.datetime.now(dt.UTC)).total_seconds()))
    again = http.send(request)
    assert again.status_code == 401, again.text
    assert renewals(http) == renewed
