"""The device client's rc.3 identity: mutual TLS with its SVID, the exact WFM SPIFFE ID check
before any request byte is sent, rotation without restart, and the device kit's negative
fixtures served over mTLS.

The WFM is a small real TLS server on loopback (Python `ssl` + `http.server`) that requires a
client certificate and records, per connection, whether the handshake completed, which client
SVID was presented and whether any request byte arrived: "no bytes reached a refused server"
is proven on the server side, not assumed from the client's exception. All certificates are
minted at run time (`pkikit`), so nothing here expires on a date.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from kits.pkikit import (
    Ca,
    Svid,
    issue_client_svid,
    issue_svid,
    issue_wfm_svid,
    make_ca,
    make_lab,
    running_tls_server,
    write_pem,
)
from kits.stubserver import serving as stub_serving

from margo.archive import deterministic_targz
from margo.digests import digest_of
from margo.errors import DocumentError
from margo.spiffe import SvidError, svid_spiffe_id
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.identity import IdentityError, IdentityTransport, ServerTrust, SvidMaterial
from reconciler.sources import Adopted, IntegrityError, SourceError
from reconciler.sources.rest_source import RestSource

TD, WFM, CLIENT = "factory.test", "wfm-1", "device-7"
WFM_ID = f"spiffe://{TD}/margo/wfm/{WFM}"
CLIENT_ID = f"spiffe://{TD}/margo/wfm/{WFM}/client/{CLIENT}"
DEVICE = "edge-7"
HOUR = dt.timedelta(hours=1)

# --- a WFM on loopback that requires a client certificate --------------------------------------


@dataclass
class Connection:
    """One TCP connection as the server saw it."""

    handshake: bool = False
    client_spiffe: str | None = None
    client_serial: int | None = None
    request_bytes: bool = False
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    # Set when the server has finished with the connection: the client may refuse and close
    # before the server's thread has even completed its side of the handshake.
    over: threading.Event = field(default_factory=threading.Event)


Answer = tuple[int, dict[str, str], bytes]
App = Callable[[str, str, bytes], Answer]


def ok_app(method: str, path: str, body: bytes) -> Answer:
    return 200, {"Content-Type": "application/json"}, b'{"ok": true}'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real WFM: rotation must close old links

    def handle(self) -> None:
        try:
            head = self.rfile.peek(1)
        except OSError:
            head = b""
        server: TlsServer = self.server  # type: ignore[assignment]
        seen = server.connection_of(self.client_address)
        seen.request_bytes = seen.request_bytes or bool(head)
        if head:
            super().handle()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        server: TlsServer = self.server  # type: ignore[assignment]
        seen = server.connection_of(self.client_address)
        seen.requests.append((self.command, self.path, body))
        seen.headers.append({k.lower(): v for k, v in self.headers.items()})
        status, headers, payload = server.app(self.command, self.path, body)
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(payload))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


class TlsServer(ThreadingHTTPServer):
    """Serves `app` over TLS; `context` may be replaced at any time (a WFM that changed its
    certificate)."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext, app: App = ok_app) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context, self.app = context, app
        self.connections: list[Connection] = []
        self._by_address: dict[Any, Connection] = {}
        self._open: set[ssl.SSLSocket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"

    def connection_of(self, address: Any) -> Connection:
        with self._lock:
            return self._by_address[address]

    def finish_request(self, request: Any, client_address: Any) -> None:
        seen = Connection()
        with self._lock:
            self.connections.append(seen)
            self._by_address[client_address] = seen
        try:
            self._serve_connection(seen, request, client_address)
        finally:
            seen.over.set()

    def _serve_connection(self, seen: Connection, request: Any, client_address: Any) -> None:
        request.settimeout(10)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # the handshake failed (the client refused our chain, or we its)
        with tls:
            seen.handshake = True
            der = tls.getpeercert(binary_form=True)
            if der:
                cert = x509.load_der_x509_certificate(der)
                seen.client_serial = cert.serial_number
                try:
                    seen.client_spiffe = str(svid_spiffe_id(cert))
                except SvidError:
                    seen.client_spiffe = "not an SVID"
            with self._lock:
                self._open.add(tls)
            try:
                self.RequestHandlerClass(tls, client_address, self)
            except OSError:
                pass
            finally:
                with self._lock:
                    self._open.discard(tls)

    def requests(self) -> list[tuple[str, str, bytes]]:
        return [r for c in self.connections for r in c.requests]


@contextmanager
def serving(context: ssl.SSLContext, app: App = ok_app) -> Iterator[TlsServer]:
    def cut(server: TlsServer) -> None:
        with server._lock:
            for sock in server._open:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    with stub_serving(server=TlsServer(context, app), before_close=cut) as server:
        yield server
    for seen in server.connections:  # what the server saw is complete before tests read it
        seen.over.wait(timeout=10)


def pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(Encoding.PEM).decode() for c in certs)


