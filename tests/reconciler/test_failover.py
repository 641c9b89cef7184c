"""Several server URLs (reconciler/failover.py): which failures move a request on to the next
URL, that the device stays on the one that answered, when it goes back to the first, and
the configuration that gives the URLs. Real HTTP servers on loopback (stub servers that
answer as a gateway or a WFM would), real dead ports, the real `margo serve` for the Git
source and rc.2 signing checked by a verifying server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.chartkit import publish_example_charts
from kits.devicekit import intent
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from kits.netkit import cuttable_proxy, unanswered_port
from kits.processkit import free_port
from kits.stubserver import serving, url
from test_signing import Rc2Wfm, device_identity
from test_signing import _Handler as Rc2Handler
from test_signing import write_config as rc2_config

from margo.errors import DocumentError
from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.failover import RECHECK_SECONDS, FailoverClient, ServerList
from reconciler.sources import Adopted
from reconciler.sources.git_source import GitSource

PROBLEM = "application/problem+json"


class _Answers(BaseHTTPRequestHandler):
    """Answers every request with the server's `answer` (status, headers) and counts it."""

    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path,  # type: ignore[attr-defined]
                                 self.headers.get("Host"), body))
        status, headers = self.server.answer  # type: ignore[attr-defined]
        payload = json.dumps({"title": "from the stub", "status": status}).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers,
                            "Content-Length": str(len(payload))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def live() -> Iterator[Any]:
    """A server that answers 200 (and counts what it got)."""
    with serving(_Answers, seen=[], answer=(200, {})) as httpd:
        yield httpd


@pytest.fixture
def first() -> Iterator[Any]:
    """The first URL's server, answering whatever the test sets in `answer`."""
    with serving(_Answers, seen=[], answer=(200, {})) as httpd:
        yield httpd


