"""A server that closes a kept-alive connection at the very moment the client reuses it: the
race of a keep-alive timeout equal to a client's polling interval, on demand.

A real uvicorn closes an idle connection on its own timer, and a client reuses it on its own
clock; they meet within the same millisecond on about 1 % of polls at best (issue 33:
1.6 % of a device's polls at 5 s against uvicorn's 5 s timeout), and httpcore's check of an
idle connection before reuse hides every close that arrived a little earlier. So no test
can make a real uvicorn do it when wanted. This TCP proxy in front of a real `margo serve`
does exactly what the server does in that race, every time: a connection that has carried
an answer and then stayed idle for `idle` seconds is closed when the client's next request
arrives on it, unanswered and unforwarded (the server never saw it). Closed with a FIN (the
client reads EOF: httpx's `RemoteProtocolError` "Server disconnected") or, with `reset`,
with an RST (`ReadError`, connection reset), the two ways the race shows.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ReuseClosingProxy", "reuse_closing_proxy"]


class ReuseClosingProxy:
    """See the module docstring. `connections`: accepted so far; `closed_on_reuse`: reused
    connections closed under a request; with `close_fresh` set, a new connection's first
    request is closed too (`closed_fresh` counts them): a server that really fails."""

    def __init__(self, upstream_port: int, *, idle: float, reset: bool = False) -> None:
        self.upstream_port, self.idle, self.reset = upstream_port, idle, reset
        self.close_fresh = False
        self.connections = self.closed_on_reuse = self.closed_fresh = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        upstream.settimeout(None)
        #: When the last byte went either way, and whether an answer has been relayed.
        link = {"last": time.monotonic(), "answered": False}
        back = threading.Thread(target=self._relay_answers, args=(upstream, client, link),
                                daemon=True)
        back.start()
        try:
            while data := client.recv(65536):
                if self._closing(link):
                    self._drop(client)
                    return
                link["last"] = time.monotonic()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _closing(self, link: dict[str, float | bool]) -> bool:
        """Whether the request arriving now is the one to close the connection under."""
        with self._lock:
            if link["answered"] and time.monotonic() - float(link["last"]) >= self.idle:
                self.closed_on_reuse += 1
                return True
            if not link["answered"] and self.close_fresh:
                self.closed_fresh += 1
                return True
            return False

    def _drop(self, client: socket.socket) -> None:
        if self.reset:  # linger 0: close() sends an RST
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            client.shutdown(socket.SHUT_RDWR)
        client.close()

    @staticmethod
    def _relay_answers(upstream: socket.socket, client: socket.socket,
                       link: dict[str, float | bool]) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
                link["last"], link["answered"] = time.monotonic(), True
        except OSError:
            pass


@contextmanager
def reuse_closing_proxy(upstream_port: int, *, idle: float,
                        reset: bool = False) -> Iterator[ReuseClosingProxy]:
    proxy = ReuseClosingProxy(upstream_port, idle=idle, reset=reset)
    try:
        yield proxy
    finally:
        proxy.close()
