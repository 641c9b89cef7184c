"""Benchmark: what anonymous request bodies held open cost the server's memory (issue 29).

    .venv/bin/python bench/bodies.py [--hooks 40] [--hook-mib 24] [--onboardings 400]
                                     [--addresses 40]

Starts `margo serve` (its own process, SQLite, a webhook secret and a mirrored source, so
`POST /hooks/git` is served), then attacks it in two rounds, each from `--addresses`
loopback addresses (127.0.1.x: a spread-out attack, so the per-address budget alone cannot
stop it):

1. `--hooks` push hooks of `--hook-mib` MiB each with a forged `X-Hub-Signature-256` (well
   formed, wrong: anyone can send one), every body sent but its last byte and held there;
2. `--onboardings` rc.2 onboarding requests of 1 MiB each (the most the route takes), held
   the same way.

Then every body is finished and every connection closed. Each round has a server of its
own, and for each it prints the server's resident memory (VmRSS, sampled every 20 ms from
/proc) before, at its peak and 2 s after the connections closed, and how the requests were
answered. Copy it into an older checkout to compare (docs/benchmarks.md has both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tools.margoserver import running_margo

ROOT = Path(__file__).resolve().parents[1]


MIB = 1024 * 1024
PIECE = 256 * 1024


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Sampler:
    """The highest VmRSS of `pid` seen while it runs (a thread reading /proc every 20 ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, rss_kib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_kib(self.pid))


async def held_request(port: int, source: str, head: bytes, size: int,
                       holding: asyncio.Barrier, release: asyncio.Event) -> str:
    """Send `head` and `size - 1` body bytes, wait at `holding` until every request got
    that far (or was answered), then send the last byte; the answer's status, or how the
    connection ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    answer = asyncio.create_task(reader.readuntil(b"\r\n"))
    try:
        writer.write(head)
        sent = 0
        while sent < size - 1 and not answer.done():
            piece = min(PIECE, size - 1 - sent)
            writer.write(b" " * piece)
            await writer.drain()
            sent += piece
    except (ConnectionError, OSError):
        pass
    await holding.wait()
    await release.wait()
    try:
        if not answer.done():
            writer.write(b" ")
            await writer.drain()
        line = await asyncio.wait_for(answer, 60)
        outcome = line.split()[1].decode()
    except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError,
            IndexError):
        outcome = "closed"  # without an answer (a reset may swallow one)
    finally:
        answer.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return outcome


async def attack(port: int, pid: int, heads: list[bytes], size: int,
                 addresses: int) -> tuple[int, int, Counter[str]]:
    """Hold `heads` (each with a body of `size` bytes) open at once; (peak KiB while they
    are held and answered, hold seconds, answers)."""
    holding = asyncio.Barrier(len(heads) + 1)
    release = asyncio.Event()
    with Sampler(pid) as sampler:
        tasks = [asyncio.create_task(held_request(
            port, f"127.0.1.{1 + i % addresses}", head, size, holding, release))
            for i, head in enumerate(heads)]
        started = time.monotonic()
        await holding.wait()
        held = time.monotonic() - started
        await asyncio.sleep(1.0)  # everything held: the server keeps what it buffered
        release.set()
        outcomes = Counter(await asyncio.gather(*tasks))
    return sampler.peak, round(held), outcomes


def hook_head(size: int) -> bytes:
    forged = "sha256=" + "0" * 64
    return (f"POST /hooks/git HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"X-GitHub-Event: push\r\nX-Hub-Signature-256: {forged}\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()


def onboarding_head(size: int) -> bytes:
    return (f"POST /api/v1/onboarding HTTP/1.1\r\nHost: bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()


def report(name: str, before: int, peak: int, after: int, held: int,
           outcomes: Counter[str]) -> None:
    answers = ", ".join(f"{count} x {status}" for status, count in sorted(outcomes.items()))
    print(f"{name:<34} RSS before {before / 1024:6.0f} MiB   peak {peak / 1024:6.0f} MiB   "
          f"after {after / 1024:6.0f} MiB   (all held after {held} s; answers: {answers})")


async def one_round(name: str, heads: list[bytes], size: int, addresses: int, port: int,
                    pid: int) -> None:
    before = rss_kib(pid)
    peak, held, outcomes = await attack(port, pid, heads, size, addresses)
    await asyncio.sleep(2.0)
    report(name, before, peak, rss_kib(pid), held, outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hooks", type=int, default=40)
    parser.add_argument("--hook-mib", type=int, default=24)
    parser.add_argument("--onboardings", type=int, default=400)
    parser.add_argument("--addresses", type=int, default=40,
                        help="distinct source addresses 127.0.1.1... (default 40)")
    parser.add_argument("serve_args", nargs="*", metavar="SERVE_OPTION",
                        help="more `margo serve` options, after --")
    args = parser.parse_args()
    print(f"margo serve from {ROOT}, a new server per round; {args.addresses} client "
          "addresses")
    rounds = [(f"{args.hooks} x {args.hook_mib} MiB webhook bodies",
               [hook_head(args.hook_mib * MIB)] * args.hooks, args.hook_mib * MIB),
              (f"{args.onboardings} x 1 MiB onboarding bodies",
               [onboarding_head(MIB)] * args.onboardings, MIB)]
    for name, heads, size in rounds:
        with tempfile.TemporaryDirectory(prefix="margo-bench-bodies-") as tmp:
            root = Path(tmp)
            (root / "secret").write_text("bench-secret\n")
            with running_margo(root / "data", "--webhook-secret-file", str(root / "secret"),
                                "--source-url", str(root / "no-such-repository"),
                                *args.serve_args) as base:
                port = int(base.rsplit(":", 1)[1])
                pid = int(json.loads((root / "data" / "serve.lock").read_text())["pid"])
                asyncio.run(one_round(name, heads, size, args.addresses, port, pid))


if __name__ == "__main__":
    main()