def server_context(directory: Path, svid: Svid, client_roots: list[Ca], *,
                   max_tls12: bool = False) -> ssl.SSLContext:
    """A WFM's context: its SVID; client certificates required, checked against the roots."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if max_tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    # No TLS 1.3 session tickets: the server would write them after the handshake, racing a
    # client that has just refused it (the test wants to see the handshake complete).
    context.num_tickets = 0
    context.load_verify_locations(cadata=pem(*(ca.root for ca in client_roots)))
    context.load_cert_chain(*svid.write(directory, f"server-{svid.cert.serial_number}"))
    return context


# --- the test PKI and the device's files -------------------------------------------------------


@dataclass
class Pki:
    directory: Path
    ca: Ca  # the factory's trust domain
    other: Ca  # another trust domain, trusted too (so only the SPIFFE ID check can refuse)
    rogue: Ca  # the factory's name, but not in any bundle
    client: Svid
    wfm: Svid

    def server(self, svid: Svid | None = None, **kwargs: Any) -> ssl.SSLContext:
        return server_context(self.directory, svid or self.wfm, [self.ca], **kwargs)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = make_ca(TD)
    return Pki(tmp_path_factory.mktemp("pki"), ca, make_ca("other.test"), make_ca(TD),
               issue_client_svid(ca, WFM, CLIENT), issue_wfm_svid(ca, WFM))


def replace_file(path: Path, data: bytes) -> None:
    """As an operator or agent rotates files: write aside, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class DeviceFiles:
    cert: Path
    key: Path
    bundle: Path

    def put_svid(self, svid: Svid) -> None:
        replace_file(self.cert, svid.cert_pem)
        replace_file(self.key, svid.key_pem)

    def put_bundle(self, *cas: Ca) -> None:
        replace_file(self.bundle, pem(*(ca.root for ca in cas)).encode())

    def material(self, **kwargs: Any) -> SvidMaterial:
        return SvidMaterial(self.cert, self.key, self.bundle, **kwargs)


@pytest.fixture
def device(tmp_path: Path, pki: Pki) -> DeviceFiles:
    files = DeviceFiles(tmp_path / "svid.pem", tmp_path / "svid-key.pem",
                        tmp_path / "bundle.pem")
    files.put_svid(pki.client)
    files.put_bundle(pki.ca, pki.other)
    return files


@contextmanager
def mtls_client(material: SvidMaterial, base_url: str, **kwargs: Any) -> Iterator[httpx.Client]:
    transport = IdentityTransport(material, **kwargs)
    with httpx.Client(base_url=base_url, transport=transport, timeout=10) as client:
        yield client


# --- talking to the right WFM -----------------------------------------------------------------


def test_presents_its_svid_and_talks_to_the_right_wfm(pki: Pki, device: DeviceFiles) -> None:
    material = device.material()
    setup = material.load()
    assert str(setup.expected_peer) == WFM_ID and str(setup.own_id) == CLIENT_ID
    assert setup.client_id == CLIENT
    assert setup.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3
    with serving(pki.server()) as wfm, mtls_client(material, wfm.url) as client:
        assert client.get("/api/v1/deployments").json() == {"ok": True}
        assert client.put("/api/v1/capabilities/x", json={"a": 1}).status_code == 200
    assert wfm.connections[0].client_spiffe == CLIENT_ID
    assert wfm.connections[0].client_serial == pki.client.cert.serial_number
    assert [(m, p) for m, p, _ in wfm.requests()] == [("GET", "/api/v1/deployments"),
                                                     ("PUT", "/api/v1/capabilities/x")]
    assert len(wfm.connections) == 1  # one kept-alive connection for both requests


