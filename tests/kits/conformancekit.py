"""What the conformance tests set up around the kit: `margo serve` with TLS material on
loopback, cert dirs in the kit's layout, a fleet source with the operator's assignments the
kit's scenarios wait for, and the kit's application package pushed to a real registry in the
Margo layout. Imported by bare name (`from conformancekit import ...`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from conformance.runner import Rc2Identity, SuiteReport
from kits.balancer import tcp_balancing
from kits.pgkit import database_for
from kits.processkit import free_port, stop, wait_until_ready
from kits.serverkit import REPLICAS, STORE
from kits.stubserver import serving
from margo.canonical import canonical_yaml
from margo.digests import digest_of

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "conformance"
A1_SUITE = FIXTURES / "wfm-supplier.json"
HEADER_INTEGRITY = FIXTURES / "header-integrity.json"
MULTI_COMPONENT = FIXTURES / "multi-component-deployment.json"
ORAS_CHECKS = FIXTURES / "oras-media-type-checks.json"
B1_COLLECTION = FIXTURES / "wfm-core" / "postman_collection.json"
PACKAGE_DIR = FIXTURES / "margo-ctt-package"
# The kit's own placeholder MIAF identities, copied verbatim (they expire: the test that uses
# them skips with the date once they do); MARGO_CONFORMANCE_KIT points at another kit copy.
KIT_MIAF = (Path(os.environ["MARGO_CONFORMANCE_KIT"]) / "wfm-supplier" / "fixtures" / "miaf"
            if "MARGO_CONFORMANCE_KIT" in os.environ else FIXTURES / "miaf")

APP_ARTIFACT_TYPE = "application/vnd.margo.app.v1+json"
DESCRIPTION_MEDIA_TYPE = "application/vnd.margo.app.description.v1+yaml"
EMPTY_CONFIG = (b"{}", "application/vnd.oci.empty.v1+json")
_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".md": "markdown", ".txt": "plain",
            ".pdf": "pdf"}

# The operator's side of the multi-component scenario (the kit's
# fixtures/multi-component-app-deployment.yaml, as an application and an intent here): a
# compose application with one `wait: true` and one `wait: false` component.
MULTI_COMPONENT_APP: dict[str, Any] = {
    "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription",
    "id": "cts-multi-component-app",
    "metadata": {"name": "CTS multi-component", "version": "1.0.0",
                 "catalog": {"organization": [{"name": "Margo CTS"}]}},
    "deploymentProfiles": [{"type": "compose", "id": "cts-compose", "components": [
        {"name": "wait-true-component", "properties": {
            "repository": "oci://registry.example.com/cts/wait-true-component",
            "revision": "1.0.0", "wait": True}},
        {"name": "wait-false-component", "properties": {
            "repository": "oci://registry.example.com/cts/wait-false-component",
            "revision": "1.0.0", "wait": False}}]}],
}


def fleet_source(directory: Path, assignments: Mapping[str, str]) -> Path:
    """A fleet source assigning the multi-component application to devices
    (`{intent name: device id}`), as an operator does while the kit polls."""
    app_dir = directory / "apps" / MULTI_COMPONENT_APP["id"]
    app_dir.mkdir(parents=True, exist_ok=True)
    (directory / "deployments").mkdir(exist_ok=True)
    (app_dir / "margo.yaml").write_bytes(canonical_yaml(MULTI_COMPONENT_APP))
    for name, device in assignments.items():
        intent = {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
                  "metadata": {"name": name},
                  "spec": {"application": {"id": MULTI_COMPONENT_APP["id"]},
                           "targets": {"devices": [device]}}}
        (directory / "deployments" / f"{name}.yaml").write_bytes(canonical_yaml(intent))
    return directory


def write_rc2_identity(directory: Path) -> Rc2Identity:
    """`device.key` + `device-cert.pem` in a cert dir (what the kit's runner generates)."""
    identity = Rc2Identity.generate()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "device.key").write_bytes(identity.key.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (directory / "device-cert.pem").write_bytes(identity.certificate_pem)
    return identity


def margo(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The real command line (`python -m margo_cli.main`), from the repository root; on
    the `replicas` store, `margo clients … --data D` writes to D's PostgreSQL database."""
    if STORE[0] == "replicas" and args[:1] == ("clients",) and "--data" in args:
        data = Path(args[args.index("--data") + 1])
        args = (*args, "--database", database_for(data))
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, check=check, timeout=120)


def _probe_context(client: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # readiness only; the tests check identity elsewhere
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


@contextmanager
def running_wfm(data: Path, *args: str,
                probe: tuple[Path, Path] | None = None) -> Iterator[str]:
    """`margo serve` with these options on a free loopback port; yields its base URL (https
    when `--tls-cert` is among the options) once `/healthz` answers (presenting `probe`, a
    client certificate, when the server requires one); SIGTERM afterwards. On the
    `replicas` store (`kits.serverkit.use_store`): two replicas on the data directory's
    PostgreSQL database behind a TCP balancer that sends each connection to the next one
    (TLS passes through, so each replica sees the client's certificate)."""
    if STORE[0] != "replicas":
        with _one_wfm(data, *args, probe=probe) as (base, _port):
            yield base
        return
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(_one_wfm(
            data / f"replica-{i}", *args, "--database", database_for(data), probe=probe))[1]
            for i in range(REPLICAS)]
        balancer = stack.enter_context(tcp_balancing([("127.0.0.1", p) for p in ports]))
        scheme = "https" if "--tls-cert" in args else "http"
        yield f"{scheme}://127.0.0.1:{balancer.port}"


@contextmanager
def _one_wfm(data: Path, *args: str,
             probe: tuple[Path, Path] | None = None) -> Iterator[tuple[str, int]]:
    port = free_port()
    data.parent.mkdir(parents=True, exist_ok=True)
    log_path = data.parent / f"server-{port}.log"
    scheme = "https" if "--tls-cert" in args else "http"
    base = f"{scheme}://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--data", str(data), "--log-level", "warning", *args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(verify=_probe_context(probe), timeout=2) as http:
                wait_until_ready(process, lambda: http.get(f"{base}/healthz")
                                 .status_code == 200, "server", log_path,
                                 not_yet=(httpx.HTTPError,))
            yield base, port
        finally:
            stop(process)


def valid_now(*pem_files: Path) -> str | None:
    """None when every certificate is valid now, else why not (with the dates)."""
    now = dt.datetime.now(dt.UTC)
    for path in pem_files:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return (f"{path.name} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
                    f"{cert.not_valid_after_utc:%Y-%m-%d}, not on {now:%Y-%m-%d}")
    return None


def report_line(report: SuiteReport, label: str) -> str:
    """The summary the closing note quotes, printed by the tests (`pytest -s` shows it)."""
    line = f"conformance kit {label}: {report.summary()}"
    print(line)
    return line


# --- the application package in the Margo layout ----------------------------------------------


def _media_type(path: str, annotations: Mapping[str, str]) -> str:
    """The spec's layer media types: the description, or `application/vnd.margo.app.
    <resource>.v1+<format>` for a resource named by `org.margo.app.resource`."""
    if path == "margo.yaml":
        return DESCRIPTION_MEDIA_TYPE
    resource = annotations.get("org.margo.app.resource")
    if resource is None:
        raise ValueError(f"{path}: neither the description nor a named resource")
    return f"application/vnd.margo.app.{resource}.v1+{_FORMATS[Path(path).suffix]}"


def _upload_blob(http: httpx.Client, base: str, data: bytes) -> str:
    digest = digest_of(data)
    if http.head(f"{base}/blobs/{digest}").status_code == 200:
        return digest
    start = http.post(f"{base}/blobs/uploads/")
    assert start.status_code == 202, start.text
    location = start.url.join(start.headers["Location"])
    done = http.put(location.copy_merge_params({"digest": digest}), content=data,
                    headers={"Content-Type": "application/octet-stream"})
    assert done.status_code == 201, done.text
    return digest


def push_margo_package(host: str, repository: str, tag: str, package_dir: Path, *,
                       media_types: Mapping[str, str] | None = None,
                       config: tuple[bytes, str] = EMPTY_CONFIG,
                       artifact_type: str = APP_ARTIFACT_TYPE) -> str:
    """Push a package directory as `oras push` with its `annotations.json` would: one layer
    per file with the Margo media type (`media_types` overrides some, for broken packages),
    an empty config, `artifactType` application/vnd.margo.app.v1+json. Returns the manifest
    digest."""
    annotations: dict[str, dict[str, str]] = json.loads(
        (package_dir / "annotations.json").read_text())
    base = f"http://{host}/v2/{repository}"
    overrides = media_types or {}
    with httpx.Client(timeout=30) as http:
        layers = []
        for path, layer_annotations in annotations.items():
            if path == "$manifest":
                continue
            data = (package_dir / path).read_bytes()
            layers.append({"mediaType": overrides.get(path, _media_type(path, layer_annotations)),
                           "digest": _upload_blob(http, base, data), "size": len(data),
                           "annotations": layer_annotations})
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "artifactType": artifact_type,
                    "config": {"mediaType": config[1], "digest": _upload_blob(http, base,
                                                                              config[0]),
                               "size": len(config[0])},
                    "layers": layers, "annotations": annotations.get("$manifest", {})}
        body = json.dumps(manifest, separators=(",", ":")).encode()
        answer = http.put(f"{base}/manifests/{tag}", content=body,
                          headers={"Content-Type": manifest["mediaType"]})
        assert answer.status_code == 201, answer.text
    return digest_of(body)


