"""rc.2 identity on the device: onboarding with the device certificate (clientId stored in the
data directory), and an RFC 9421 signature on every request in the conformance kit's profile.

The WFM is a small real HTTP server on loopback that onboards certificates and verifies every
signed request with `http-message-signatures` (the verifier side of the library), plus one
independent check that rebuilds the kit's signature base by hand and verifies the P-256
signature with `cryptography` alone: agreement of the client with a library is not enough
when the library could share our misunderstanding.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from http_message_signatures import HTTPMessageVerifier, MappingKeyResolver
from http_message_signatures import InvalidSignature as SignatureInvalid
from http_message_signatures.algorithms import (
    ECDSA_P256_SHA256,
    ECDSA_P384_SHA384,
    RSA_PSS_SHA512,
    RSA_V1_5_SHA256,
)
from kits.pkikit import cert_pem, make_key, make_self_signed, write_pem
from kits.serverkit import free_port, running_server
from kits.stubserver import serving, url

from margo.errors import DocumentError
from margo.rfc9421 import ONBOARDING_API_VERSION, key_id
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.signing import (
    DeviceKey,
    OnboardingError,
    SigningAuth,
    SigningError,
    load_device_key,
    onboard,
    sign_request,
)

DEVICE = "edge-2"
SIGNATURE_INPUT = re.compile(
    r'^sig1=\("@method" "@target-uri" "@authority"( "content-digest")?\)'
    r';created=(\d+);keyid="([0-9a-f]{64})"$')
WINDOW = 300  # seconds a signature's `created` may lie in the past


class PssAnyWith256(RSA_PSS_SHA512):
    """The verifier's `rsa-pss-sha256`: MGF1-SHA-256 and any salt length, written here so the
    test does not verify the client's PSS with the client's own class."""

    algorithm_id = "rsa-pss-sha256"

    def __init__(self, public_key: Any = None, private_key: Any = None) -> None:
        super().__init__(public_key=public_key, private_key=private_key)
        self.padding = padding.PSS(mgf=padding.MGF1(hashes.SHA256()),
                                   salt_length=padding.PSS.AUTO)
        self.hash_algorithm = hashes.SHA256()


def verifiers_for(public_key: Any) -> list[Any]:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return [ECDSA_P256_SHA256 if public_key.curve.name == "secp256r1" else ECDSA_P384_SHA384]
    return [PssAnyWith256, RSA_V1_5_SHA256]


@dataclass
class _Message:
    method: str
    url: str
    headers: httpx.Headers


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    verified: str | None = None  # the algorithm that verified it
    error: str | None = None


@dataclass
class Rc2Wfm:
    """Onboarding and signature verification as an rc.2 WFM does them."""

    base: str = ""
    clients: dict[str, tuple[str, Any]] = field(default_factory=dict)  # keyid -> (id, key)
    onboardings: list[dict[str, Any]] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    onboarding_answer: tuple[int, dict[str, Any]] | None = None  # forced answer, if set

    def handle(self, method: str, path: str, headers: dict[str, str],
               body: bytes) -> tuple[int, dict[str, str], bytes]:
        if path == "/api/v1/onboarding" and method == "POST":
            return self._onboard(headers, body)
        seen = Seen(method, path, headers, body)
        self.seen.append(seen)
        status = self._verify(seen)
        if status != 200:
            return status, {"Content-Type": "application/json"}, json.dumps(
                {"error": seen.error}).encode()
        if path.endswith("/deployments"):
            data = b'{"manifestVersion": 1, "bundle": null, "deployments": []}'
            etag = f'"sha256:{hashlib.sha256(data).hexdigest()}"'
            if headers.get("if-none-match") == etag:
                return 304, {"ETag": etag}, b""
            return 200, {"Content-Type": "application/vnd.margo.manifest.v1+json",
                         "ETag": etag}, data
        return (201 if method == "PUT" else 200), {"Content-Type": "application/json"}, b"{}"

    def _onboard(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        doc = json.loads(body)
        self.onboardings.append({"doc": doc, "signed": "signature" in headers})
        if self.onboarding_answer is not None:
            status, answer = self.onboarding_answer
            return status, {"Content-Type": "application/json"}, json.dumps(answer).encode()
        try:
            assert doc["apiVersion"] == ONBOARDING_API_VERSION
            assert doc["kind"] == "OnboardingRequest"
            cert = x509.load_pem_x509_certificate(base64.b64decode(doc["certificate"]))
        except (AssertionError, KeyError, ValueError):
            return 400, {"Content-Type": "application/json"}, b'{"error":"Invalid certificate"}'
        client = str(uuid.uuid4())
        self.clients[key_id(cert.public_key())] = (client, cert.public_key())
        return 201, {"Content-Type": "application/json"}, json.dumps(
            {"clientId": client}).encode()

    def _verify(self, seen: Seen) -> int:
        if seen.body and "content-digest" not in seen.headers:
            seen.error = "missing Content-Digest"
            return 400
        match = SIGNATURE_INPUT.match(seen.headers.get("signature-input", ""))
        if match is None or match.group(3) not in self.clients:
            seen.error = "missing, foreign or unknown signature"
            return 401
        client, public_key = self.clients[match.group(3)]
        if not seen.path.startswith(f"/api/v1/clients/{client}/"):
            seen.error = "not this client's path"
            return 403
        message = _Message(seen.method, self.base + seen.path, httpx.Headers(seen.headers))
        required = ("@method", "@target-uri", "@authority") + (
            ("content-digest",) if seen.body else ())
        for algorithm in verifiers_for(public_key):
            verifier = HTTPMessageVerifier(signature_algorithm=algorithm,
                                           key_resolver=MappingKeyResolver(
                                               public_keys={match.group(3): public_key},
                                               private_keys={}))
            try:
                verifier.verify(message, body=seen.body, require_components=required,
                                max_age=dt.timedelta(seconds=WINDOW))
            except SignatureInvalid as exc:
                seen.error = str(exc)
                continue
            seen.verified, seen.error = algorithm.algorithm_id, None
            return 200
        return 401


class _Handler(BaseHTTPRequestHandler):
    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        wfm: Rc2Wfm = self.server.wfm  # type: ignore[attr-defined]
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, extra, payload = wfm.handle(self.command, self.path, headers, body)
        self.send_response(status)
        for name, value in {**extra, "Content-Length": str(len(payload))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wfm() -> Iterator[Rc2Wfm]:
    with serving(_Handler) as httpd:
        httpd.wfm = state = Rc2Wfm(base=url(httpd))
        yield state


@dataclass
class Identity:
    key_file: Path
    cert_file: Path
    key: DeviceKey


def device_identity(directory: Path, key_type: str = "ec-p256",
                    algorithm: str | None = None) -> Identity:
    private, cert = make_self_signed(key_type, common_name=f"device-{key_type}")
    key_file = write_pem(directory / f"{key_type}.key", private)
    cert_file = write_pem(directory / f"{key_type}-cert.pem", cert)
    return Identity(key_file, cert_file, load_device_key(key_file, algorithm))


@contextmanager
def client(wfm: Rc2Wfm, key: DeviceKey | None = None) -> Iterator[httpx.Client]:
    auth = SigningAuth(key) if key is not None else None
    with httpx.Client(base_url=wfm.base, auth=auth, timeout=10) as http:
        yield http


# --- onboarding --------------------------------------------------------------------------------


def test_onboarding_stores_the_client_id_and_reuses_it(wfm: Rc2Wfm, tmp_path: Path) -> None:
    device = device_identity(tmp_path)
    state_file = tmp_path / "data" / "rc2-client.json"
    with client(wfm, device.key) as http:
        client_id = onboard(http, certificate=device.cert_file, key=device.key,
                            state_file=state_file)
        assert onboard(http, certificate=device.cert_file, key=device.key,
                       state_file=state_file) == client_id
    assert len(wfm.onboardings) == 1  # the second call used the stored id
    sent = wfm.onboardings[0]
    assert not sent["signed"]  # the form every rc.2 WFM accepts (kit step 4.4)
    assert set(sent["doc"]) == {"apiVersion", "kind", "certificate"}
    assert base64.b64decode(sent["doc"]["certificate"]) == device.cert_file.read_bytes()
    stored = json.loads(state_file.read_text())
    assert stored == {"clientId": client_id, "keyId": device.key.key_id, "server": wfm.base}
    assert wfm.clients[device.key.key_id][0] == client_id


def test_a_new_key_or_another_server_onboards_again(wfm: Rc2Wfm, tmp_path: Path) -> None:
    first, second = device_identity(tmp_path), device_identity(tmp_path, "ec-p384")
    state_file = tmp_path / "rc2-client.json"
    with client(wfm) as http:
        one = onboard(http, certificate=first.cert_file, key=first.key, state_file=state_file)
        two = onboard(http, certificate=second.cert_file, key=second.key, state_file=state_file)
    assert one != two and len(wfm.onboardings) == 2
    state_file.write_text(json.dumps({"clientId": "old", "keyId": second.key.key_id,
                                      "server": "http://elsewhere"}))
    with client(wfm) as http:
        assert onboard(http, certificate=second.cert_file, key=second.key,
                       state_file=state_file) not in ("old", two)


@pytest.mark.parametrize(("answer", "status", "retryable", "words"), [
    ((400, {"error": "Invalid certificate"}), 400, False, "Invalid certificate"),
    ((403, {"type": "about:blank", "title": "Forbidden", "detail": "Client rejected"}), 403,
     True, "an operator may approve"),
    ((201, {"id": "no clientId here"}), 201, True, "without a usable clientId"),
    ((201, {"clientId": "../../etc"}), 201, True, "without a usable clientId"),
    ((500, {}), 500, True, "HTTP 500"),
])
def test_onboarding_failures_say_what_happened(wfm: Rc2Wfm, tmp_path: Path,
                                               answer: tuple[int, dict[str, Any]], status: int,
                                               retryable: bool, words: str) -> None:
    device = device_identity(tmp_path)
    wfm.onboarding_answer = answer
    state_file = tmp_path / "rc2-client.json"
    with client(wfm) as http, pytest.raises(OnboardingError) as raised:
        onboard(http, certificate=device.cert_file, key=device.key, state_file=state_file)
    assert (raised.value.status, raised.value.retryable) == (status, retryable)
    assert words in str(raised.value)
    assert not state_file.exists()


def test_onboarding_without_a_server_or_with_the_wrong_certificate(wfm: Rc2Wfm,
                                                                    tmp_path: Path) -> None:
    device, other = device_identity(tmp_path), device_identity(tmp_path, "ec-p384")
    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=5) as http, \
            pytest.raises(OnboardingError) as raised:
        onboard(http, certificate=device.cert_file, key=device.key,
                state_file=tmp_path / "a.json")
    assert raised.value.status is None and raised.value.retryable
    with client(wfm) as http, pytest.raises(SigningError, match="does not hold the public key"):
        onboard(http, certificate=other.cert_file, key=device.key,
                state_file=tmp_path / "b.json")
    assert wfm.onboardings == []  # refused before anything was sent
    (tmp_path / "c.json").write_text("{not json")
    with client(wfm) as http, pytest.raises(OnboardingError, match="remove it"):
        onboard(http, certificate=device.cert_file, key=device.key,
                state_file=tmp_path / "c.json")


# --- signing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("key_type", "algorithm"), [
    ("ec-p256", "ecdsa-p256-sha256"),
    ("ec-p384", "ecdsa-p384-sha384"),
    ("rsa-2048", "rsa-pss-sha256"),
    ("rsa-2048", "rsa-v1_5-sha256"),
])
def test_every_request_carries_a_valid_signature(wfm: Rc2Wfm, tmp_path: Path, key_type: str,
                                                 algorithm: str) -> None:
    device = device_identity(tmp_path, key_type, algorithm)
    assert device.key.algorithm == algorithm
    with client(wfm, device.key) as http:
        client_id = onboard(http, certificate=device.cert_file, key=device.key,
                            state_file=tmp_path / "rc2.json")
        base = f"/api/v1/clients/{client_id}"
        assert http.get(f"{base}/deployments").status_code == 200
        assert http.put(f"{base}/capabilities/{DEVICE}", json={"properties": {}}
                        ).status_code == 201
        assert http.post(f"{base}/deployments/d-1/status?x=1", content=b"{}").status_code == 200
    assert [(s.method, s.verified, s.error) for s in wfm.seen] == [
        (m, algorithm, None) for m in ("GET", "PUT", "POST")]
    for seen in wfm.seen:
        match = SIGNATURE_INPUT.match(seen.headers["signature-input"])
        assert match is not None, seen.headers["signature-input"]
        assert bool(match.group(1)) == bool(seen.body)  # content-digest covered iff a body
        assert match.group(3) == device.key.key_id
        assert seen.headers["signature"].startswith("sig1=:")
        if seen.body:
            digest = base64.b64encode(hashlib.sha256(seen.body).digest()).decode()
            assert seen.headers["content-digest"] == f"sha-256=:{digest}:"
        else:
            assert "content-digest" not in seen.headers


def test_the_signature_base_is_the_kits(wfm: Rc2Wfm, tmp_path: Path) -> None:
    """Rebuild the kit's signature base by hand (README 2.2) and verify the P-256 signature
    as 64 bytes r||s with `cryptography` alone."""
    device = device_identity(tmp_path)
    with client(wfm, device.key) as http:
        client_id = onboard(http, certificate=device.cert_file, key=device.key,
                            state_file=tmp_path / "rc2.json")
        http.put(f"/api/v1/clients/{client_id}/capabilities/{DEVICE}", json={"a": 1})
    seen = wfm.seen[0]
    params = seen.headers["signature-input"].removeprefix("sig1=")
    authority = wfm.base.removeprefix("http://")
    base = "\n".join([
        '"@method": PUT',
        f'"@target-uri": {wfm.base}{seen.path}',
        f'"@authority": {authority}',
        f'"content-digest": {seen.headers["content-digest"]}',
        f'"@signature-params": {params}',
    ]).encode()
    raw = base64.b64decode(seen.headers["signature"].removeprefix("sig1=:").removesuffix(":"))
    assert len(raw) == 64
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    public_key = device.key.private_key.public_key()
    public_key.verify(der, base, ec.ECDSA(hashes.SHA256()))
    with pytest.raises(InvalidSignature):  # and the check can fail
        public_key.verify(der, base.replace(b"PUT", b"GET"), ec.ECDSA(hashes.SHA256()))
    spki = public_key.public_bytes(serialization.Encoding.DER,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    assert f'keyid="{hashlib.sha256(spki).hexdigest()}"' in params


def test_tampered_or_stale_requests_do_not_verify(wfm: Rc2Wfm, tmp_path: Path) -> None:
    """The server side of the test can fail: a changed body, a replay from outside the window
    and a never-onboarded key are all refused."""
    device = device_identity(tmp_path)
    (tmp_path / "stranger").mkdir()
    stranger = device_identity(tmp_path / "stranger")
    with client(wfm) as http:
        client_id = onboard(http, certificate=device.cert_file, key=device.key,
                            state_file=tmp_path / "rc2.json")
        url = f"{wfm.base}/api/v1/clients/{client_id}/capabilities/{DEVICE}"
        signed = httpx.Request("PUT", url, content=b'{"a": 1}')
        sign_request(signed, device.key, created=int(dt.datetime.now(dt.UTC).timestamp()))
        tampered = httpx.Request("PUT", url, content=b'{"a": 2}', headers=signed.headers)
        assert http.send(tampered).status_code == 401
        stale = httpx.Request("PUT", url, content=b"{}")
        sign_request(stale, device.key,
                     created=int(dt.datetime.now(dt.UTC).timestamp()) - 2 * WINDOW)
        assert http.send(stale).status_code == 401
        foreign = httpx.Request("PUT", url, content=b"{}")
        sign_request(foreign, stranger.key, created=int(dt.datetime.now(dt.UTC).timestamp()))
        assert http.send(foreign).status_code == 401
        assert http.send(signed).status_code == 201  # the untouched original still verifies
    assert [s.verified is not None for s in wfm.seen] == [False, False, False, True]
    assert "digest" in (wfm.seen[0].error or "").lower()


def test_signing_twice_leaves_one_set_of_headers(tmp_path: Path) -> None:
    device = device_identity(tmp_path)
    request = httpx.Request("POST", "https://wfm.example:8443/api/v1/x", content=b"body")
    sign_request(request, device.key, created=1_800_000_000)
    sign_request(request, device.key, created=1_800_000_001)
    assert request.headers.get_list("signature-input") == [
        request.headers["signature-input"]]
    assert ";created=1800000001;" in request.headers["signature-input"]
    assert len(request.headers.get_list("content-digest")) == 1


def test_unusable_keys_are_refused(tmp_path: Path) -> None:
    for key_type in ("ed25519", "rsa-1024"):
        path = write_pem(tmp_path / f"{key_type}.key", make_key(key_type))
        with pytest.raises(SigningError, match="EC P-256, EC P-384 or RSA"):
            load_device_key(path)
    p256 = write_pem(tmp_path / "p256.key", make_key("ec-p256"))
    with pytest.raises(SigningError, match="cannot sign with ecdsa-p384-sha384"):
        load_device_key(p256, "ecdsa-p384-sha384")
    (tmp_path / "cert-as-key.pem").write_bytes(cert_pem(make_self_signed()[1]))
    with pytest.raises(SigningError, match="not an unencrypted PEM private key"):
        load_device_key(tmp_path / "cert-as-key.pem")
    with pytest.raises(SigningError, match="cannot read"):
        load_device_key(tmp_path / "missing.key")
    rsa_key = write_pem(tmp_path / "rsa.key", make_key("rsa-2048"))
    assert load_device_key(rsa_key).algorithm == "rsa-pss-sha256"  # PSS preferred
    assert isinstance(load_device_key(rsa_key).private_key, rsa.RSAPrivateKey)


def test_the_real_margo_serve_onboards_and_verifies_every_key_type(tmp_path: Path) -> None:
    """Interoperation with our own WFM's rc.2 profile (`margo serve`, bearer tokens off, so a
    valid signature is the only way in): onboarding, a signed capabilities PUT and a signed
    manifest GET, with each algorithm."""
    (tmp_path / "data").mkdir()
    capabilities: dict[str, Any] = {"apiVersion": "device.margo.org/v1alpha1",
                    "kind": "DeviceCapabilitiesManifest", "properties": {
                        "id": DEVICE, "vendor": "ACME", "modelNumber": "X1",
                        "serialNumber": "2", "cpus": [{"cores": 2, "architecture": "amd64"}],
                        "memory": "1Gi", "storage": "1Gi", "peripherals": [], "interfaces": [],
                        "otelCollector": True, "supportedRuntimes": ["oci"],
                        "supportedDeploymentTypes": ["helm"]}}
    with running_server(tmp_path / "data", "--bearer-tokens", "off") as base:
        for key_type, algorithm in (("ec-p256", None), ("ec-p384", None),
                                    ("rsa-2048", "rsa-pss-sha256"),
                                    ("rsa-2048", "rsa-v1_5-sha256")):
            directory = tmp_path / f"{key_type}-{algorithm}"
            directory.mkdir()
            device = device_identity(directory, key_type, algorithm)
            with httpx.Client(base_url=base, auth=SigningAuth(device.key), timeout=10) as http:
                client_id = onboard(http, certificate=device.cert_file, key=device.key,
                                    state_file=directory / "rc2.json")
                prefix = f"/api/v1/clients/{client_id}"
                device_id = f"{DEVICE}-{len(list(tmp_path.iterdir()))}"  # one per client
                capabilities["properties"]["id"] = device_id
                answer = http.put(f"{prefix}/capabilities/{device_id}", json=capabilities)
                assert answer.status_code in (200, 201), (device.key.algorithm, answer.text)
                assert http.get(f"{prefix}/deployments").status_code == 200
            with httpx.Client(base_url=base, timeout=10) as unsigned:
                assert unsigned.get(f"{prefix}/deployments").status_code == 401


# --- the assembled device client ---------------------------------------------------------------


def write_config(directory: Path, server_url: str, **rc2: Any) -> Path:
    doc = {
        "device": {"id": DEVICE},
        "server": {"url": server_url, "api": "rc.2", "timeout": "10s"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "render"},
        "dataDir": "data",
        "identity": {"rc2": {"key": "ec-p256.key", "certificate": "ec-p256-cert.pem", **rc2}},
        "capabilities": {"host": {"vendor": "ACME", "modelNumber": "X1", "serialNumber": "2"}},
    }
    path = directory / "device.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_the_device_client_onboards_once_and_signs_everything(wfm: Rc2Wfm,
                                                              tmp_path: Path) -> None:
    device_identity(tmp_path)
    config = load_config(write_config(tmp_path, wfm.base))
    for expected in ("adopted", "unchanged"):  # a restart reuses the stored clientId
        with open_reconciler(config) as reconciler:
            result = reconciler.cycle()
            assert (result.fetched, result.failures) == (expected, [])
    assert len(wfm.onboardings) == 1
    client_id = json.loads((tmp_path / "data" / "rc2-client.json").read_text())["clientId"]
    paths = [(s.method, s.path) for s in wfm.seen]
    assert ("PUT", f"/api/v1/clients/{client_id}/capabilities/{DEVICE}") in paths
    assert ("GET", f"/api/v1/clients/{client_id}/deployments") in paths
    assert all(s.verified == "ecdsa-p256-sha256" for s in wfm.seen), wfm.seen
    assert not any("authorization" in s.headers for s in wfm.seen)


def test_the_device_client_does_not_start_when_onboarding_is_rejected(
        wfm: Rc2Wfm, tmp_path: Path) -> None:
    device_identity(tmp_path)
    wfm.onboarding_answer = (403, {"error": "Client rejected"})
    config = load_config(write_config(tmp_path, wfm.base))
    with pytest.raises(OnboardingError, match="Client rejected"), open_reconciler(config):
        pass
    assert wfm.seen == []


@pytest.mark.parametrize(("change", "where", "words"), [
    ({"server": {"url": "http://h", "api": "rc.3"}}, "$.identity.rc2", "rc.2"),
    ({"source": {"type": "git"}}, "$.identity.rc2", "margo-rest"),
    ({"identity": {"rc2": {"key": "k", "certificate": "c"},
                   "svid": {"cert": "a", "key": "b"}, "trustBundle": "t"}},
     "$.identity", "not both"),
    ({"identity": {"rc2": {"key": "k", "certificate": "c", "algorithm": "hmac-sha256"}}},
     "$.identity.rc2.algorithm", ""),
    ({"identity": {"rc2": {"key": "k", "certificate": "c"}, "trustBundle": "t"}},
     "$.identity.trustBundle", "http://"),
    ({"identity": {}}, "$.server", "bearer token"),
])
def test_rc2_configuration_problems_are_located(tmp_path: Path, change: dict[str, Any],
                                                where: str, words: str) -> None:
    path = write_config(tmp_path, "http://h")
    doc = json.loads(path.read_text())
    doc.update(change)
    path.write_text(json.dumps(doc))
    with pytest.raises(DocumentError) as raised:
        load_config(path)
    problems = [p for p in raised.value.problems if p.json_path == where]
    assert problems and words in problems[0].message, raised.value.problems
