"""The REST State Manifest source against a real `margo serve` on loopback.

Bad servers are simulated the way they would reach a device: an attacker between device and
server (`Attacker`, an httpx transport that forwards to the real server over real HTTP and
rewrites what comes back), or a tiny real HTTP server answering 429/503.
"""

from __future__ import annotations

import email.utils
import io
import itertools
import json
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from kits.serverkit import free_port
from kits.stubserver import serving

from margo.archive import deterministic_targz
from margo.digests import digest_of
from reconciler.desired import DesiredState
from reconciler.sources import Adopted, IntegrityError, SourceError
from reconciler.sources.rest_source import RestSource

GPU, BOX = "k8s-cluster-gpu", "compose-box-amd64"
_confidence = itertools.count(51)  # 0.51, 0.52, ...: inside the 0.1-0.99 schema


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    """One server for the module: a GPU cluster (4 deployments) and a Compose box (1)."""
    root = tmp_path_factory.mktemp("rest-source")
    with fleet_server(root, fleet=write_fleet(root / "fleet")) as running:
        running.put_capabilities(capabilities(GPU))
        running.put_capabilities(capabilities(BOX))
        running.wait_for_deployments(5)
        yield running


@dataclass
class Requests:
    """Every request a client sends, by path (an httpx event hook)."""

    paths: list[str] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> None:
        self.paths.append(request.url.path)


@contextmanager
def source(server: FleetServer, *, requests: Requests | None = None,
           transport: httpx.BaseTransport | None = None, token: str | None = None,
           **kwargs: Any) -> Iterator[RestSource]:
    """A source on a new device client (closed afterwards: the caller owns the client)."""
    hooks = {"request": [requests]} if requests is not None else {}
    with server.client(token=token, event_hooks=hooks, transport=transport) as http, \
            RestSource(http, **kwargs) as rest:
        yield rest


def adopted_from(state: DesiredState, *, keep: int | None = None,
                 older: bool = False) -> Adopted:
    """What a device stores after adopting `state`, holding only its first `keep` documents
    when given; `older`: as if adopted one manifestVersion earlier, so the served manifest
    is new to it (not a 304) while most of its documents are already held."""
    documents = {d.digest: d.document for d in state.deployments[:keep]}
    if older:
        version = (state.manifest_version or 1) - 1
        return Adopted(version=str(version), manifest_version=version, documents=documents)
    return Adopted(version=state.version, manifest_version=state.manifest_version,
                   etag=state.etag, documents=documents)


def first_sync(server: FleetServer, **kwargs: Any) -> DesiredState:
    with source(server, **kwargs) as rest:
        state = rest.fetch(Adopted())
    assert state is not None
    return state


def change_vision_parameter(server: FleetServer) -> None:
    """A new confidence for vision-plant-a: exactly one document (the GPU's) changes."""
    server.set_parameter("vision-plant-a", "confidence", f"0.{next(_confidence)}")


# --- a network attacker --------------------------------------------------------------------

Rewrite = Callable[[httpx.Request, httpx.Response, bytes], tuple[bytes, dict[str, str]] | None]


