"""HTTP/1.1 over plain sockets, for tests that must control every byte a client sends and
when: a head without its body, half a body, a body held open, a client from another loopback
address (127.0.0.0/8 all reaches the loopback interface, so each 127.x.y.z is a distinct
client address to the server)."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer", "answers_within", "closed_by_server", "connect", "head", "read_response"]


def connect(addr: tuple[str, int], *, source: str | None = None,
            timeout: float = 10) -> socket.socket:
    """A connection to `addr`, from loopback address `source` when given."""
    sock = socket.create_connection(addr, timeout=timeout,
                                    source_address=(source, 0) if source else None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, headers: Mapping[str, str], *, host: str = "test") -> bytes:
    """A request line and headers (add Content-Length or Transfer-Encoding yourself)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}",
             *[f"{k}: {v}" for k, v in headers.items()], "", ""]
    return "\r\n".join(lines).encode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def problem(self) -> dict[str, Any]:
        """The body as an RFC 9457 problem (asserting that it is one)."""
        assert self.headers.get("content-type") == "application/problem+json", self
        doc: dict[str, Any] = json.loads(self.body)
        assert doc["status"] == self.status, doc
        return doc


def read_response(sock: socket.socket) -> Answer:
    """The next response on `sock` (its body by Content-Length)."""
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
    return Answer(int(status_line.split()[1]), headers, body)


def answers_within(socks: Iterable[socket.socket], seconds: float,
                   wanted: int) -> dict[socket.socket, Answer]:
    """The answers that arrive on `socks` within `seconds`, stopping once `wanted` did."""
    pending, answered = list(socks), {}
    deadline = time.monotonic() + seconds
    while pending and len(answered) < wanted and time.monotonic() < deadline:
        ready, _, _ = select.select(pending, [], [], max(0.0, deadline - time.monotonic()))
        for sock in ready:
            pending.remove(sock)
            with contextlib.suppress(ConnectionError):
                answered[sock] = read_response(sock)
    return answered


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