def _wrong_servers(pki: Pki) -> dict[str, Svid]:
    return {
        "wrong trust domain": issue_wfm_svid(pki.other, WFM),
        "wrong wfm id": issue_wfm_svid(pki.ca, "wfm-2"),
        "a client SVID posing as the WFM": issue_client_svid(pki.ca, WFM, "device-8"),
        "the trust domain's own ID": issue_svid(pki.ca, f"spiffe://{TD}"),
        "two URI SANs": issue_svid(pki.ca, WFM_ID, extra_uris=[f"spiffe://{TD}/other"]),
        "no URI SAN": issue_svid(pki.ca, None, dns_names=["localhost"]),
        "a different case": issue_svid(pki.ca, f"spiffe://{TD}/margo/wfm/WFM-1"),
    }


WRONG = ["wrong trust domain", "wrong wfm id", "a client SVID posing as the WFM",
         "the trust domain's own ID", "two URI SANs", "no URI SAN", "a different case"]


@pytest.mark.parametrize("case", WRONG)
def test_refuses_a_server_with_any_other_identity(pki: Pki, device: DeviceFiles,
                                                  case: str) -> None:
    svid = _wrong_servers(pki)[case]
    with serving(server_context(pki.directory, svid, [pki.ca])) as wfm, \
            mtls_client(device.material(), wfm.url) as client:
        for send in (lambda: client.get("/api/v1/deployments"),
                     lambda: client.post("/api/v1/deployments/d/status", json={"x": 1})):
            with pytest.raises(httpx.ConnectError, match="refused the server"):
                send()
    # The server completed the handshake (the chain is trusted), yet saw no request byte.
    assert len(wfm.connections) == 2
    assert all(c.handshake and not c.request_bytes for c in wfm.connections)
    assert wfm.requests() == []


def test_refuses_a_server_whose_ca_it_does_not_trust(pki: Pki, device: DeviceFiles) -> None:
    impostor = issue_wfm_svid(pki.rogue, WFM)  # the right SPIFFE ID from the wrong CA
    with serving(server_context(pki.directory, impostor, [pki.ca])) as wfm, \
            mtls_client(device.material(), wfm.url) as client, \
            pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        client.get("/api/v1/deployments")
    assert [(c.handshake, c.request_bytes) for c in wfm.connections] == [(False, False)]


def test_explicit_trust_domain_and_wfm_id_override_the_svid(pki: Pki,
                                                            device: DeviceFiles) -> None:
    other_wfm = issue_wfm_svid(pki.ca, "wfm-2")
    material = device.material(wfm_id="wfm-2")
    assert str(material.load().expected_peer) == f"spiffe://{TD}/margo/wfm/wfm-2"
    with serving(server_context(pki.directory, other_wfm, [pki.ca])) as wfm, \
            mtls_client(material, wfm.url) as client:
        assert client.get("/").status_code == 200
    with serving(pki.server()) as wfm, mtls_client(material, wfm.url) as client, \
            pytest.raises(httpx.ConnectError, match="expected exactly"):
        client.get("/")


def test_tls_1_2_only_when_enabled(pki: Pki, device: DeviceFiles) -> None:
    with serving(pki.server(max_tls12=True)) as wfm:
        with mtls_client(device.material(), wfm.url) as client, \
                pytest.raises(httpx.ConnectError):
            client.get("/")
        with mtls_client(device.material(tls12=True), wfm.url) as client:
            assert client.get("/").status_code == 200
    assert wfm.connections[-1].client_spiffe == CLIENT_ID
    assert not wfm.connections[0].request_bytes


