"""A round-robin HTTP load balancer on loopback, in front of fleet server replicas: for the
tests (`kits.balancer`, the replica store of `kits.serverkit`) and the benchmarks
(`bench.failover`).

Each *request* goes to the next replica (as an L7 balancer over pooled connections does),
so a device's manifest poll, its YAML fetch and its status report may each reach a
different replica: the double of the balancer an operator runs, not of anything the
product does. By default it sends the replica's own address as `Host` (as nginx does unless
told otherwise); `preserve_host=True` passes the client's `Host` through, which rc.2
devices need: their RFC 9421 signatures cover `@authority`, which the replica rebuilds from
`Host`. Bodies are read whole (the tests' are small), chunked request bodies (Git's
large POSTs) are decoded, responses keep their raw bytes (compression included).

`tcp_balancing` is the L4 kind (TLS passthrough, as for mutual TLS, where the replica must
see the client's certificate): each *connection* goes to the next replica, and its bytes
are copied both ways untouched.
"""

from __future__ import annotations

import itertools
import socket
import socketserver
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

__all__ = ["Balancer", "TcpBalancer", "balancing", "tcp_balancing"]

#: Seconds the balancer waits for a replica's answer to begin.
READ_TIMEOUT = 120.0
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "trailer", "upgrade", "content-length", "host"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Balancer

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self) -> None:
        body = self._body()
        upstream = self.server.next_upstream()
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP
                   or (k.lower() == "host" and self.server.preserve_host)]
        try:
            with self.server.http.stream(self.command, upstream + self.path, headers=headers,
                                         content=body) as response:
                raw = b"".join(response.iter_raw())
                status, reply = response.status_code, response.headers.multi_items()
        except httpx.TransportError as exc:
            status, reply, raw = 502, [("content-type", "text/plain")], str(exc).encode()
        self.send_response(status)
        for name, value in reply:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Balancer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstreams: Sequence[str], *, preserve_host: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstreams = list(upstreams)
        self.preserve_host = preserve_host
        self._turn = itertools.cycle(range(len(self.upstreams)))
        self._lock = threading.Lock()
        # Reads wait longer than the longest poll a replica holds (`Prefer: wait`, 60 s at
        # most by default): what docs/server.md asks of a proxy in front of waiting polls.
        self.http = httpx.Client(timeout=httpx.Timeout(60, read=READ_TIMEOUT))
        self.counts = [0] * len(self.upstreams)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left before its answer (a device stopped while its poll was
        held) is no error of the balancer's: it is dropped, as a balancer does; anything
        else is printed as usual."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_upstream(self) -> str:
        with self._lock:
            index = next(self._turn)
            self.counts[index] += 1
        return self.upstreams[index]


@contextmanager
def balancing(upstreams: Sequence[str], *, preserve_host: bool = False) -> Iterator[Balancer]:
    with _serving(Balancer(upstreams, preserve_host=preserve_host)) as balancer:
        try:
            yield balancer
        finally:
            balancer.http.close()


@contextmanager
def _serving(server: Any) -> Iterator[Any]:
    """Serve `server` (a socketserver) on a thread for the block."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class _Pipe(socketserver.BaseRequestHandler):
    server: TcpBalancer

    def handle(self) -> None:
        try:
            upstream = socket.create_connection(self.server.next_upstream(), timeout=60)
        except OSError:
            return  # the replica is down: the client sees the connection close
        with upstream:
            back = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
            back.start()
            _copy(self.request, upstream)
            back.join(timeout=60)


def _copy(source: socket.socket, target: socket.socket) -> None:
    """Copy until `source` ends, then end `target`'s sending side."""
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        with suppress(OSError):
            target.shutdown(socket.SHUT_WR)


class TcpBalancer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstreams: Sequence[tuple[str, int]]) -> None:
        super().__init__(("127.0.0.1", 0), _Pipe)
        self.upstreams = list(upstreams)
        self._turn = itertools.cycle(range(len(self.upstreams)))
        self._lock = threading.Lock()
        self.counts = [0] * len(self.upstreams)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def next_upstream(self) -> tuple[str, int]:
        with self._lock:
            index = next(self._turn)
            self.counts[index] += 1
        return self.upstreams[index]


@contextmanager
def tcp_balancing(upstreams: Sequence[tuple[str, int]]) -> Iterator[TcpBalancer]:
    with _serving(TcpBalancer(upstreams)) as balancer:
        yield balancer
