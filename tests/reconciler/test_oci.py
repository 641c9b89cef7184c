"""The OCI Distribution client against a real registry (docker-registry on loopback).

Network faults and hostile registries are simulated by a small real HTTP proxy in front of
the registry: it can tamper with bytes in flight, redirect blob downloads and demand bearer
or basic authentication, the way registries and the networks between them do.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python
import httpx
import pytest
from kits.stubserver import serving

from margo.digests import digest_of
from reconciler.errors import ApplyError
from reconciler.oci import (
    COMPOSE_ARTIFACT_TYPE,
    COMPOSE_LAYER_MEDIA_TYPE,
    EMPTY_CONFIG_MEDIA_TYPE,
    OCI_INDEX,
    OCI_MANIFEST,
    OciClient,
    parse_reference,
)

ARCHIVE = b"pretend this is a tar.gz " * 100


# --------------------------------------------------------------------------- a real proxy


@dataclass
class Behaviour:
    """What the proxy does to the traffic it forwards."""

    tamper_manifest: Callable[[bytes], bytes] | None = None
    tamper_blob: Callable[[bytes], bytes] | None = None
    redirect_blobs: bool = False
    auth: str | None = None  # None, "bearer" or "basic"
    users: dict[str, str] = field(default_factory=dict)  # required by basic / the token service
    token: str = "t0k3n"
    seen: list[tuple[str, str]] = field(default_factory=list)


class Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, behaviour: Behaviour) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.upstream = upstream
        self.behaviour = behaviour
        self.client = httpx.Client()  # shared by the handler threads

    def server_close(self) -> None:
        super().server_close()
        self.client.close()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Proxy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.handle_read(head=True)

    def do_GET(self) -> None:
        self.handle_read(head=False)

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              *, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def basic_ok(self) -> bool:
        users = self.server.behaviour.users
        return any(self.headers.get("Authorization") == "Basic " + base64.b64encode(
            f"{u}:{p}".encode()).decode() for u, p in users.items())

    def authorized(self) -> bool:
        behaviour = self.server.behaviour
        if behaviour.auth == "bearer":
            return self.headers.get("Authorization") == f"Bearer {behaviour.token}"
        if behaviour.auth == "basic":
            return self.basic_ok()
        return True

    def challenge(self) -> dict[str, str]:
        if self.server.behaviour.auth == "basic":
            return {"WWW-Authenticate": 'Basic realm="proxy"'}
        return {"WWW-Authenticate": f'Bearer realm="http://{self.server.host}/token",'
                                    'service="proxy-registry"'}

    def handle_read(self, *, head: bool) -> None:
        behaviour = self.server.behaviour
        behaviour.seen.append((self.command, self.path))
        if self.path.startswith("/token"):
            if behaviour.users and not self.basic_ok():
                self.reply(401, b'{"errors":[{"code":"DENIED","message":"bad credentials"}]}')
                return
            self.reply(200, json.dumps({"token": behaviour.token}).encode(),
                       {"Content-Type": "application/json"})
            return
        if not self.authorized():
            self.reply(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"authenticate"}]}',
                       self.challenge(), head=head)
            return
        path = self.path
        is_blob = "/blobs/" in path
        if is_blob and behaviour.redirect_blobs and not path.startswith("/_moved"):
            self.reply(307, headers={"Location": f"/_moved{path}"}, head=head)
            return
        path = path.removeprefix("/_moved")
        accept = {"Accept": self.headers["Accept"]} if self.headers.get("Accept") else {}
        upstream = self.server.client.request(
            self.command, f"http://{self.server.upstream}{path}", headers=accept)
        body = upstream.content
        tamper = behaviour.tamper_blob if is_blob else behaviour.tamper_manifest
        if tamper and upstream.status_code == 200 and not head:
            body = tamper(body)
        headers = {k: upstream.headers[k] for k in ("Content-Type", "Docker-Content-Digest")
                   if k in upstream.headers}
        if head:
            headers["Content-Length"] = upstream.headers.get("Content-Length", "0")
        self.reply(upstream.status_code, body, headers, head=head)


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


@pytest.fixture
def proxy(registry: str, behaviour: Behaviour) -> Iterator[str]:
    """`host:port` of a proxy in front of the session registry, doing `behaviour`."""
    with serving(server=Proxy(registry, behaviour), poll_interval=0.01) as server:
        yield server.host


@pytest.fixture
def oci() -> Iterator[OciClient]:
    with OciClient(timeout=10.0) as client:
        yield client


def put_raw(registry: str, name: str, reference: str, manifest: dict[str, Any],
            blobs: list[bytes]) -> str:
    """Store blobs and a hand-written manifest with plain HTTP calls (shapes our client
    would never push)."""
    with httpx.Client(base_url=f"http://{registry}") as client:
        for blob in blobs:
            start = client.post(f"/v2/{name}/blobs/uploads/")
            location = httpx.URL(start.headers["Location"]).copy_merge_params(
                {"digest": digest_of(blob)})
            assert client.put(location, content=blob).status_code == 201
        body = json.dumps(manifest).encode()
        response = client.put(f"/v2/{name}/manifests/{reference}", content=body,
                              headers={"Content-Type": manifest["mediaType"]})
        assert response.status_code == 201, response.text
    return digest_of(body)


def descriptor(media_type: str, blob: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest_of(blob), "size": len(blob)}


# --------------------------------------------------------------------------- round trips


def test_a_pushed_compose_artifact_resolves_and_pulls_verified(registry: str,
                                                               oci: OciClient) -> None:
    repository = f"oci://{registry}/compose/round-trip"
    digest = oci.push_artifact(repository, "1.0.0", ARCHIVE)

    resolved = oci.resolve(repository, "1.0.0")
    assert (resolved.digest, resolved.media_type) == (digest, OCI_MANIFEST)

    artifact = oci.pull(repository, "1.0.0")
    assert artifact.data == ARCHIVE
    assert artifact.manifest.digest == digest
    assert artifact.artifact_type == COMPOSE_ARTIFACT_TYPE
    assert (artifact.layer.media_type, artifact.layer.digest, artifact.layer.size) == (
        COMPOSE_LAYER_MEDIA_TYPE, digest_of(ARCHIVE), len(ARCHIVE))
    assert artifact.layer.annotations == {"org.margo.component.type": "compose",
                                          "org.margo.component.version": "1.0.0"}
    assert oci.fetch_artifact(repository, digest) == ARCHIVE  # by digest, too


def test_the_pushed_manifest_has_the_spec_shape(registry: str, oci: OciClient) -> None:
    repository = f"oci://{registry}/compose/shape"
    digest = oci.push_artifact(repository, "2.0.1", ARCHIVE)
    raw = httpx.get(f"http://{registry}/v2/compose/shape/manifests/{digest}",
                    headers={"Accept": OCI_MANIFEST})
    assert digest_of(raw.content) == digest
    manifest = raw.json()
    assert manifest["mediaType"] == OCI_MANIFEST
    assert manifest["artifactType"] == COMPOSE_ARTIFACT_TYPE
    assert manifest["config"] == {"mediaType": EMPTY_CONFIG_MEDIA_TYPE, "size": 2,
                                  "digest": digest_of(b"{}")}
    assert [layer["mediaType"] for layer in manifest["layers"]] == [COMPOSE_LAYER_MEDIA_TYPE]


def test_a_chart_pushed_by_helm_resolves_and_pulls(registry: str, oci: OciClient,
                                                   tmp_path: Path) -> None:
    chart = tmp_path / "interop"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: interop\nversion: 0.3.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: {{ .Release.Name }}}\n")
    package = helm_python.package(chart, destination=tmp_path)
    helm_python.push(package, f"oci://{registry}/charts", plain_http=True)

    resolved = oci.resolve(f"oci://{registry}/charts/interop", "0.3.0")
    raw = httpx.get(f"http://{registry}/v2/charts/interop/manifests/0.3.0",
                    headers={"Accept": OCI_MANIFEST})
    assert resolved.digest == digest_of(raw.content)
    archive = oci.fetch_artifact(f"oci://{registry}/charts/interop", "0.3.0")
    assert archive == Path(package).read_bytes()
    loaded = helm_python.Chart.load_archive(archive)
    try:
        assert (loaded.name, loaded.version) == ("interop", "0.3.0")
    finally:
        loaded.close()


def test_the_single_tar_gzip_layer_is_chosen_among_several(registry: str,
                                                           oci: OciClient) -> None:
    notes = b"release notes"
    config = b"{}"
    put_raw(registry, "compose/multi", "1.0.0", {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": descriptor(EMPTY_CONFIG_MEDIA_TYPE, config),
        "layers": [descriptor("text/markdown", notes),
                   descriptor(COMPOSE_LAYER_MEDIA_TYPE, ARCHIVE)]}, [config, notes, ARCHIVE])
    assert oci.fetch_artifact(f"oci://{registry}/compose/multi", "1.0.0") == ARCHIVE


# --------------------------------------------------------------------------- failures


def failure(call: Callable[[], object]) -> ApplyError:
    with pytest.raises(ApplyError) as caught:
        call()
    return caught.value


def test_a_missing_tag_or_repository_is_a_retryable_pull_failure(registry: str,
                                                                  oci: OciClient) -> None:
    oci.push_artifact(f"oci://{registry}/compose/present", "1.0.0", ARCHIVE)
    for repository, tag in [("compose/present", "9.9.9"), ("compose/absent", "1.0.0")]:
        error = failure(lambda r=repository, t=tag: oci.pull(f"oci://{registry}/{r}", t))
        assert (error.code, error.retryable) == ("PULL_FAILED", True)
        assert "HTTP 404" in error.message and "MANIFEST_UNKNOWN" in error.message


def test_an_unreachable_registry_is_a_retryable_pull_failure(oci: OciClient) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        error = failure(lambda: oci.pull(f"oci://127.0.0.1:{port}/compose/x", "1.0.0"))
    assert (error.code, error.retryable) == ("PULL_FAILED", True)
    assert "ConnectError" in error.message


@pytest.mark.parametrize(("repository", "reference"), [
    ("oci://127.0.0.1:5000/Upper/case", "1.0.0"),
    ("oci://127.0.0.1:5000/a?b=c", "1.0.0"),
    ("oci://127.0.0.1:5000", "1.0.0"),
    ("oci://user@host/x", "1.0.0"),
    ("oci://127.0.0.1:5000/ok", "../../v2/_catalog"),
    ("oci://127.0.0.1:5000/ok", "sha256:abc"),
    ("oci://127.0.0.1:5000/ok", "md5:" + "0" * 32),
])
def test_malformed_coordinates_are_refused_without_retry(repository: str,
                                                         reference: str) -> None:
    error = failure(lambda: parse_reference(repository, reference))
    assert (error.code, error.retryable) == ("PULL_FAILED", False)


def test_an_archive_over_the_size_limit_is_not_downloaded(proxy: str, behaviour: Behaviour,
                                                          registry: str,
                                                          oci: OciClient) -> None:
    oci.push_artifact(f"oci://{registry}/compose/big", "1.0.0", ARCHIVE)
    error = failure(lambda: oci.pull(f"oci://{proxy}/compose/big", "1.0.0",
                                     max_bytes=len(ARCHIVE) - 1))
    assert (error.code, error.retryable) == ("PULL_FAILED", False)
    assert not [path for _, path in behaviour.seen if "/blobs/" in path]


def test_artifacts_that_are_not_one_archive_are_invalid_packages(registry: str,
                                                                 oci: OciClient) -> None:
    config = b"{}"
    compose, env = b"services: {}\n", b"A=1\n"
    # The shape `docker compose publish` produces: one layer per file, no archive.
    layers = [descriptor("application/vnd.docker.compose.file+yaml", compose),
              descriptor("application/vnd.docker.compose.envfile", env)]
    put_raw(registry, "compose/published", "1.0.0", {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.docker.compose.project",
        "config": descriptor(EMPTY_CONFIG_MEDIA_TYPE, config), "layers": layers},
        [config, compose, env])
    error = failure(lambda: oci.pull(f"oci://{registry}/compose/published", "1.0.0"))
    assert (error.code, error.retryable) == ("INVALID_PACKAGE", False)
    assert "expected exactly one archive" in error.message

    inner = oci.push_artifact(f"oci://{registry}/compose/indexed", "inner", ARCHIVE)
    size = len(httpx.get(f"http://{registry}/v2/compose/indexed/manifests/{inner}",
                         headers={"Accept": OCI_MANIFEST}).content)
    put_raw(registry, "compose/indexed", "1.0.0", {
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": inner, "size": size}]}, [])
    error = failure(lambda: oci.pull(f"oci://{registry}/compose/indexed", "1.0.0"))
    assert (error.code, error.retryable) == ("INVALID_PACKAGE", False)
    assert OCI_INDEX in error.message


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


@pytest.mark.parametrize("tamper", [flip_last_byte, lambda d: d + b"!", lambda d: d[:-1]],
                         ids=["a flipped byte", "an extra byte", "a missing byte"])
def test_a_blob_altered_in_flight_is_a_digest_mismatch(
        proxy: str, behaviour: Behaviour, registry: str, oci: OciClient,
        tamper: Callable[[bytes], bytes]) -> None:
    oci.push_artifact(f"oci://{registry}/compose/tampered", "1.0.0", ARCHIVE)
    behaviour.tamper_blob = tamper
    error = failure(lambda: oci.pull(f"oci://{proxy}/compose/tampered", "1.0.0"))
    assert (error.code, error.retryable) == ("DIGEST_MISMATCH", False)
    assert digest_of(ARCHIVE) in error.message or str(len(ARCHIVE)) in error.message


def test_a_manifest_altered_in_flight_is_a_digest_mismatch(
        proxy: str, behaviour: Behaviour, registry: str, oci: OciClient) -> None:
    digest = oci.push_artifact(f"oci://{registry}/compose/forged", "1.0.0", ARCHIVE)
    other = b"a different, attacker-chosen archive"
    oci.push_artifact(f"oci://{registry}/compose/forged", "evil", other)

    def swap_layer(body: bytes) -> bytes:  # point the manifest at the other blob
        return body.replace(digest_of(ARCHIVE).encode(), digest_of(other).encode()).replace(
            f'"size":{len(ARCHIVE)}'.encode(), f'"size":{len(other)}'.encode())

    behaviour.tamper_manifest = swap_layer
    for reference in ("1.0.0", digest):  # checked against the header, and the reference
        error = failure(lambda r=reference: oci.pull(f"oci://{proxy}/compose/forged", r))
        assert (error.code, error.retryable) == ("DIGEST_MISMATCH", False)


def test_blob_redirects_are_followed(proxy: str, behaviour: Behaviour, registry: str,
                                     oci: OciClient) -> None:
    oci.push_artifact(f"oci://{registry}/compose/moved", "1.0.0", ARCHIVE)
    behaviour.redirect_blobs = True
    assert oci.fetch_artifact(f"oci://{proxy}/compose/moved", "1.0.0") == ARCHIVE
    assert any(path.startswith("/_moved/") for _, path in behaviour.seen)


def test_verified_blobs_are_cached_but_tags_are_resolved_again(
        proxy: str, behaviour: Behaviour, registry: str, oci: OciClient) -> None:
    repository = f"oci://{registry}/compose/cached"
    oci.push_artifact(repository, "1.0.0", ARCHIVE)
    for _ in range(2):
        assert oci.fetch_artifact(f"oci://{proxy}/compose/cached", "1.0.0") == ARCHIVE
    blob_gets = [p for m, p in behaviour.seen if m == "GET" and "/blobs/" in p]
    manifest_gets = [p for m, p in behaviour.seen if m == "GET" and "/manifests/" in p]
    assert (len(blob_gets), len(manifest_gets)) == (1, 2)

    oci.push_artifact(repository, "1.0.0", b"the tag moved")  # re-tagged upstream
    assert oci.fetch_artifact(f"oci://{proxy}/compose/cached", "1.0.0") == b"the tag moved"


# --------------------------------------------------------------------------- authentication


def test_anonymous_bearer_tokens_are_fetched_once_and_reused(
        proxy: str, behaviour: Behaviour, registry: str, oci: OciClient) -> None:
    oci.push_artifact(f"oci://{registry}/compose/private", "1.0.0", ARCHIVE)
    behaviour.auth = "bearer"
    for _ in range(2):
        assert oci.fetch_artifact(f"oci://{proxy}/compose/private", "1.0.0") == ARCHIVE
    token_requests = [p for _, p in behaviour.seen if p.startswith("/token")]
    assert len(token_requests) == 1
    assert "scope=repository%3Acompose%2Fprivate%3Apull" in token_requests[0]
    assert "service=proxy-registry" in token_requests[0]


def test_bearer_tokens_can_require_credentials(proxy: str, behaviour: Behaviour,
                                               registry: str) -> None:
    with OciClient() as seed:
        seed.push_artifact(f"oci://{registry}/compose/members", "1.0.0", ARCHIVE)
    behaviour.auth, behaviour.users = "bearer", {"device": "s3cret"}
    with OciClient() as anonymous:
        error = failure(lambda: anonymous.pull(f"oci://{proxy}/compose/members", "1.0.0"))
    assert (error.code, error.retryable) == ("PULL_FAILED", True)
    assert "DENIED" in error.message
    with OciClient(credentials={proxy: ("device", "s3cret")}) as member:
        assert member.fetch_artifact(f"oci://{proxy}/compose/members", "1.0.0") == ARCHIVE


def test_basic_authentication_uses_the_configured_credentials(
        proxy: str, behaviour: Behaviour, registry: str) -> None:
    with OciClient() as seed:
        seed.push_artifact(f"oci://{registry}/compose/basic", "1.0.0", ARCHIVE)
    behaviour.auth, behaviour.users = "basic", {"device": "s3cret"}
    repository = f"oci://{proxy}/compose/basic"
    for credentials, expected in [(None, "none are configured"),
                                  ({proxy: ("device", "wrong")}, "refused our credentials")]:
        with OciClient(credentials=credentials) as client:
            error = failure(lambda c=client: c.pull(repository, "1.0.0"))
        assert error.code == "PULL_FAILED" and expected in error.message
    with OciClient(credentials={proxy: ("device", "s3cret")}) as client:
        assert client.fetch_artifact(repository, "1.0.0") == ARCHIVE