def test_the_real_margo_serve_over_mtls(tmp_path: Path) -> None:
    """Interoperation with our own WFM (`margo serve --tls-cert ...`): capabilities and the
    manifest over mTLS with the device's SVID; a client expecting another WFM id refuses it."""
    lab = make_lab(tmp_path / "pki")
    cert, key = lab.client("dev")
    material = SvidMaterial(cert, key, lab.bundle)
    properties = {"id": DEVICE, "vendor": "ACME", "modelNumber": "X1", "serialNumber": "7",
                  "cpus": [{"cores": 2, "architecture": "amd64"}], "memory": "1Gi",
                  "storage": "1Gi", "peripherals": [], "interfaces": [], "otelCollector": True,
                  "supportedRuntimes": ["oci"], "supportedDeploymentTypes": ["helm"]}
    with running_tls_server(tmp_path / "data", lab, "--accept-clients", "*",
                            ready=(cert, key)) as base:
        with mtls_client(material, base) as client:
            answer = client.put(f"/api/v1/capabilities/{DEVICE}", json={"properties": properties})
            assert answer.status_code == 201, answer.text
            state = RestSource(client).fetch(Adopted())
            assert state is not None and state.manifest_version == 1
        with mtls_client(SvidMaterial(cert, key, lab.bundle, wfm_id="wfm-2"), base) as client, \
                pytest.raises(httpx.ConnectError, match="expected exactly"):
            client.get("/api/v1/deployments")


# --- rotation without restart ------------------------------------------------------------------


def test_a_rotated_svid_is_presented_without_restart(pki: Pki, device: DeviceFiles) -> None:
    rotated = issue_client_svid(pki.ca, WFM, CLIENT)
    transport = IdentityTransport(device.material())
    with serving(pki.server()) as wfm, \
            httpx.Client(base_url=wfm.url, transport=transport, timeout=10) as client:
        client.get("/")
        device.put_svid(rotated)
        client.get("/")
        client.get("/")
    serials = [c.client_serial for c in wfm.connections]
    # The kept-alive connection of the old SVID was closed; the new one presents the new SVID.
    assert serials == [pki.client.cert.serial_number, rotated.cert.serial_number]
    assert [len(c.requests) for c in wfm.connections] == [1, 2]
    assert transport.reloads == 1


def test_a_rotated_trust_bundle_replaces_the_anchors(pki: Pki, device: DeviceFiles) -> None:
    new_ca = make_ca(TD, name="factory.test root 2")
    with serving(server_context(pki.directory, issue_wfm_svid(new_ca, WFM), [pki.ca])) as wfm, \
            mtls_client(device.material(), wfm.url) as client:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            client.get("/")  # the WFM moved to a CA the device does not know yet
        device.put_bundle(new_ca)  # the new root only
        assert client.get("/", headers={"Connection": "close"}).status_code == 200
        wfm.context = pki.server()  # a certificate from the old CA again
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            client.get("/")  # replaced, not merged: the old root is no longer trusted
    assert [c.handshake for c in wfm.connections] == [False, True, False]
    assert [c.request_bytes for c in wfm.connections] == [False, True, False]


class Counting:
    """A material that counts how often its files are read."""

    def __init__(self, material: SvidMaterial) -> None:
        self.material, self.loads = material, 0

    def files(self) -> tuple[Path, ...]:
        return self.material.files()

    def load(self) -> Any:
        self.loads += 1
        return self.material.load()


def test_a_half_rotated_identity_keeps_the_previous_one(pki: Pki, device: DeviceFiles) -> None:
    """A new certificate whose key has not arrived yet is not usable: the old identity stays
    in use, the broken files are re-read only after a pause, and used once complete."""
    now = [0.0]
    rotated = issue_client_svid(pki.ca, WFM, CLIENT)
    material = Counting(device.material())
    transport = IdentityTransport(material, clock=lambda: now[0])
    close = {"Connection": "close"}  # a new handshake per request shows the SVID in use
    with serving(pki.server()) as wfm, \
            httpx.Client(base_url=wfm.url, transport=transport, timeout=10) as client:
        replace_file(device.cert, rotated.cert_pem)  # the key is still the old one
        client.get("/", headers=close)
        client.get("/", headers=close)
        assert material.loads == 2  # the start, and one attempt at the broken files
        now[0] = 10.0
        client.get("/", headers=close)
        assert material.loads == 3
        replace_file(device.key, rotated.key_pem)
        client.get("/", headers=close)
    assert [c.client_serial for c in wfm.connections] == [pki.client.cert.serial_number] * 3 + [
        rotated.cert.serial_number]
    assert transport.reloads == 1 and material.loads == 4


# --- unusable identities are refused at start --------------------------------------------------


