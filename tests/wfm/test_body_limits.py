"""Request bodies are limited while they stream and must arrive in time (`wfm.admission.bodylimit`),
against a real `margo serve` on loopback, over raw sockets: a declared Content-Length over
the limit is refused unread, a chunked body is cut off once past it (the server's memory
does not grow with it), and half-sent bodies are answered 408 and their connections closed
within the deadline (here shortened to 2 s with `--body-timeout`); so are connections that
never finish their headers (`--header-timeout`)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.serverkit import ROOT, add_client, running_server

DEADLINE = 2.0
CAPS = ROOT / "examples" / "capabilities"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("limits")
    data = root / "data"
    token = add_client(data, "site-a")
    (root / "secret").write_text("s3cret\n")
    with running_server(data, "--body-timeout", str(DEADLINE), "--header-timeout", str(DEADLINE),
                        "--webhook-secret-file", str(root / "secret"),
                        "--source-url", str(root / "no-such-repository")) as base:
        host, port = base.removeprefix("http://").split(":")
        yield {"addr": (host, int(port)), "token": token, "data": data}


def server_pid(server: dict[str, Any]) -> int:
    owner = json.loads((server["data"] / "serve.lock").read_text())
    return int(owner["pid"])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def connect(server: dict[str, Any], timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(server["addr"], timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *[f"{k}: {v}" for k, v in
                                                          headers.items()], "", ""]
    return "\r\n".join(lines).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and whatever body arrives until the server closes (or 64 KiB)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without an answer after {data!r}")
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes the connection within `within` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def auth(server: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {server['token']}", "Content-Type": "application/json"}


@pytest.mark.parametrize(("path", "authenticated"), [
    ("/api/v1/capabilities/k8s-single-amd64", True),
    ("/hooks/git", False),
    ("/api/v1/onboarding", False),
])
def test_a_declared_length_over_the_limit_is_refused_without_reading_it(
        server: dict[str, Any], path: str, authenticated: bool) -> None:
    headers = {**(auth(server) if authenticated else {"Content-Type": "application/json"}),
               "Content-Length": str(300 * 1024 * 1024)}
    with connect(server) as sock:
        sock.sendall(head("PUT" if "capabilities" in path else "POST", path, headers))
        started = time.monotonic()
        status, response_headers, body = read_response(sock)  # not one body byte was sent
        assert time.monotonic() - started < DEADLINE
        assert status == 413, body
        assert response_headers["content-type"] == "application/problem+json"
        assert response_headers["connection"] == "close"
        assert json.loads(body)["status"] == 413
        assert closed_by_server(sock, 5)


@pytest.mark.parametrize(("method", "path", "size", "status"), [
    ("POST", "/git/source.git/git-receive-pack", 2 * 1024 * 1024, None),
    ("POST", "/hooks/git", 2 * 1024 * 1024, 401),
    ("PUT", "/api/v1/capabilities/k8s-single-amd64", 1024 * 1024 + 1, 413),
], ids=["push", "hook", "api"])
def test_each_path_has_its_own_limit(server: dict[str, Any], method: str, path: str,
                                     size: int, status: int | None) -> None:
    """Pushes and hooks may be larger than API bodies: a 2 MiB body reaches their handlers
    (refused there: no credentials, or no hosted source here), one byte past 1 MiB does not
    reach the API's. `None`: any answer but 413."""
    headers = {**auth(server), "Content-Length": str(size), "X-GitHub-Event": "push"}
    with connect(server) as sock:
        sock.sendall(head(method, path, headers))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"0" * size)
        answered = read_response(sock)[0]
    if status is None:
        assert answered != 413
    else:
        assert answered == status


def test_a_chunked_body_is_cut_off_past_the_limit_and_memory_stays_bounded(
        server: dict[str, Any]) -> None:
    pid = server_pid(server)
    before = rss_kib(pid)
    chunk = b"[" + b"0," * (512 * 1024) + b"0]"  # 1 MiB of valid-looking JSON per chunk
    sent = 0
    status = None
    with connect(server) as sock:
        sock.sendall(head("PUT", "/api/v1/capabilities/k8s-single-amd64",
                          {**auth(server), "Transfer-Encoding": "chunked"}))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            sock.settimeout(5)
            while sent < 50 * 1024 * 1024:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            status, _, _ = read_response(sock)
    grown = rss_kib(pid) - before
    assert status in (413, None)  # a reset may swallow the answer; the memory is the point
    assert grown < 8 * 1024, f"the server grew by {grown} KiB for a {sent >> 20} MiB body"


def test_a_chunked_body_past_the_limit_gets_413(server: dict[str, Any]) -> None:
    with connect(server) as sock:
        sock.sendall(head("PUT", "/api/v1/capabilities/k8s-single-amd64",
                          {**auth(server), "Transfer-Encoding": "chunked"}))
        piece = b" " * (64 * 1024)
        for _ in range(17):  # 1 MiB and a bit: the answer comes without waiting for more
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        status, headers, body = read_response(sock)
        assert status == 413, body
        assert headers["connection"] == "close"
        assert "limited to 1048576 bytes" in json.loads(body)["detail"]