def dead_url() -> str:
    """A loopback port nobody listens on: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_refused_url_moves_the_request_on_and_the_device_stays_on_the_next(
        live: Any) -> None:
    with FailoverClient([dead_url(), url(live)], timeout=5) as http:
        answer = http.put("/api/v1/capabilities/d1", content=b'{"a": 1}')
        assert answer.status_code == 200
        assert http.servers.active == 1
        assert http.get("/api/v1/deployments").status_code == 200
    host = url(live).removeprefix("http://")
    assert [(m, p, h, b) for m, p, h, b in live.seen] == [
        ("PUT", "/api/v1/capabilities/d1", host, b'{"a": 1}'),
        ("GET", "/api/v1/deployments", host, b"")]


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateway_error_moves_on_and_the_dead_url_is_not_asked_again(
        first: Any, live: Any, status: int) -> None:
    first.answer = (status, {"Content-Type": "text/html"})
    with FailoverClient([url(first), url(live)], timeout=5) as http:
        for _ in range(3):
            assert http.get("/api/v1/deployments").status_code == 200
    assert len(first.seen) == 1 and len(live.seen) == 3


def test_a_503_moves_on_and_when_nobody_does_better_the_answer_in_use_stands(
        first: Any, live: Any) -> None:
    # A balancer's 503 (no live upstream), and a live WFM's that asks to wait: another
    # replica may have what this one lacks (its database), so it is asked.
    for headers in ({"Content-Type": "text/html"},
                    {"Retry-After": "7", "Content-Type": PROBLEM}):
        first.answer = (503, headers)
        with FailoverClient([url(first), url(live)], timeout=5) as http:
            assert http.put("/api/v1/status", content=b"{}").status_code == 200
            assert http.servers.active == 1
    # Every URL asks to wait: the one in use is answered, Retry-After and all, and stays.
    first.answer = (503, {"Retry-After": "7", "Content-Type": PROBLEM})
    live.answer = (503, {"Retry-After": "30", "Content-Type": PROBLEM})
    with FailoverClient([url(first), url(live)], timeout=5) as http:
        answer = http.put("/api/v1/status", content=b"{}")
        assert (answer.status_code, answer.headers["retry-after"]) == (503, "7")
        assert http.servers.active == 0
    # The URL in use is dead and the other asks to wait: the live one is answered, and used.
    with FailoverClient([dead_url(), url(live)], timeout=5) as http:
        answer = http.put("/api/v1/status", content=b"{}")
        assert (answer.status_code, answer.headers["retry-after"]) == (503, "30")
        assert http.servers.active == 1


def test_other_errors_are_answers(first: Any, live: Any) -> None:
    for status in (401, 404, 422, 500):
        first.answer = (status, {})
        with FailoverClient([url(first), url(live)], timeout=5) as http:
            assert http.get("/x").status_code == status
    assert live.seen == []


def test_a_port_that_never_answers_costs_one_timeout_then_none(live: Any) -> None:
    with unanswered_port() as port, FailoverClient(
            [f"http://127.0.0.1:{port}", url(live)], timeout=0.5) as http:
        assert http.get("/x").status_code == 200  # ConnectTimeout, then the next URL
        assert http.servers.active == 1
        assert http.get("/y").status_code == 200
    assert [p for _, p, _, _ in live.seen] == ["/x", "/y"]


def test_a_silent_link_moves_on_after_the_read_timeout(first: Any, live: Any) -> None:
    with cuttable_proxy(first.server_address[1]) as proxy, FailoverClient(
            [proxy.url, url(live)], timeout=0.5) as http:
        assert http.get("/x").status_code == 200 and http.servers.active == 0
        proxy.silence()
        assert http.get("/y").status_code == 200 and http.servers.active == 1
    assert [p for _, p, _, _ in first.seen] == ["/x"]


def test_back_to_the_first_url_after_failback_once_it_answers(first: Any, live: Any) -> None:
    clock = Clock()
    servers = ServerList(["first", "second"], failback=600, clock=clock)
    first.answer = (502, {})
    with FailoverClient([url(first), url(live)], servers=servers, timeout=5) as http:
        assert http.get("/1").status_code == 200 and servers.active == 1
        clock.now += 599
        assert http.get("/2").status_code == 200 and len(first.seen) == 1  # not yet
        clock.now += 1
        assert http.get("/3").status_code == 200 and len(first.seen) == 2  # tried, still down
        assert servers.active == 1
        first.answer = (200, {})
        clock.now += 300
        assert http.get("/4").status_code == 200 and len(first.seen) == 2  # next try at +600
        clock.now += 300
        assert http.get("/5").status_code == 200 and servers.active == 0
        assert http.get("/6").status_code == 200
    assert [p for _, p, _, _ in first.seen] == ["/1", "/3", "/5", "/6"]


def test_every_url_failing_is_the_first_error_and_later_requests_try_only_the_one_in_use(
        ) -> None:
    clock = Clock()
    servers = ServerList(["first", "second"], clock=clock)
    with FailoverClient([dead_url(), dead_url()], servers=servers, timeout=5) as http:
        with pytest.raises(httpx.ConnectError):
            http.get("/x")
        assert servers.order() == [0]  # the second failed just now
        clock.now += RECHECK_SECONDS
        assert servers.order() == [0, 1]


def test_one_url_is_a_plain_client(first: Any) -> None:
    first.answer = (502, {})
    with FailoverClient([url(first)], timeout=5) as http:
        assert http.get("/x").status_code == 502
    with FailoverClient([dead_url()], timeout=5) as http, pytest.raises(httpx.ConnectError):
        http.get("/x")


def test_rc2_signatures_cover_the_url_the_request_went_to(tmp_path: Path) -> None:
    """The first URL is dead from the start: onboarding and every signed request reach the
    second, and the verifying server (which rebuilds @target-uri and @authority from its
    own address) accepts each; the stored onboarding names the first URL, the server."""
    with serving(Rc2Handler) as httpd:
        httpd.wfm = wfm = Rc2Wfm(base=url(httpd))
        device_identity(tmp_path)
        path = rc2_config(tmp_path, dead := dead_url())
        doc = json.loads(path.read_text())
        doc["server"]["fallbackUrls"] = [wfm.base]
        path.write_text(json.dumps(doc))
        with open_reconciler(load_config(path)) as reconciler:
            result = reconciler.cycle()
        assert (result.fetched, result.failures) == ("adopted", [])
        assert len(wfm.onboardings) == 1 and wfm.seen
        assert all(s.verified == "ecdsa-p256-sha256" for s in wfm.seen), wfm.seen
        stored = json.loads((tmp_path / "data" / "rc2-client.json").read_text())
        assert stored["server"] == dead


# --- the Git source ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    workdir = tmp_path_factory.mktemp("failover-git")
    publish_example_charts(registry)
    fleet = write_fleet(workdir / "fleet", registry=registry,
                        intents={"git-failover": intent("git-failover")})
    with fleet_server(workdir, fleet=fleet) as running:
        running.put_capabilities(capabilities("k8s-single-amd64", "git-failover"))
        running.wait_for_deployments(1, device_id="git-failover")
        yield running


def git_source(server: FleetServer, tmp_path: Path, first: str) -> GitSource:
    return GitSource(first, fallback_urls=[server.git_url("git-failover")],
                     cache_dir=tmp_path / "cache", username=server.client_id,
                     password=server.token)


@pytest.mark.parametrize("way", ["refused", "cut", "gateway"])
def test_the_git_source_moves_on_to_the_next_url(server: FleetServer, tmp_path: Path,
                                                 first: Any, way: str) -> None:
    first.answer = (502, {})
    port = int(server.base.rpartition(":")[2])
    with cuttable_proxy(port) as proxy:
        proxy.cut()
        dead = {"refused": dead_url(), "cut": proxy.url, "gateway": url(first)}[way]
        with git_source(server, tmp_path, f"{dead}/git/devices/git-failover.git") as source:
            state = source.fetch(Adopted())
            assert state is not None and len(state.deployments) == 1
            assert source.fetch(Adopted(version=state.version)) is None
    assert len(first.seen) == (1 if way == "gateway" else 0)


def test_a_git_device_shares_its_choice_with_the_http_client(server: FleetServer,
                                                            tmp_path: Path) -> None:
    """Derived Git URLs follow the server URLs: one dead server costs one failure, and the
    capability report, the status reports and the Git source all use the live one."""
    (tmp_path / "token").write_text(server.token)
    (tmp_path / "caps.json").write_text(json.dumps(capabilities("k8s-single-amd64",
                                                                "git-failover")))
    (tmp_path / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": "git-failover"},
        "server": {"url": dead_url(), "fallbackUrls": [server.base], "clientId": "edge",
                   "tokenFile": "token", "timeout": "5s"},
        "source": {"type": "git"}, "driver": {"type": "render"}, "dataDir": "data",
        "capabilities": {"file": "caps.json"}}))
    config = load_config(tmp_path / "device.yaml")
    with open_reconciler(config) as reconciler:
        result = reconciler.cycle()
        assert result.fetched == "adopted" and result.converged, result.failures
        assert result.pending_reports == 0
        assert reconciler.source._servers.active == 1  # type: ignore[attr-defined]


# --- configuration -----------------------------------------------------------------------------


GOOD = """\
device: {id: edge-01}
server: {url: "https://wfm-a.example:8443/", clientId: site-a, tokenFile: token,
         fallbackUrls: ["https://wfm-b.example:8443", "http://10.0.0.7:8080/"]}
