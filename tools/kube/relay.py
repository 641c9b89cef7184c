"""Byte relays between the host and real nodes' private network namespaces.

Each real node (realnode.py) lives in a network namespace of its own, so that its pod
bridge, pod interfaces and kube-proxy's iptables rules exist only there and vanish with
it; the host's interfaces, routes and firewall are never touched. The control plane stays
on the host's loopback. Two kinds of relay join them, with no interface on the host:

- **into a node**: the API server (and any other host loopback port the node is given,
  such as a registry's) is served inside the node on the same port, by a listener created
  in the node's namespace whose connections are made from the host's
  (`socket_in` switches one thread's network namespace for the moment a socket is made;
  a socket stays in the namespace it was made in);
- **out of the API server**: kube-apiserver sends its traffic to nodes and pods (logs,
  exec, port-forward, the pod and service proxies) through an HTTP CONNECT proxy on a Unix
  socket (its `EgressSelectorConfiguration`, egress `cluster`): `serve_egress` answers
  there, finds which node owns the address asked for (`<dir>/<node>.json`: its node IP and
  pod range) and hands the CONNECT on to that node's own Unix socket, where the node
  (`serve_connect`, in its namespace) connects to the address.

`python -m tools.kube.relay egress SOCKET DIR` runs the egress proxy (the control plane
starts it with the API server).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["CLONE_NEWNET", "serve_connect", "serve_egress", "setns", "socket_in",
           "unshare_net"]

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_HEADERS_LIMIT = 16384


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at `fd`."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


def unshare_net() -> None:
    """Give the calling thread (and what it starts from now on) a new network namespace."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


def socket_in(namespace: int, family: int = socket.AF_INET) -> socket.socket:
    """A non-blocking TCP socket made in the network namespace open at `namespace`."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        setns(namespace)
        try:
            made = socket.socket(family, socket.SOCK_STREAM)
        finally:
            setns(here)
    finally:
        os.close(here)
    made.setblocking(False)
    return made


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.close()


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """Copy both ways until both sides have closed."""
    await asyncio.gather(_pump(a[0], b[1]), _pump(b[0], a[1]))


async def connect_in(namespace: int, host: str, port: int,
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to `host:port` as seen from the namespace open at `namespace`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket_in(namespace, family)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def forward(listener: socket.socket, namespace: int, port: int) -> asyncio.Server:
    """Serve `listener` (already bound, in any namespace) by connecting each client to
    127.0.0.1:`port` of the namespace open at `namespace`."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await connect_in(namespace, "127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await splice((reader, writer), upstream)

    listener.setblocking(False)
    return await asyncio.start_server(handle, sock=listener)


async def _read_connect(reader: asyncio.StreamReader) -> tuple[str, int] | None:
    """The target of an HTTP CONNECT request (its headers read and dropped)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    request = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(request) != 3 or request[0] != "CONNECT":
        return None
    host, _, port = request[1].rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _answer(writer: asyncio.StreamWriter, status: str) -> None:
    writer.write(f"HTTP/1.1 {status}\r\n\r\n".encode())


async def serve_connect(path: Path, namespace: int) -> asyncio.Server:
    """A CONNECT proxy on the Unix socket `path` whose connections are made from the
    namespace open at `namespace` (a node's end of the egress path)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = await _read_connect(reader)
        if target is None:
            _answer(writer, "400 Bad Request")
            writer.close()
            return
        try:
            upstream = await connect_in(namespace, *target)
        except OSError as error:
            _answer(writer, f"502 Bad Gateway ({error.strerror or error})")
            writer.close()
            return
        _answer(writer, "200 Connection established")
        await splice((reader, writer), upstream)

    return await asyncio.start_unix_server(handle, path=str(path), limit=_HEADERS_LIMIT)


def _owner(directory: Path, host: str) -> Path | None:
    """The Unix socket of the node that owns `host` (its node IP or within its pod range),
    from the `<node>.json` files the running nodes wrote."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for card in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            facts = json.loads(card.read_text())
            names = {facts.get("name")} | set(facts.get("addresses", []))
            inside = address is not None and any(
                address in ipaddress.ip_network(cidr) for cidr in facts.get("podCIDRs", []))
            if host in names or inside:
                return card.with_suffix(".sock")
    return None


async def serve_egress(path: Path, directory: Path) -> asyncio.Server:
    """The API server's egress proxy: a CONNECT to a node or pod address is passed on to
    the owning node's CONNECT socket; anything else is refused (502), so no request of the
    API server ever leaves this machine's namespaces."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = await _read_connect(reader)
        node = None if target is None else _owner(directory, target[0])
        if target is None or node is None:
            _answer(writer, "502 Bad Gateway (no real node has that address)")
            writer.close()
            return
        try:
            upstream = await asyncio.open_unix_connection(str(node), limit=_HEADERS_LIMIT)
        except OSError:
            _answer(writer, "502 Bad Gateway (the node is not running)")
            writer.close()
            return
        upstream[1].write(f"CONNECT {target[0]}:{target[1]} HTTP/1.1\r\n\r\n".encode())
        await splice((reader, writer), upstream)  # the node answers the CONNECT itself

    return await asyncio.start_unix_server(handle, path=str(path), limit=_HEADERS_LIMIT)


def run_forever(start: Callable[[], object]) -> None:
    """Run an event loop with what `start()` (a coroutine) sets up, until SIGTERM."""
    async def main() -> None:
        await start()  # type: ignore[misc]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()

    asyncio.run(main())


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "egress":
        sys.exit("usage: python -m tools.kube.relay egress SOCKET DIRECTORY")
    socket_path, cards = Path(sys.argv[2]), Path(sys.argv[3])
    run_forever(lambda: serve_egress(socket_path, cards))
