"""Benchmark: what a held waiting poll costs the server in memory (issue 34).

    .venv/bin/python -m bench.held_polls [--connections 5000] [--renewals SECONDS]

One real `margo serve` (SQLite, one client). N connections each get a manifest and stay
open (idle, kept alive); then each sends the conditional poll again with `Prefer: wait=300`,
which the server holds. Printed: the server's resident memory (VmRSS) before the
connections, with N idle ones, and with N held polls, and the difference per connection
and per held poll. All in one server process, so what its heap grew to earlier does not
count twice.

`--renewals S` measures CPU instead, on the same N connections: S seconds of plain
conditional polls answered 304 (each connection once a second), then S seconds of waiting
polls with `Prefer: wait=1` (each held a second, then answered 304 and sent again at
once: a renewal, what a waiting device costs while nothing changes). Printed: the server's
CPU per request of each kind, read from /proc.
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
from tools.processes import cpu_seconds

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


async def _poll_loop(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                     request: bytes, until: float, pace: float, count: list[int]) -> None:
    """Send `request` again and again over one connection until `until`, at most once per
    `pace` seconds, counting the answers."""
    reader, writer = stream
    while (started := time.monotonic()) < until:
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        length = head.partition("content-length: ")[2].partition("\r\n")[0]
        await reader.readexactly(int(length or 0))
        count[0] += 1
        await asyncio.sleep(max(0.0, pace - (time.monotonic() - started)))


async def cpu_per_request(connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                          pid: int, request: bytes, seconds: float, pace: float) -> float:
    """Microseconds of the server's CPU per answered request, over `seconds` of steady
    state (after 3 s of warm-up)."""
    count = [0]
    until = time.monotonic() + seconds + 4
    loops = [asyncio.ensure_future(_poll_loop(c, request, until, pace, count))
             for c in connections]
    await asyncio.sleep(3)
    cpu, answered = sum(cpu_seconds(pid)), count[0]
    await asyncio.sleep(seconds)
    cpu, answered = sum(cpu_seconds(pid)) - cpu, count[0] - answered
    await asyncio.gather(*loops)
    return cpu / max(answered, 1) * 1e6


async def measure_renewals(port: int, pid: int, token: str, count: int, seconds: float) -> None:
    connections, etag = await open_idle(port, token, count)
    poll = (f"GET /api/v1/deployments HTTP/1.1\r\nHost: bench\r\nAccept: {MANIFEST}\r\n"
            f"Authorization: Bearer {token}\r\nIf-None-Match: {etag}\r\n")
    plain = await cpu_per_request(connections, pid, (poll + "\r\n").encode(), seconds, 1.0)
    waiting = await cpu_per_request(connections, pid, (poll + "Prefer: wait=1\r\n\r\n")
                                    .encode(), seconds, 0.0)
    print(f"{count:,} connections, {seconds:g} s each: server CPU {plain:.0f} µs per plain "
          f"poll answered 304, {waiting:.0f} µs per waiting poll's renewal "
          f"({waiting / plain:.2f} times)")
    for _, writer in connections:
        writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--renewals", type=float, default=0.0, metavar="SECONDS",
                        help="measure CPU per plain poll and per renewal instead of memory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="margo-bench-held-") as tmp:
        data = Path(tmp) / "data"
        token = add_client(data, "edge")
        with margo_server(data, "--max-waiters", str(args.connections + 100),
                          "--max-wait", "300") as server:
            pid = server.process.pid
            asyncio.run(measure_renewals(server.port, pid, token, args.connections, args.renewals)
                        if args.renewals else
                        measure(server.port, pid, token, args.connections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