class Attacker(httpx.BaseTransport):
    """Forwards every request to the real server over real HTTP, then lets `rewrite` replace
    the body and headers of what comes back. `served` answers chosen paths itself."""

    def __init__(self, rewrite: Rewrite | None = None,
                 served: dict[str, bytes] | None = None) -> None:
        self._real = httpx.HTTPTransport()
        self._rewrite = rewrite
        self.served = served if served is not None else {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.served:
            body = self.served[request.url.path]
            return httpx.Response(200, content=body, headers={"ETag": f'"{digest_of(body)}"'})
        response = self._real.handle_request(request)
        body = response.read()
        response.close()
        replaced = self._rewrite(request, response, body) if self._rewrite else None
        headers = httpx.Headers(response.headers)
        for framing in ("content-length", "content-encoding"):  # body is re-framed below
            headers.pop(framing, None)
        if replaced is not None:
            body, extra = replaced
            for name, value in extra.items():
                headers[name] = value
        return httpx.Response(response.status_code, content=body, headers=headers)

    def close(self) -> None:
        self._real.close()


def manifest_rewrite(change: Callable[[dict[str, Any]], None]) -> Rewrite:
    """A consistent forgery: the manifest is changed and its ETag recomputed to match."""
    def rewrite(request: httpx.Request, response: httpx.Response,
                body: bytes) -> tuple[bytes, dict[str, str]] | None:
        if request.url.path != "/api/v1/deployments" or response.status_code != 200:
            return None
        doc = json.loads(body)
        change(doc)
        forged = json.dumps(doc).encode()
        return forged, {"ETag": f'"{digest_of(forged)}"'}

    return rewrite


def flip_a_byte(path_part: str) -> Rewrite:
    def rewrite(request: httpx.Request, response: httpx.Response,
                body: bytes) -> tuple[bytes, dict[str, str]] | None:
        if path_part not in request.url.path or response.status_code != 200:
            return None
        return body[:-1] + bytes([body[-1] ^ 1]), {}

    return rewrite


# --- the happy paths -----------------------------------------------------------------------


def test_first_sync_reads_the_manifest_and_the_bundle_only(server: FleetServer) -> None:
    requests = Requests()
    state = first_sync(server, requests=requests)
    manifest, etag = server.manifest()
    assert requests.paths == ["/api/v1/deployments", manifest["bundle"]["url"]]
    assert state.source == "margo-rest"
    assert state.manifest_version == manifest["manifestVersion"]
    assert state.version == str(manifest["manifestVersion"])
    assert state.etag == etag and etag.startswith('"sha256:')
    assert [(d.deployment_id, d.digest) for d in state.deployments] == [
        (ref["deploymentId"], ref["digest"]) for ref in manifest["deployments"]]
    assert all(digest_of(d.document) == d.digest for d in state.deployments)
    assert {d.device_id for d in state.deployments} == {GPU, BOX}


def test_an_unchanged_poll_is_one_request_and_returns_none(server: FleetServer) -> None:
    state = first_sync(server)
    requests = Requests()
    with source(server, requests=requests) as rest:
        assert rest.fetch(adopted_from(state)) is None
    assert requests.paths == ["/api/v1/deployments"]


def test_a_changed_parameter_fetches_only_the_changed_document(server: FleetServer) -> None:
    before = first_sync(server)
    change_vision_parameter(server)
    server.wait_for_change(before.etag or "")
    requests = Requests()
    with source(server, requests=requests) as rest:
        after = rest.fetch(adopted_from(before))
    assert after is not None
    assert after.manifest_version is not None and before.manifest_version is not None
    assert after.manifest_version > before.manifest_version
    old, new = before.by_id(), after.by_id()
    assert old.keys() == new.keys()
    changed = [i for i in new if new[i].digest != old[i].digest]
    assert len(changed) == 1 and new[changed[0]].name == "vision-plant-a"
    url = f"/api/v1/deployments/{changed[0]}/{new[changed[0]].digest}"
    assert requests.paths == ["/api/v1/deployments", url]
    assert all(new[i].document == old[i].document for i in new if i not in changed)


def test_the_bundle_is_used_when_most_documents_are_missing(server: FleetServer) -> None:
    state = first_sync(server)
    requests = Requests()
    with source(server, requests=requests) as rest:  # 4 of 5 missing: the bundle
        again = rest.fetch(adopted_from(state, keep=1, older=True))
    assert again is not None and again.by_id().keys() == state.by_id().keys()
    assert len(requests.paths) == 2 and requests.paths[1].startswith("/api/v1/bundles/")
    requests.paths.clear()
    with source(server, requests=requests) as rest:  # 1 of 5 missing: that document
        again = rest.fetch(adopted_from(state, keep=4, older=True))
    assert again is not None
    assert requests.paths == ["/api/v1/deployments",
                              f"/api/v1/deployments/{state.deployments[4].deployment_id}/"
                              f"{state.deployments[4].digest}"]


def test_a_damaged_local_copy_is_fetched_again(server: FleetServer) -> None:
    state = first_sync(server)
    adopted = adopted_from(state, older=True)
    damaged = state.deployments[0]
    documents = {**adopted.documents, damaged.digest: damaged.document + b"# bit rot\n"}
    requests = Requests()
    with source(server, requests=requests) as rest:
        again = rest.fetch(Adopted(version=adopted.version,
                                   manifest_version=adopted.manifest_version,
                                   documents=documents))
    assert again is not None and again.deployments[0].document == damaged.document
    assert requests.paths == ["/api/v1/deployments",
                              f"/api/v1/deployments/{damaged.deployment_id}/{damaged.digest}"]


def test_rc2_paths_give_the_same_state(server: FleetServer) -> None:
    rc3 = first_sync(server)
    requests = Requests()
    rc2 = first_sync(server, requests=requests, prefix=f"/api/v1/clients/{server.client_id}")
    assert [(d.deployment_id, d.digest) for d in rc2.deployments] == [
        (d.deployment_id, d.digest) for d in rc3.deployments]
    assert all(p.startswith(f"/api/v1/clients/{server.client_id}/") for p in requests.paths)


def test_a_client_fronting_several_devices_keeps_only_its_own(server: FleetServer) -> None:
    box = first_sync(server, device_id=BOX)
    assert [(d.name, d.device_id) for d in box.deployments] == [("hello-everywhere", BOX)]
    gpu = first_sync(server, device_id=GPU)
    assert sorted(d.name for d in gpu.deployments) == [
        "ha-web", "hello-everywhere", "line-monitor", "vision-plant-a"]


# --- integrity -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/api/v1/deployments/", "/api/v1/bundles/"])
def test_tampered_bytes_are_refused_and_nothing_is_returned(server: FleetServer,
                                                            target: str) -> None:
    state = first_sync(server)
    adopted = adopted_from(state, keep=4, older=True)  # one document fetched
    if target.endswith("bundles/"):
        adopted = Adopted()  # the first sync reads the bundle
    with source(server, transport=Attacker(flip_a_byte(target))) as rest, \
            pytest.raises(IntegrityError) as raised:
        rest.fetch(adopted)
    assert raised.value.code == "DIGEST_MISMATCH"
    with source(server) as rest:  # the same request without the attacker is fine
        assert rest.fetch(adopted) is not None


def test_a_manifest_that_does_not_match_its_etag_is_refused(server: FleetServer) -> None:
    def retag(request: httpx.Request, response: httpx.Response,
              body: bytes) -> tuple[bytes, dict[str, str]] | None:
        return (body, {"ETag": f'"{digest_of(body + b" ")}"'}) if response.status_code == 200 \
            else None

    with source(server, transport=Attacker(retag)) as rest, \
            pytest.raises(IntegrityError) as raised:
        rest.fetch(Adopted())
    assert raised.value.code == "DIGEST_MISMATCH"
    with source(server, transport=Attacker(flip_a_byte("/api/v1/deployments"))) as rest, \
            pytest.raises(IntegrityError):
        rest.fetch(Adopted())


def test_a_manifest_rollback_or_replay_is_refused(server: FleetServer) -> None:
    state = first_sync(server)
    assert state.manifest_version is not None
    for stored in (state.manifest_version + 1, state.manifest_version):
        adopted = Adopted(version=str(stored), manifest_version=stored, etag='"other"')
        with source(server) as rest, pytest.raises(IntegrityError) as raised:
            rest.fetch(adopted)
        assert raised.value.code == "ROLLBACK"


def _set_first(key: str, value: str) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["deployments"][0][key] = value

    return change


@pytest.mark.parametrize(("change", "words"), [
    (_set_first("digest", "sha512:" + "ab" * 64), "unsupported digest algorithm 'sha512'"),
    (_set_first("url", "http://attacker.example/api/v1/deployments/x"), "deployments[0].url"),
    (_set_first("url", "//attacker.example/api/v1/deployments/x"), "url must be"),
    (lambda doc: doc.pop("deployments"), "deployments"),
    (lambda doc: doc["deployments"].append(doc["deployments"][0]), "duplicate deploymentId"),
    (lambda doc: doc.update(bundle=None), "bundle must describe"),
])
def test_forged_manifests_are_refused(server: FleetServer,
                                      change: Callable[[dict[str, Any]], None],
                                      words: str) -> None:
    """An unsupported digest algorithm makes the manifest invalid (the spec's MUST)."""
    requests = Requests()
    with source(server, requests=requests, transport=Attacker(manifest_rewrite(change))) \
            as rest, pytest.raises(IntegrityError) as raised:
        rest.fetch(Adopted())
    assert raised.value.code == "INVALID_MANIFEST" and words in raised.value.message
    assert requests.paths == ["/api/v1/deployments"]  # nothing it names was fetched


def test_a_bundle_must_hold_exactly_the_listed_documents(server: FleetServer) -> None:
    state = first_sync(server)
    documents = [d.document for d in state.deployments]
    lacking = deterministic_targz({f"{i}.yaml": d for i, d in enumerate(documents[:-1])})
    extra = deterministic_targz({f"{i}.yaml": d for i, d in enumerate(
        [*documents, documents[0] + b"# not listed\n"])})
    renamed = deterministic_targz({f"any-name-{i}": d for i, d in enumerate(documents)})
    for bundle, error in ((lacking, "lacks listed"), (extra, "does not list"), (renamed, None)):
        url = f"/api/v1/bundles/{digest_of(bundle)}"

        def point_at(doc: dict[str, Any], url: str = url, bundle: bytes = bundle) -> None:
            doc["bundle"].update(url=url, digest=digest_of(bundle))

        attacker = Attacker(manifest_rewrite(point_at), served={url: bundle})
        with source(server, transport=attacker) as rest:
            if error is None:  # members are matched by digest, whatever their names
                fetched = rest.fetch(Adopted())
                assert fetched is not None and len(fetched.deployments) == len(documents)
                continue
            with pytest.raises(IntegrityError) as raised:
                rest.fetch(Adopted())
        assert raised.value.code == "INVALID_BUNDLE" and error in raised.value.message


def test_unsafe_or_broken_bundles_are_refused(server: FleetServer) -> None:
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:gz") as tar:
        link = tarfile.TarInfo("evil.yaml")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    for bundle in (payload.getvalue(), b"not a tar.gz at all"):
        url = f"/api/v1/bundles/{digest_of(bundle)}"

        def point_at(doc: dict[str, Any], url: str = url, bundle: bytes = bundle) -> None:
            doc["bundle"].update(url=url, digest=digest_of(bundle))

        attacker = Attacker(manifest_rewrite(point_at), served={url: bundle})
        with source(server, transport=attacker) as rest, \
                pytest.raises(IntegrityError) as raised:
            rest.fetch(Adopted())
        assert raised.value.code == "INVALID_BUNDLE"


def test_documents_must_be_valid_and_carry_the_listed_id(server: FleetServer) -> None:
    state = first_sync(server)
    good = state.deployments[0].document
    invalid = good.replace(b"deploymentProfile:", b"deploymentProfil:")
    other_id = state.deployments[1].document
    for document, expected in ((invalid, "not a valid ApplicationDeployment"),
                               (other_id, "is not the manifest's deploymentId")):
        bundle = deterministic_targz({"only.yaml": document})
        url = f"/api/v1/bundles/{digest_of(bundle)}"

        def forge(doc: dict[str, Any], url: str = url, bundle: bytes = bundle,
                  document: bytes = document) -> None:
            first = doc["deployments"][0]
            first.update(digest=digest_of(document),
                         url=f"/api/v1/deployments/{first['deploymentId']}/"
                             f"{digest_of(document)}")
            doc.update(deployments=[first], bundle={**doc["bundle"], "url": url,
                                                    "digest": digest_of(bundle)})

        with source(server, transport=Attacker(manifest_rewrite(forge), served={url: bundle})) \
                as rest, pytest.raises(IntegrityError) as raised:
            rest.fetch(Adopted())
        assert raised.value.code == "INVALID_DOCUMENT"
        assert expected in raised.value.message


# --- HTTP failures -------------------------------------------------------------------------


def test_a_404_for_a_document_is_an_error_not_a_deletion(server: FleetServer) -> None:
    state = first_sync(server)
    unknown = "sha256:" + "0" * 64

    def point_at_unknown(doc: dict[str, Any]) -> None:
        last = doc["deployments"][-1]
        last.update(digest=unknown, url=f"/api/v1/deployments/{last['deploymentId']}/{unknown}")

    adopted = adopted_from(state, keep=4, older=True)
    with source(server, transport=Attacker(manifest_rewrite(point_at_unknown))) as rest, \
            pytest.raises(SourceError) as raised:
        rest.fetch(adopted)  # the real server answers 404 for that digest
    assert not isinstance(raised.value, IntegrityError)
    assert raised.value.code == "NOT_FOUND" and raised.value.retryable
    assert "not a deletion" in raised.value.message


def test_a_stopped_server_is_unreachable() -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=5) as client, \
            RestSource(client) as rest, pytest.raises(SourceError) as raised:
        rest.fetch(Adopted())
    assert raised.value.code == "UNREACHABLE" and raised.value.retryable


