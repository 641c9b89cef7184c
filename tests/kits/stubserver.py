"""One way to run a small HTTP(S) server with a handler of the test's own, on loopback.

Tests that need a server to misbehave on purpose (throttle, answer a script, proxy with
faults, echo client certificates) write a `BaseHTTPRequestHandler` and run it here:
`serving(handler)` starts a `ThreadingHTTPServer` (or a subclass) in a thread, optionally
behind TLS, yields it, and shuts it down (waiting for its thread) when the block ends.
`url(server)` is its base URL.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

__all__ = ["serving", "url"]

S = TypeVar("S", bound=ThreadingHTTPServer)


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler] | None = None, *,
            server: S | Callable[[], S] | None = None, tls: ssl.SSLContext | None = None,
            poll_interval: float = 0.05, before_close: Callable[[Any], None] | None = None,
            **attributes: Any) -> Iterator[Any]:
    """Serve `handler` (or a ready `server`) until the block ends. `attributes` are set on
    the server, where handlers find them as `self.server.<name>`; `before_close` runs after
    the server stops accepting (to cut connections a test held open)."""
    if server is None:
        assert handler is not None, "give a handler or a server"
        httpd: Any = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    else:
        httpd = server() if callable(server) else server
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
        httpd.tls = True
    for name, value in attributes.items():
        setattr(httpd, name, value)
    thread = threading.Thread(target=httpd.serve_forever, args=(poll_interval,), daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        if before_close is not None:
            before_close(httpd)
        httpd.server_close()
        thread.join(timeout=10)


def url(server: ThreadingHTTPServer) -> str:
    scheme = "https" if getattr(server, "tls", False) else "http"
    return f"{scheme}://127.0.0.1:{server.server_address[1]}"
