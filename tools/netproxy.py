"""A real TCP proxy on loopback whose link can be cut and restored: "the network went down"
without touching the server or the client under test. For the tests (`kits.netkit`) and the
benchmarks (`bench.failover`).

While cut, new connections are accepted and closed at once and open ones are closed, so the
client sees exactly what it would see on a dropped link (connection reset / closed).

While silenced, nothing is closed and nothing gets through either way: open connections stay
open and carry no byte, new ones are accepted and never answered. That is a peer that stopped
answering (a hung host, a link that drops packets), which a client only notices by its own
timeout. (`tools.processes.unanswered_port` is the other kind of dead host: one whose
connection attempts are never answered, so a client's connect times out.)

While dropped, the kernel's packet filter (iptables, on loopback) discards every packet to
and from the proxy's port: no byte is delivered and none is acknowledged, as on a real
partition. Unlike silence, a client's TCP stack sees it: unacknowledged data and unanswered
keepalive probes, so its TCP timeouts (`tcp_user_timeout`, keepalives) can notice. Needs
root and iptables (Debian's, which `make` installs with docker.io).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CuttableProxy", "cuttable_proxy"]


class CuttableProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._cut = threading.Event()
        self._silent = threading.Event()
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._dropping = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def silence(self) -> None:
        """From now on nothing gets through and nothing is closed (module docstring)."""
        self._silent.set()

    def drop(self) -> None:
        """From now on the kernel discards every packet to and from the proxy's port
        (module docstring) until `restore`."""
        if not self._dropping:
            self._filter("-I")
            self._dropping = True

    def _filter(self, action: str) -> None:
        for direction in ("--dport", "--sport"):
            subprocess.run(["iptables", "-w", action, "INPUT", "-i", "lo", "-p", "tcp",
                            direction, str(self.port), "-j", "DROP"], check=True,
                           capture_output=True)

    def restore(self) -> None:
        if self._dropping:
            self._filter("-D")
            self._dropping = False
        self._cut.clear()
        self._silent.clear()
        with self._lock:
            held, self._held = self._held, []
        for sock in held:
            sock.close()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self.restore()  # closes the connections held while silent
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            if self._silent.is_set():
                with self._lock:
                    self._held.append(client)  # accepted, never answered
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # the timeout was for connecting: idle links stay up
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data or self._cut.is_set():
                    break
                if not self._silent.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._open.discard(sock)
                sock.close()


@contextmanager
def cuttable_proxy(upstream_port: int) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