def _bad_identities(pki: Pki) -> dict[str, Callable[[DeviceFiles], None]]:
    now = dt.datetime.now(dt.UTC)

    def svid(**kwargs: Any) -> Callable[[DeviceFiles], None]:
        spiffe = kwargs.pop("spiffe", CLIENT_ID)
        return lambda files: files.put_svid(issue_svid(pki.ca, spiffe, **kwargs))

    return {
        "expired": svid(not_before=now - 3 * HOUR, not_after=now - HOUR),
        "not yet valid": svid(not_before=now + HOUR, not_after=now + 3 * HOUR),
        "CA-flagged": svid(ca_flag=True),
        "two URI SANs": svid(extra_uris=[f"spiffe://{TD}/x"]),
        "not a client ID": svid(spiffe=f"spiffe://{TD}/workload/api"),
        "key does not match": lambda files: replace_file(
            files.key, issue_client_svid(pki.ca, WFM, CLIENT).key_pem),
        "empty trust bundle": lambda files: replace_file(files.bundle, b""),
        "JWK bundle without x509 keys": lambda files: replace_file(files.bundle, json.dumps(
            {"spiffe_sequence": 1, "keys": [{"use": "jwt-svid", "kty": "EC"}]}).encode()),
        "missing certificate": lambda files: files.cert.unlink(),
        "not PEM": lambda files: replace_file(files.cert, b"hello"),
    }


BAD = ["expired", "not yet valid", "CA-flagged", "two URI SANs", "not a client ID",
       "key does not match", "empty trust bundle", "JWK bundle without x509 keys",
       "missing certificate", "not PEM"]


@pytest.mark.parametrize("case", BAD)
def test_an_unusable_identity_is_refused_at_start(pki: Pki, device: DeviceFiles,
                                                   case: str) -> None:
    _bad_identities(pki)[case](device)
    with pytest.raises(IdentityError):
        IdentityTransport(device.material())


def test_a_jwk_set_trust_bundle_works(pki: Pki, device: DeviceFiles) -> None:
    import base64

    der = pki.ca.root.public_bytes(Encoding.DER)
    replace_file(device.bundle, json.dumps({"spiffe_sequence": 3, "keys": [
        {"use": "jwt-svid", "kty": "EC"},
        {"use": "x509-svid", "kty": "EC", "x5c": [base64.b64encode(der).decode()]}]}).encode())
    with serving(pki.server()) as wfm, mtls_client(device.material(), wfm.url) as client:
        assert client.get("/").status_code == 200


def test_a_name_not_forming_a_wfm_id_is_refused(device: DeviceFiles) -> None:
    with pytest.raises(IdentityError, match="cannot form"):
        device.material(wfm_id="..").load()


# --- server-only TLS (rc.2 and development over https) -----------------------------------------


def test_server_trust_checks_the_chain_and_the_host_name(pki: Pki, tmp_path: Path) -> None:
    """Without an SVID the client checks the server as any HTTPS client does (chain and host
    name). The test server only asks for a client certificate here."""
    bundle = write_pem(tmp_path / "ca.pem", pki.ca.root)
    context = pki.server()
    context.verify_mode = ssl.CERT_OPTIONAL
    with serving(context) as wfm:
        for base in (wfm.url, wfm.url.replace("127.0.0.1", "localhost")):
            with httpx.Client(base_url=base, transport=IdentityTransport(ServerTrust(bundle)),
                              timeout=10) as client:
                assert client.get("/").status_code == 200
        nameless = issue_wfm_svid(pki.ca, WFM, dns_names=(), ip_addresses=())
        wfm.context = server_context(pki.directory, nameless, [pki.ca])
        wfm.context.verify_mode = ssl.CERT_OPTIONAL
        with httpx.Client(base_url=wfm.url, transport=IdentityTransport(ServerTrust(bundle)),
                          timeout=10) as client, \
                pytest.raises(httpx.ConnectError, match="IP address mismatch"):
            client.get("/")


# --- the device kit's negative fixtures (README section 3) over mTLS ---------------------------

DOCUMENT = f"""\
id: 6f9619ff-8b86-4d01-b42d-00cf4fc964ff
metadata: {{name: kit-app, namespace: margo-kit, deviceId: {DEVICE}}}
spec:
  applicationId: kit-app
  deploymentProfile:
    type: helm
    components:
      - name: kit-chart
        properties: {{repository: "oci://127.0.0.1:5000/charts/kit-chart", revision: 1.0.0}}
""".encode()
DEPLOYMENT_ID = "6f9619ff-8b86-4d01-b42d-00cf4fc964ff"


