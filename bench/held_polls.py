"""Benchmark: what a held waiting poll costs the server in memory (issue 34).

    .venv/bin/python -m bench.held_polls [--connections 5000]

One real `margo serve` (SQLite, one client). N connections each get a manifest and stay
open (idle, kept alive); then each sends the conditional poll again with `Prefer: wait=300`,
which the server holds. Printed: the server's resident memory (VmRSS) before the
connections, with N idle ones, and with N held polls, and the difference per connection
and per held poll. All in one server process, so what its heap grew to earlier does not
count twice.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench.waiting import held_polls
from tools.fleetserver import add_client
from tools.margoserver import margo_server

MANIFEST = "application/vnd.margo.manifest.v1+json"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def open_idle(port: int, token: str, count: int
                    ) -> tuple[list[tuple[asyncio.StreamReader, asyncio.StreamWriter]], str]:
    """`count` connections that each got the manifest once; and its ETag."""
    request = (f"GET /api/v1/deployments HTTP/1.1\r\nHost: bench\r\nAccept: {MANIFEST}\r\n"
               f"Authorization: Bearer {token}\r\n\r\n").encode()
    connections, etag = [], ""
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        await reader.readexactly(int(headers.get("content-length", "0")))
        etag = headers.get("etag", etag)
        connections.append((reader, writer))
    return connections, etag


def hold(connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]], token: str,
         etag: str) -> None:
    request = (f"GET /api/v1/deployments HTTP/1.1\r\nHost: bench\r\nAccept: {MANIFEST}\r\n"
               f"Authorization: Bearer {token}\r\nIf-None-Match: {etag}\r\n"
               "Prefer: wait=300\r\n\r\n").encode()
    for _, writer in connections:
        writer.write(request)


async def measure(port: int, pid: int, token: str, count: int) -> None:
    await asyncio.sleep(2)
    empty = rss_mib(pid)
    connections, etag = await open_idle(port, token, count)
    await asyncio.sleep(2)
    idle = rss_mib(pid)
    hold(connections, token, etag)
    deadline = time.monotonic() + 120
    while (held_polls(port, token) or 0) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(2)
    held = rss_mib(pid)
    print(f"{count:,} connections: server RSS {empty:.1f} MiB without them, {idle:.1f} MiB "
          f"idle ({(idle - empty) * 1024 / count:.1f} KiB each), {held:.1f} MiB with a held "
          f"poll on each ({(held - idle) * 1024 / count:.1f} KiB per held poll; "
          f"{held_polls(port, token)} held)")
    for _, writer in connections:
        writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="margo-bench-held-") as tmp:
        data = Path(tmp) / "data"
        token = add_client(data, "edge")
        with margo_server(data, "--max-waiters", str(args.connections + 100),
                          "--max-wait", "300") as server:
            asyncio.run(measure(server.port, server.process.pid, token, args.connections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