# --- a scripted HTTP server that records what the runner sends ---------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer_serial: str | None = None  # the verified client certificate's serial, over TLS


Reply = tuple[int, dict[str, str], bytes]


class RecordingServer:
    """A real HTTP server on loopback (stdlib, one thread) whose answers are scripted per
    `METHOD /path`: a fixed reply, or a list of replies served in turn (the last repeats).
    Every request is recorded. With `tls`, it serves HTTPS with that context (which decides
    whether client certificates are asked for). Use as a context manager."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.replies: dict[str, Reply | list[Reply]] = {}
        self.requests: list[Recorded] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                peer = (self.connection.getpeercert()
                        if isinstance(self.connection, ssl.SSLSocket) else None)
                outer.requests.append(Recorded(self.command, self.path, {
                    k.lower(): v for k, v in self.headers.items()}, body,
                    str(peer["serialNumber"]) if peer else None))
                status, headers, payload = outer._reply(f"{self.command} {self.path}")
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "https" if tls else "http"
        self.base = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._serving = serving(server=self._server, tls=tls, poll_interval=0.02)

    def _reply(self, key: str) -> Reply:
        reply = self.replies.get(key, (404, {"Content-Type": "text/plain"}, b"not scripted"))
        if isinstance(reply, list):
            return reply.pop(0) if len(reply) > 1 else reply[0]
        return reply

    def json(self, key: str, status: int, doc: Any, **headers: str) -> None:
        self.replies[key] = (status, {"Content-Type": "application/json", **headers},
                             json.dumps(doc).encode())

    def __enter__(self) -> RecordingServer:
        self._serving.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._serving.__exit__(*exc)