class KitWfm:
    """The kit's mock WFM, reduced to what a fixture needs: a manifest it can bend and the
    content-addressed documents behind it."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.manifest: dict[str, Any] = {}
        self.capabilities: list[bytes] = []

    def publish(self, version: int, documents: list[bytes], *, bundle: bool = True) -> None:
        refs = []
        for document in documents:
            url = f"/api/v1/deployments/{DEPLOYMENT_ID}/{digest_of(document)}"
            self.files[url] = document
            refs.append({"deploymentId": DEPLOYMENT_ID, "digest": digest_of(document),
                         "url": url, "sizeBytes": len(document)})
        archive = deterministic_targz({f"{i}.yaml": d for i, d in enumerate(documents)})
        bundle_ref = None
        if documents and bundle:
            url = f"/api/v1/bundles/{digest_of(archive)}"
            self.files[url] = archive
            bundle_ref = {"mediaType": "application/vnd.margo.bundle.v1+tar+gzip",
                          "digest": digest_of(archive), "url": url, "sizeBytes": len(archive)}
        self.manifest = {"manifestVersion": version, "bundle": bundle_ref, "deployments": refs}

    def __call__(self, method: str, path: str, body: bytes) -> Answer:
        if method == "PUT" and path.startswith("/api/v1/capabilities/"):
            self.capabilities.append(body)
            return 201, {"Content-Type": "application/json"}, b'{"status":"received"}'
        if method == "POST" and path.endswith("/status"):
            return 200, {"Content-Type": "application/json"}, b'{"acknowledgement":"received"}'
        if path == "/api/v1/deployments":
            data = json.dumps(self.manifest).encode()
            return 200, {"Content-Type": "application/vnd.margo.manifest.v1+json",
                         "ETag": f'"{digest_of(data)}"', "Cache-Control": "private"}, data
        if path in self.files:
            return 200, {"ETag": f'"{path.rsplit("/", 1)[1]}"'}, self.files[path]
        return 404, {"Content-Type": "application/problem+json"}, b'{"title":"Not Found"}'


@pytest.fixture
def kit(pki: Pki) -> Iterator[tuple[KitWfm, TlsServer]]:
    app = KitWfm()
    with serving(pki.server(), app) as wfm:
        yield app, wfm


def test_kit_wrong_size_bytes_is_not_used_for_integrity(kit: tuple[KitWfm, TlsServer],
                                                        device: DeviceFiles) -> None:
    """WrongSizeBytes (MI-025/026): sizeBytes is advisory; the digests decide. The client
    neither refuses nor truncates on it: it does not read sizeBytes at all."""
    app, wfm = kit
    app.publish(1, [DOCUMENT])
    app.manifest["bundle"]["sizeBytes"] = 3
    app.manifest["deployments"][0]["sizeBytes"] = len(DOCUMENT) * 1000
    with mtls_client(device.material(), wfm.url) as client:
        state = RestSource(client, device_id=DEVICE).fetch(Adopted())
    assert state is not None and state.manifest_version == 1
    assert [d.document for d in state.deployments] == [DOCUMENT]
    assert [p for _, p, _ in wfm.requests()][1].startswith("/api/v1/bundles/")


def test_kit_unsupported_digest_algorithm_on_the_bundle(kit: tuple[KitWfm, TlsServer],
                                                        device: DeviceFiles) -> None:
    """UnsupportedDigestAlgorithm (MI-008) for the bundle (test_rest_source covers it for a
    deployment): the manifest is invalid and nothing it names is fetched."""
    app, wfm = kit
    app.publish(1, [DOCUMENT])
    app.manifest["bundle"]["digest"] = "sha512:" + "ab" * 64
    with mtls_client(device.material(), wfm.url) as client, \
            pytest.raises(IntegrityError) as raised:
        RestSource(client).fetch(Adopted())
    assert raised.value.code == "INVALID_MANIFEST" and "sha512" in raised.value.message
    assert [p for _, p, _ in wfm.requests()] == ["/api/v1/deployments"]


def test_kit_untrusted_ca_listener_is_refused(pki: Pki, device: DeviceFiles) -> None:
    """The kit's :3002 listener (MI-018): a WFM certificate from a CA outside the bundle."""
    app = KitWfm()
    app.publish(1, [DOCUMENT])
    rogue = server_context(pki.directory, issue_wfm_svid(pki.rogue, WFM), [pki.ca])
    with serving(rogue, app) as wfm, mtls_client(device.material(), wfm.url) as client, \
            pytest.raises(SourceError) as raised:
        RestSource(client).fetch(Adopted())
    assert raised.value.code == "UNREACHABLE" and "CERTIFICATE_VERIFY_FAILED" in str(raised.value)
    assert not any(c.request_bytes for c in wfm.connections)