def test_bad_credentials_and_foreign_paths_are_not_retried(server: FleetServer) -> None:
    with source(server, token="not-a-token") as rest, pytest.raises(SourceError) as raised:
        rest.fetch(Adopted())
    assert (raised.value.code, raised.value.retryable) == ("UNAUTHORIZED", False)
    with source(server, prefix="/api/v1/clients/someone-else") as rest, \
            pytest.raises(SourceError) as raised:
        rest.fetch(Adopted())
    assert (raised.value.code, raised.value.retryable) == ("FORBIDDEN", False)
    assert "its own clientId" in raised.value.message  # the problem's detail


class _Throttling(BaseHTTPRequestHandler):
    """Answers every GET with the status, headers and problem the test put on the server."""

    def do_GET(self) -> None:
        status, headers, problem = self.server.answer  # type: ignore[attr-defined]
        body = json.dumps(problem).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/problem+json",
                            "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def throttling() -> Iterator[ThreadingHTTPServer]:
    with serving(_Throttling) as httpd:
        yield httpd


def _fetch_error(httpd: ThreadingHTTPServer) -> SourceError:
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    with httpx.Client(base_url=base, timeout=5) as client, RestSource(client) as rest, \
            pytest.raises(SourceError) as raised:
        rest.fetch(Adopted())
    return raised.value


def test_throttling_honours_retry_after_and_problem_details(
        throttling: ThreadingHTTPServer) -> None:
    problem = {"type": "about:blank", "title": "Service Unavailable", "status": 503,
               "detail": "compiling the fleet", "retryable": True}
    throttling.answer = (503, {"Retry-After": "7"}, problem)  # type: ignore[attr-defined]
    error = _fetch_error(throttling)
    assert (error.code, error.retry_after, error.retryable) == ("HTTP_503", 7.0, True)
    assert "compiling the fleet" in error.message
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    throttling.answer = (429, {"Retry-After": later},  # type: ignore[attr-defined]
                         {**problem, "status": 429, "retryable": False})
    error = _fetch_error(throttling)
    assert error.code == "HTTP_429" and not error.retryable
    assert error.retry_after is not None and 60 < error.retry_after <= 121
    throttling.answer = (500, {}, {"title": "oops", "retryAfterSeconds": 3})  # type: ignore[attr-defined]
    error = _fetch_error(throttling)
    assert (error.code, error.retry_after, error.retryable) == ("HTTP_500", 3.0, True)