source: {type: git}
driver: {type: render}
dataDir: data
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "token").write_text("secret\n")
    path = tmp_path / "device.yaml"
    path.write_text(text)
    return path


def test_fallback_urls_and_the_git_urls_that_follow_them(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.server_urls == ("https://wfm-a.example:8443", "https://wfm-b.example:8443",
                                  "http://10.0.0.7:8080")
    assert config.git_urls == tuple(f"{u}/git/devices/edge-01.git" for u in config.server_urls)
    assert config.failback == 600
    explicit = load_config(write(tmp_path, GOOD.replace("{type: git}", (
        "{type: git, url: 'https://git.example/d.git', "
        "fallbackUrls: ['https://git2.example/d.git']}")).replace(
        "tokenFile: token,", "tokenFile: token, failback: 0s,")))
    assert explicit.git_urls == ("https://git.example/d.git", "https://git2.example/d.git")
    assert explicit.failback == 0
    rest = load_config(write(tmp_path, GOOD.replace("{type: git}", "{type: margo-rest}")))
    assert rest.git_urls == () and len(rest.server_urls) == 3


SVID = """\
device: {id: edge-01}
server: {url: "https://wfm-a.example", api: rc.3, fallbackUrls: [FALLBACK]}
source: {type: margo-rest}
driver: {type: render}
dataDir: data
identity: {svid: {cert: c.pem, key: k.pem}, trustBundle: b.pem}
"""


@pytest.mark.parametrize(("text", "where", "words"), [
    (GOOD.replace('"https://wfm-b.example:8443"', "wfm-b.example"),
     "$.server.fallbackUrls[0]", "expected a string matching"),
    (GOOD.replace('"https://wfm-b.example:8443"', "https://wfm-a.example:8443"),
     "$.server.fallbackUrls[0]", "already listed"),
    (GOOD.replace('"https://wfm-b.example:8443", ', ""), "$.server.fallbackUrls", ""),
    (SVID.replace("FALLBACK", "http://wfm-b.example"), "$.server.fallbackUrls[0]",
     "mutual TLS needs an https:// server URL"),
    (SVID.replace("FALLBACK", "https://wfm-b.example").replace("svid: {cert: c.pem, key: k.pem"
                                                               "}, ", "").replace(
        "api: rc.3,", "api: rc.3, clientId: a, tokenFile: token,").replace(
        "https://wfm-b", "http://wfm-b"), "$.server.fallbackUrls[0]", "trust bundle"),
    (GOOD.replace("{type: git}", "{type: git, fallbackUrls: ['https://x/d.git']}"),
     "$.source.fallbackUrls", "only with source.url"),
    (GOOD.replace("{type: git}", "{type: margo-rest, fallbackUrls: ['https://x/d.git']}"),
     "$.source.fallbackUrls", "only the git source"),
    (GOOD.replace("tokenFile: token,", "tokenFile: token, failback: soon,"),
     "$.server.failback", ""),
])
def test_bad_fallback_settings_are_located(tmp_path: Path, text: str, where: str,
                                           words: str) -> None:
    if where == "$.server.fallbackUrls" and not words:  # a list of 9 (more than allowed)
        text = text.replace('"http://10.0.0.7:8080/"', ", ".join(
            f'"https://r{i}.example"' for i in range(9)))
    with pytest.raises(DocumentError) as caught:
        load_config(write(tmp_path, text))
    formatted = [p.format() for p in caught.value.problems]
    assert any(f": {where}:" in line and words in line and "device.yaml:" in line
               for line in formatted), formatted
    assert all(":0:0:" not in line for line in formatted), formatted