# --- the assembled device client ---------------------------------------------------------------


def write_config(directory: Path, server_url: str, **identity: Any) -> Path:
    doc = {
        "device": {"id": DEVICE},
        "server": {"url": server_url, "api": "rc.3", "timeout": "10s"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "render"},
        "dataDir": "data",
        "identity": {"svid": {"cert": "svid.pem", "key": "svid-key.pem"},
                     "trustBundle": "bundle.pem", **identity},
        "capabilities": {"host": {"vendor": "ACME", "modelNumber": "X1", "serialNumber": "7"}},
        "schedule": {"interval": "1s"},
    }
    path = directory / "device.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_the_device_client_uses_its_svid_and_never_rolls_back(
        kit: tuple[KitWfm, TlsServer], device: DeviceFiles, tmp_path: Path) -> None:
    """`margo device` as assembled from its configuration: capabilities and the manifest go
    over mTLS with the SVID (no bearer token, the client id taken from the SVID); the kit's
    NonIncreasingManifestVersion (MI-010) is refused and the adopted state kept."""
    app, wfm = kit
    app.publish(2, [])
    config = load_config(write_config(tmp_path, wfm.url))
    assert config.token_file is None and config.client_id == ""
    with open_reconciler(config) as reconciler:
        first = reconciler.cycle()
        assert (first.fetched, first.version, first.failures) == ("adopted", "2", [])
        app.publish(1, [])
        second = reconciler.cycle()
        assert second.fetched == "rejected" and "not newer" in second.failures[0]
        assert reconciler.state.adopted().manifest_version == 2
    assert json.loads(app.capabilities[0])["properties"]["id"] == DEVICE
    assert {c.client_spiffe for c in wfm.connections} == {CLIENT_ID}
    assert not any("authorization" in h for c in wfm.connections for h in c.headers)


def test_the_device_client_does_not_start_with_an_unusable_identity(
        pki: Pki, device: DeviceFiles, tmp_path: Path) -> None:
    device.put_svid(issue_svid(pki.ca, f"spiffe://{TD}/margo/wfm/{WFM}"))  # the WFM's shape
    config = load_config(write_config(tmp_path, "https://127.0.0.1:9"))
    with pytest.raises(IdentityError, match="not a Margo client ID"), open_reconciler(config):
        pass


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "where", "words"), [
    ({"server": {"url": "http://127.0.0.1:1", "api": "rc.3"}}, "$.server.url", "https://"),
    ({"server": {"url": "https://h", "api": "rc.2"}}, "$.identity.svid", "rc.3"),
    ({"identity": {"svid": {"cert": "a", "key": "b"}}}, "$.identity", "trustBundle"),
    ({"server": {"url": "https://h", "clientId": "c"}}, "$.server.clientId", "SVID"),
    ({"server": {"url": "https://h", "tokenFile": "t"}}, "$.server.tokenFile", "development"),
    ({"identity": {"trustBundle": "b", "wfmId": "w"}}, "$.identity.wfmId", "svid"),
    ({"identity": {"svid": {"cert": "a"}, "trustBundle": "b"}}, "$.identity.svid", "key"),
])
def test_identity_configuration_problems_are_located(tmp_path: Path, change: dict[str, Any],
                                                     where: str, words: str) -> None:
    path = write_config(tmp_path, "https://h")
    doc = json.loads(path.read_text())
    doc.update(change)
    path.write_text(json.dumps(doc))
    with pytest.raises(DocumentError) as raised:
        load_config(path)
    problems = [p for p in raised.value.problems if p.json_path == where]
    assert problems and words in problems[0].message, raised.value.problems