def half_sent(server: dict[str, Any], path: str, headers: dict[str, str],
              method: str = "PUT") -> socket.socket:
    sock = connect(server)
    sock.sendall(head(method, path, {**headers, "Content-Length": "1000"}) + b'{"apiVersi')
    return sock


def test_a_half_sent_body_gets_408_within_the_deadline(server: dict[str, Any]) -> None:
    with half_sent(server, "/api/v1/capabilities/k8s-single-amd64", auth(server)) as sock:
        started = time.monotonic()
        status, headers, body = read_response(sock)
        waited = time.monotonic() - started
        assert status == 408, body
        assert DEADLINE - 0.5 < waited < DEADLINE + 3
        assert headers["connection"] == "close"
        assert json.loads(body)["detail"] == (
            f"the request body did not arrive within {DEADLINE:g} seconds")
        assert closed_by_server(sock, 3)


def test_a_half_sent_body_with_a_bad_signature_is_refused_unread(
        server: dict[str, Any]) -> None:
    """rc.2 signatures are verified from the headers before the body is buffered: a bad one
    is answered at once and the connection closed (a good one's half-sent body gets 408:
    test_body_budgets.py)."""
    headers = {"Content-Type": "application/json", "Signature-Input": 'sig=("@method")',
               "Signature": "sig=:AAAA:", "Content-Digest": "sha-256=:AAAA:"}
    with half_sent(server, "/api/v1/clients/site-a/capabilities", headers, "POST") as sock:
        status, headers_back, body = read_response(sock)
        assert status == 401, body
        assert headers_back["connection"] == "close"
        assert closed_by_server(sock, 3)


def test_a_drip_fed_body_does_not_reset_the_deadline(server: dict[str, Any]) -> None:
    with half_sent(server, "/api/v1/capabilities/k8s-single-amd64", auth(server)) as sock:
        started = time.monotonic()
        sock.settimeout(0.3)
        answer = b""
        while time.monotonic() - started < DEADLINE + 3 and not answer:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b" ")
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < DEADLINE + 3


def test_an_unread_half_sent_body_closes_the_connection(server: dict[str, Any]) -> None:
    """The handler answers without reading (401: no credentials): the connection is closed
    after the answer instead of waiting for the rest of the body."""
    with half_sent(server, "/api/v1/capabilities/k8s-single-amd64",
                   {"Content-Type": "application/json"}) as sock:
        status, headers, _ = read_response(sock)
        assert status == 401
        assert headers["connection"] == "close"
        assert closed_by_server(sock, 3)


def test_hundreds_of_half_sent_bodies_are_all_closed(server: dict[str, Any]) -> None:
    paths = [("/api/v1/capabilities/k8s-single-amd64", auth(server), "PUT"),
             ("/hooks/git", {"Content-Type": "application/json", "X-GitHub-Event": "push"},
              "POST"),
             ("/api/v1/onboarding", {"Content-Type": "application/json"}, "POST")]
    socks = [half_sent(server, *paths[i % len(paths)]) for i in range(300)]
    try:
        deadline = time.monotonic() + DEADLINE + 15
        still_open = []
        for sock in socks:
            left = max(0.1, deadline - time.monotonic())
            if not closed_by_server(sock, left):
                still_open.append(sock)
        assert not still_open, f"{len(still_open)} of 300 connections were not closed"
    finally:
        for sock in socks:
            sock.close()
    with connect(server) as sock:  # and the server still answers
        sock.sendall(head("GET", "/healthz", {}))
        assert read_response(sock)[0] == 200


# --- the request head ----------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
                                  b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /he"],
                         ids=["silent", "half-a-head", "second-request-half-sent"])
def test_a_connection_that_never_finishes_its_headers_is_closed(
        server: dict[str, Any], sent: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        assert closed_by_server(sock, DEADLINE + 5)
        assert time.monotonic() - started < DEADLINE + 3


def test_a_drip_fed_head_is_closed_at_the_deadline(server: dict[str, Any]) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        sock.settimeout(0.3)
        closed = False
        while time.monotonic() - started < DEADLINE + 3 and not closed:
            try:
                sock.sendall(b"X-Drip: 1\r\n")
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed


def test_an_oversized_head_is_refused(server: dict[str, Any]) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for i in range(100):
                sock.sendall(f"X-Filler-{i}: {'a' * 1000}\r\n".encode())
        status, _, _ = read_response(sock)
        assert status == 400
        assert closed_by_server(sock, 3)


def test_keep_alive_requests_still_work(server: dict[str, Any]) -> None:
    with connect(server) as sock:
        for _ in range(3):
            sock.sendall(head("GET", "/healthz", {}))
            assert read_response(sock)[0] == 200
            time.sleep(DEADLINE / 2)  # idle between requests: uvicorn's keep-alive (5 s)


def test_hundreds_of_silent_connections_are_all_closed(server: dict[str, Any]) -> None:
    socks = [connect(server) for _ in range(300)]
    try:
        deadline = time.monotonic() + DEADLINE + 15
        still_open = [sock for sock in socks
                      if not closed_by_server(sock, max(0.1, deadline - time.monotonic()))]
        assert not still_open, f"{len(still_open)} of 300 connections were not closed"
    finally:
        for sock in socks:
            sock.close()
