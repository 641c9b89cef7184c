"""A response's head leaves with its body in one write (`wfm.server.onewrite`), and every
kind of answer still arrives whole: a plain one, a HEAD one, a streamed one whose first
chunk comes late, one to a request that expects `100 Continue`, one whose app fails after
the head, and pipelined ones. A real uvicorn with the protocol `margo serve` runs, in a
process of its own, on loopback; its write system calls are read from /proc."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tools.processes import free_port, stop, wait_until_ready

_APP = '''
import asyncio, sys, uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from wfm.server.onewrite import one_write_protocol

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.3)
        for chunk in (b"first ", b"second"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/fail":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"10")]})
        raise RuntimeError("the app failed after the head")
    answer = b"echo:" + body if body else b"hello " + path.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})

protocol = HttpToolsProtocol if sys.argv[2] == "plain" else one_write_protocol(HttpToolsProtocol)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http=protocol, loop="uvloop",
            log_level="critical", access_log=False)
'''


@contextmanager
def _server(tmp_path: Path, kind: str) -> Iterator[tuple[int, int]]:
    """(port, pid) of a uvicorn serving the app above, with `one_write_protocol` ("one")
    or uvicorn's protocol alone ("plain")."""
    script, log = tmp_path / f"{kind}.py", tmp_path / f"{kind}.log"
    script.write_text(_APP)
    port = free_port()
    with log.open("wb") as output:
        process = subprocess.Popen([sys.executable, str(script), str(port), kind],
                                   cwd=Path(__file__).resolve().parents[2],
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(process, lambda: _connects(port), "uvicorn", log,
                         not_yet=(OSError,))
        yield port, process.pid
    finally:
        stop(process)


def _connects(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


@pytest.fixture(scope="module")
def one_write(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(port, pid) of the server with `one_write_protocol`."""
    with _server(tmp_path_factory.mktemp("one-write"), "one") as server:
        yield server


def _exchange(port: int, request: bytes, *, until: bytes | None = None,
              timeout: float = 5.0) -> bytes:
    """Send `request` on a new connection; what arrives until the server closes it, or
    until `until` was received."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            if until is not None and received.endswith(until):
                break
        return received


def test_a_response_arrives_whole(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    answer = _exchange(port, b"GET /a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nhello /a")


def test_a_head_answer_is_not_held(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    answer = _exchange(port, b"HEAD /a HTTP/1.1\r\nHost: t\r\n\r\n", until=b"\r\n\r\n",
                       timeout=3)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n")


def test_a_streamed_body_whose_first_chunk_comes_late(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    answer = _exchange(port, b"GET /stream HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in answer
    assert answer.endswith(b"6\r\nfirst \r\n6\r\nsecond\r\n0\r\n\r\n")


def test_100_continue_leaves_before_the_body_is_sent(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"data")
        answer = b""
        while not answer.endswith(b"echo:data"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")


def test_an_app_that_fails_after_the_head_still_sends_it(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    answer = _exchange(port, b"GET /fail HTTP/1.1\r\nHost: t\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n")


def test_pipelined_requests_are_answered_in_order(one_write: tuple[int, int]) -> None:
    port, _ = one_write
    answer = _exchange(port, b"GET /1 HTTP/1.1\r\nHost: t\r\n\r\n"
                             b"HEAD /2 HTTP/1.1\r\nHost: t\r\n\r\n"
                             b"GET /3 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert answer.index(b"hello /1") < answer.index(b"hello /3")
    assert answer.endswith(b"hello /3")


def _writes_per_response(port: int, pid: int, count: int = 200) -> float:
    """Write system calls the server made per response over one kept-alive connection."""
    request = b"GET /w HTTP/1.1\r\nHost: t\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        sock.recv(65536)  # the connection is set up
        before = _syscw(pid)
        for _ in range(count):
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"hello /w"):
                answer += sock.recv(65536)
        return (_syscw(pid) - before) / count


def _syscw(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/<pid>/io")


def test_one_write_per_response_where_uvicorn_makes_two(
        one_write: tuple[int, int], tmp_path: Path) -> None:
    port, pid = one_write
    with _server(tmp_path, "plain") as (plain_port, plain_pid):
        plain = _writes_per_response(plain_port, plain_pid)
    assert plain >= 1.9  # what the test tells apart: uvicorn alone writes twice
    assert _writes_per_response(port, pid) <= 1.1
