"""Kept-alive connections between the device and the server (issue 33: a device polling
every 5 s against uvicorn's 5 s keep-alive timeout got `RemoteProtocolError: Server
disconnected` on 1.6 % of its polls).

Client side: a request that went out on a kept-alive connection the server closed under it
is sent once more on a new connection when it is idempotent (`reconciler.failover`). The
race itself cannot be had on demand from a real uvicorn (`kits.keepalivekit` says why), so
a proxy in front of the real `margo serve` closes every reused connection exactly as the
request arrives: deterministic, for the real device client (`margo device run`) and for
its HTTP client. Server side: `margo serve --keep-alive` (75 s by default, longer than the
common polling intervals).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kits.chartkit import publish_example_charts
from kits.devicekit import new_device
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.keepalivekit import reuse_closing_proxy
from kits.rawhttp import closed_by_server
from kits.serverkit import running_server

from reconciler.failover import FailoverClient
from tools.devices import current, running_device
from tools.polling import poll_until

IDLE = 0.5  # the proxy's "keep-alive timeout": longer than the gaps within one request


@pytest.fixture(scope="module")
def server(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    workdir = tmp_path_factory.mktemp("keep-alive")
    publish_example_charts(registry)
    with fleet_server(workdir, fleet=write_fleet(workdir / "fleet", registry=registry,
                                                 intents={})) as s:
        yield s


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].rstrip("/"))


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_device_whose_connections_close_as_it_reuses_them_converges(
        server: FleetServer, reset: bool) -> None:
    """The real device client polling every second; every connection it reuses is closed
    as its request arrives. Before the fix each such poll failed ("fetching desired state
    failed: ... Server disconnected", or a reset); now each is sent again and answered."""
    with reuse_closing_proxy(port_of(server.base), idle=IDLE, reset=reset) as proxy:
        device = new_device(server, f"keep-alive-{'reset' if reset else 'closed'}",
                            url=proxy.url)
        with running_device(device) as log:
            poll_until("the install", lambda: current(server, device.device_id), timeout=60)
            poll_until("three polls on reused connections", lambda: proxy.closed_on_reuse >= 3,
                       timeout=60)
        text = log.read_text()
    assert "failed" not in text and "Traceback" not in text, text
    assert text.count("the server closed the kept-alive connection") >= 3, text


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_only_idempotent_requests_on_reused_connections_are_sent_again(
        server: FleetServer, reset: bool) -> None:
    with reuse_closing_proxy(port_of(server.base), idle=IDLE, reset=reset) as proxy, \
            FailoverClient([proxy.url], timeout=10) as http:
        for method, path, body, status in (
                ("GET", "/livez", None, 200),
                ("PUT", "/api/v1/capabilities/nobody", b'{"not": "a device"}', 401)):
            assert http.get("/livez").status_code == 200
            time.sleep(IDLE + 0.1)
            before = proxy.connections
            answer = http.request(method, path, content=body)
            assert answer.status_code == status  # the answer to the request sent again
            assert proxy.connections == before + 1
        closed = proxy.closed_on_reuse
        assert closed == 2

        # POST is not idempotent: the server may have acted on it, so it is not repeated.
        assert http.get("/livez").status_code == 200  # (the 401 above closed its connection)
        time.sleep(IDLE + 0.1)
        before = proxy.connections
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            http.post("/api/v1/onboarding", content=b"{}")
        assert (proxy.closed_on_reuse, proxy.connections) == (closed + 1, before)

        # A connection that breaks on its first request is the server's doing: not repeated.
        proxy.close_fresh = True
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            http.get("/livez")
        assert (proxy.closed_fresh, proxy.connections) == (1, before + 1)


def test_a_closed_kept_alive_connection_does_not_move_the_device_to_another_url(
        server: FleetServer) -> None:
    """With fallback URLs, the race used to count as a dead server (a broken connection)."""
    with reuse_closing_proxy(port_of(server.base), idle=IDLE) as proxy, \
            FailoverClient([proxy.url, server.base], timeout=10) as http:
        assert http.get("/livez").status_code == 200
        time.sleep(IDLE + 0.1)
        assert http.get("/livez").status_code == 200
        assert (proxy.closed_on_reuse, proxy.connections, http.servers.active) == (1, 2, 0)


def idle_connection(base: str) -> socket.socket:
    """A connection to the server that carried one answered request and is now idle."""
    sock = socket.create_connection(("127.0.0.1", port_of(base)), timeout=10)
    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: test\r\n\r\n")
    answer = b""
    while not answer.endswith(b"\r\n\r\n") and b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def test_the_server_keeps_idle_connections_longer_than_the_common_intervals(
        server: FleetServer, tmp_path: Path) -> None:
    """Default 75 s: a connection idle for 6 s (past uvicorn's own 5 s) is still open;
    `--keep-alive 1` closes one idle for a second."""
    with idle_connection(server.base) as sock:
        assert not closed_by_server(sock, within=6.0)
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: test\r\n\r\n")  # and it is reused
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with running_server(tmp_path / "data", "--keep-alive", "1") as base, \
            idle_connection(base) as sock:
        assert closed_by_server(sock, within=3.0)
