"""Benchmark: 1,000 simulated devices against a running `margo serve` on loopback.

    .venv/bin/python bench/serve.py [--devices 1000] [--seconds 5] [--concurrency 64]

Starts a server (its own process, SQLite, the example fleet), registers one client per
device, and prints requests per second and p50/p99 latency for: capability reports,
manifest polls answered 304, durable status reports (over `--concurrency` shared
connections, and again with every device on a connection of its own, offered at `--rate`
reports per second in total: two reports per device), and Git no-change fetches; plus the
bytes one no-change poll costs on each transport. The server is started with
`--max-connections` above `--devices` (`--devices 10000` needs an open-files limit of about
10,100 in each process). `--scrape-every 5` also scrapes `GET /metrics` every 5 s
throughout, as a Prometheus server would; `--scrape-rounds N` measures what that costs:
status reports N times without and N times with scraping, alternating on one server.
The load generator is a minimal
keep-alive HTTP/1.1 client on asyncio (so it costs the shared 2 cores less than a
general-purpose client would).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.margoserver import margo_server
from tools.processes import cpu_seconds
from wfm.identity.clients import ClientRegistry
from wfm.store.sqlitedb import SqliteDatabase

ROOT = Path(__file__).resolve().parents[1]


class Connection:
    """One keep-alive HTTP/1.1 connection: request bytes out, (status, headers, body) in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(self, method: str, path: str, headers: dict[str, str],
                      body: bytes = b"") -> tuple[int, dict[str, str], bytes, int]:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body or method in ("PUT", "POST"):
            lines.append(f"Content-Length: {len(body)}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        response_headers = {}
        for line in header_lines:
            if ":" in line:
                name, _, value = line.partition(":")
                response_headers[name.strip().lower()] = value.strip()
        length = int(response_headers.get("content-length", "0"))
        payload = await self.reader.readexactly(length) if length else b""
        return int(status_line.split()[1]), response_headers, payload, len(head) + length

    def close(self) -> None:
        self.writer.close()


def summary(name: str, latencies: list[float], elapsed: float, extra: str = "") -> None:
    if not latencies:
        print(f"{name}: no requests")
        return
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    median = statistics.median(ordered) * 1000
    print(f"{name}: {len(latencies) / elapsed:,.0f} req/s, p50 {median:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms ({len(latencies):,} requests){extra}")


async def run_load(port: int, jobs: list[tuple[str, str, dict[str, str], bytes]],
                   concurrency: int, seconds: float | None,
                   expect: set[int]) -> tuple[list[float], float]:
    """Run the jobs (cycled when `seconds` is set) over `concurrency` connections."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds if seconds else None
    queue_index = 0

    async def worker() -> None:
        nonlocal queue_index
        connection = await Connection.open(port)
        try:
            while True:
                if deadline is None and queue_index >= len(jobs):
                    return
                if deadline is not None and time.perf_counter() > deadline:
                    return
                method, path, headers, body = jobs[queue_index % len(jobs)]
                queue_index += 1
                start = time.perf_counter()
                status, _, payload, _ = await connection.request(method, path, headers, body)
                latencies.append(time.perf_counter() - start)
                if status not in expect:
                    raise RuntimeError(f"{method} {path}: {status} {payload[:200]!r}")
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


#: A device's HTTP client drops a connection idle this long (httpx keeps one 5 s; the server
#: now keeps it `--keep-alive`, 75 s): a device whose next request comes later opens a new
#: connection (its cost is in the latency).
IDLE_CLOSE = 4.5


async def open_loop(port: int, jobs: list[list[tuple[str, str, dict[str, str], bytes]]],
                    rate: float, expect: set[int]) -> tuple[list[float], float]:
    """Each device on a connection of its own (as real devices are), its requests sent
    one after another, the k-th request of the whole load due at k / `rate` seconds
    whether or not earlier ones were answered (open loop: a server that falls behind
    shows it as latency, not as a lower offered rate). Latency counts from when a request
    was due. With many devices a device's reports are more than the server's keep-alive
    timeout apart; it then reconnects first, as a real device's HTTP client does."""
    connections = [await Connection.open(port) for _ in jobs]
    latencies: list[float] = []
    start = time.perf_counter() + 0.2
    order = sorted(((k * len(jobs) + d) / rate, d, k)
                   for d, device_jobs in enumerate(jobs) for k in range(len(device_jobs)))
    due: list[list[float]] = [[] for _ in jobs]
    for when, d, _ in order:
        due[d].append(when)

    async def device(d: int) -> None:
        answered = time.perf_counter()
        for (method, path, headers, body), when in zip(jobs[d], sorted(due[d]), strict=True):
            delay = start + when - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() - answered >= IDLE_CLOSE:  # as an HTTP client's pool does
                connections[d].close()
                connections[d] = await Connection.open(port)
            status, _, payload, _ = await connections[d].request(method, path, headers, body)
            answered = time.perf_counter()
            latencies.append(time.perf_counter() - (start + when))
            if status not in expect:
                raise RuntimeError(f"{method} {path}: {status} {payload[:200]!r}")

    try:
        await asyncio.gather(*(device(d) for d in range(len(jobs))))
    finally:
        for connection in connections:
            connection.close()
    return latencies, time.perf_counter() - start


def capabilities(index: int) -> dict[str, Any]:
    return {"properties": {
        "id": f"device-{index:04d}", "vendor": "Example", "modelNumber": "B1",
        "serialNumber": f"SN{index}", "cpus": [{"cores": 4, "architecture": "amd64"}],
        "memory": "8Gi", "storage": "64Gi", "peripherals": [], "interfaces": [{"type": "ethernet"}],
        "otelCollector": True, "supportedRuntimes": ["oci"],
        "supportedDeploymentTypes": ["compose"]},
        "labels": {"example.com/site": random.choice(["plant-a", "plant-b"])}}


async def scraping(port: int, every: float, seen: list[tuple[float, int]]) -> None:
    """Scrape `GET /metrics` every `every` seconds (until cancelled), as Prometheus does."""
    connection = await Connection.open(port)
    try:
        while True:
            start = time.perf_counter()
            status, _, body, _ = await connection.request("GET", "/metrics", {})
            if status != 200:
                raise RuntimeError(f"GET /metrics: {status} {body[:200]!r}")
            seen.append((time.perf_counter() - start, len(body)))
            await asyncio.sleep(max(0.0, every - (time.perf_counter() - start)))
    finally:
        connection.close()


async def scrape_cost(port: int, jobs: list[tuple[str, str, dict[str, str], bytes]],
                      args: argparse.Namespace) -> None:
    """Status reports over shared connections for `--scrape-seconds`, alternately without
    and with `GET /metrics` scraped every `--scrape-every` s, `--scrape-rounds` times each:
    alternating on one server, so load from elsewhere on the machine hits both alike, in
    the order without, with, with, without, ... (ABBA), so a drift over the run (the
    database grows with every report) weighs on both alike too. Besides the rate, the
    server's own CPU time per report (from /proc): what scraping costs the server itself,
    which other load on a shared machine disturbs less than throughput."""
    figures: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(2 * args.scrape_rounds):
        scraped = round_ % 4 in (1, 2)
        scrapes: list[tuple[float, int]] = []
        scraper = (asyncio.create_task(scraping(port, args.scrape_every, scrapes))
                   if scraped else None)
        before = sum(cpu_seconds(args.server_pid, children=False))
        latencies, elapsed = await run_load(port, jobs, args.concurrency, args.scrape_seconds,
                                            {200, 201})
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
        figures[scraped].append(len(latencies) / elapsed)
        used = sum(cpu_seconds(args.server_pid, children=False)) - before
        cpu[scraped].append(used / len(latencies) * 1e6)
    without, with_ = (statistics.median(figures[k]) for k in (False, True))
    print(f"status reports, {args.scrape_rounds} x {args.scrape_seconds:g} s each, ABBA: "
          f"without scraping {without:,.0f} req/s (median; {_rates(figures[False])}), "
          f"scraped every {args.scrape_every:g} s {with_:,.0f} req/s ({_rates(figures[True])}):"
          f" {100 * (with_ - without) / without:+.1f} %")
    without, with_ = (statistics.median(cpu[k]) for k in (False, True))
    print(f"server CPU per status report: without scraping {without:,.0f} µs (median; "
          f"{_rates(cpu[False])}), scraped {with_:,.0f} µs ({_rates(cpu[True])}): "
          f"{100 * (with_ - without) / without:+.1f} %")


def _rates(values: list[float]) -> str:
    return ", ".join(f"{v:,.0f}" for v in values)


async def scenario(port: int, tokens: list[str], args: argparse.Namespace) -> None:
    scrapes: list[tuple[float, int]] = []
    scraper = (asyncio.create_task(scraping(port, args.scrape_every, scrapes))
               if args.scrape_every > 0 and not args.scrape_rounds else None)
    try:
        await _scenario(port, tokens, args)
    finally:
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
    if scraper is not None and scrapes:
        times = sorted(t for t, _ in scrapes)
        print(f"GET /metrics every {args.scrape_every:g} s alongside: {len(times)} scrapes, "
              f"p50 {statistics.median(times) * 1000:.1f} ms, max {times[-1] * 1000:.1f} ms, "
              f"{scrapes[-1][1]:,} bytes")


async def _scenario(port: int, tokens: list[str], args: argparse.Namespace) -> None:
    n = len(tokens)
    auth = [{"Authorization": f"Bearer {t}", "Content-Type": "application/json"} for t in tokens]
    jobs = [("PUT", f"/api/v1/capabilities/device-{i:04d}", auth[i],
             json.dumps(capabilities(i)).encode()) for i in range(n)]
    latencies, elapsed = await run_load(port, jobs, args.concurrency, None, {200, 201})
    summary("capability reports (first, durable)", latencies, elapsed)

    # Wait until the compile has given every device its deployment.
    connection = await Connection.open(port)
    etags: list[str] = []
    deployments: list[str] = []
    deadline = time.monotonic() + 120
    for i in range(n):
        while True:
            _, headers, body, _ = await connection.request("GET", "/api/v1/deployments",
                                                           auth[i])
            manifest = json.loads(body)
            if manifest["deployments"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        etags.append(headers["etag"])
        deployments.append(manifest["deployments"][0]["deploymentId"]
                           if manifest["deployments"] else "")
    _, _, _, size_304 = await connection.request(
        "GET", "/api/v1/deployments", {**auth[0], "If-None-Match": etags[0]})
    connection.close()

    jobs = [("GET", "/api/v1/deployments", {**auth[i], "If-None-Match": etags[i]}, b"")
            for i in range(n)]
    latencies, elapsed = await run_load(port, jobs, args.concurrency, args.seconds, {304})
    summary("manifest polls answered 304", latencies, elapsed,
            f"; {size_304} bytes per no-change poll response")

    states = ["installing", "installed"]
    jobs = []
    for round_ in range(4):
        for i in range(n):
            if deployments[i]:
                body = json.dumps({"deploymentId": deployments[i], "adoptedManifestVersion": 1,
                                   "status": {"state": states[round_ % 2]},
                                   "components": [{"name": "hello-world-compose",
                                                   "state": states[round_ % 2]}]}).encode()
                jobs.append(("POST", f"/api/v1/deployments/{deployments[i]}/status", auth[i],
                             body))
    latencies, elapsed = await run_load(port, jobs, args.concurrency, None, {200, 201})
    summary("status reports (durable)", latencies, elapsed)
    if args.scrape_rounds:
        await scrape_cost(port, jobs, args)

    # The shape of a fleet: every device on its own connection, all reporting within the
    # same second or two at `--rate` reports per second in total.
    per_device = [[(m, p, h, b) for m, p, h, b in jobs[:2 * n] if h is auth[i]]
                  for i in range(n) if deployments[i]]
    latencies, elapsed = await open_loop(port, per_device, args.rate, {200, 201})
    summary(f"status reports (durable; one connection per device, {len(per_device):,} "
            f"connections, offered {args.rate:,.0f}/s)", latencies, elapsed)

    jobs = [("PUT", f"/api/v1/capabilities/device-{i:04d}", auth[i],
             json.dumps(capabilities(i)).encode()) for i in range(n)]
    latencies, elapsed = await run_load(port, jobs, args.concurrency, None, {200, 201})
    summary("capability reports (unchanged, durable)", latencies, elapsed)


def git_polls(base: str, token: str, polls: int) -> None:
    from wfm.git.githttp import git_app  # noqa: F401 - the server must host Git

    work = Path(tempfile.mkdtemp(prefix="margo-bench-git-"))
    url = base.replace("http://", f"http://device-0000:{token}@") + "/git/devices/device-0000.git"
    subprocess.run(["git", "clone", "-q", "--branch", "devices/device-0000", url, str(work / "c")],
                   check=True, capture_output=True, env={"PATH": "/usr/bin:/bin",
                                                         "GIT_TERMINAL_PROMPT": "0"})
    latencies = []
    start = time.perf_counter()
    for _ in range(polls):
        t = time.perf_counter()
        subprocess.run(["git", "-C", str(work / "c"), "fetch", "-q"], check=True,
                       capture_output=True, env={"PATH": "/usr/bin:/bin",
                                                 "GIT_TERMINAL_PROMPT": "0"})
        latencies.append(time.perf_counter() - t)
    summary("Git no-change fetches (git CLI, one process each)", latencies,
            time.perf_counter() - start)
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--git-polls", type=int, default=50)
    parser.add_argument("--rate", type=float, default=2000.0,
                        help="offered status reports per second, one connection per device")
    parser.add_argument("--scrape-every", type=float, default=0.0, metavar="SECONDS",
                        help="also scrape GET /metrics every SECONDS throughout (0: never)")
    parser.add_argument("--scrape-rounds", type=int, default=0, metavar="N",
                        help="measure what scraping costs: status reports N times without "
                             "and N times with scraping every --scrape-every (default 5) "
                             "seconds, alternating")
    parser.add_argument("--scrape-seconds", type=float, default=10.0, metavar="SECONDS",
                        help="how long each of those rounds lasts (default 10)")
    args = parser.parse_args()
    if args.scrape_rounds and args.scrape_every <= 0:
        args.scrape_every = 5.0
    random.seed(7)
    with tempfile.TemporaryDirectory(prefix="margo-bench-serve-") as tmp:
        root = Path(tmp)
        shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
        data = root / "data"
        db = SqliteDatabase(data / "wfm.sqlite")
        registry = ClientRegistry(db)
        tokens = [registry.add(f"device-{i:04d}")[1] for i in range(args.devices)]
        db.close()
        # One connection per device in the open-loop phase, besides the shared ones.
        connections = max(8192, args.devices + args.concurrency + 16)
        with margo_server(data, "--source", str(root / "fleet"),
                          "--max-connections", str(connections)) as server:
            args.server_pid = server.process.pid  # the scrape rounds read its CPU time
            asyncio.run(scenario(server.port, tokens, args))
            try:
                git_polls(server.url, tokens[0], args.git_polls)
            except (ImportError, subprocess.CalledProcessError) as exc:
                print(f"Git no-change fetches: not measured ({exc})")


if __name__ == "__main__":
    main()
