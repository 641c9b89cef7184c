"""bench/fleet.py's waiting polls (`--polling waiting`, issue 34): how a simulated device
paces its polls, what the servers spend while nothing changes (`--quiet`), and how long a
restarted server takes to have every waiting device back (`--restart`).

A waiting device sends `Prefer: wait=N` (`--wait`) with its conditional poll, over a
connection of its own (a held poll occupies it), and paces itself as the real client does
(`reconciler.sources.waiting`): the next poll at once after a held answer or a new state;
after a poll that got no answer (or a 5xx), full jitter growing per failure (uniform in
[0, 2^(k-1)] s, capped at the period); after a plain answer from a server that held none
yet, the period, as an interval device.

Run through `bench/fleet.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tools.processes import cpu_seconds

__all__ = ["QuietFigures", "RestartFigures", "collected", "held_polls", "pause", "prefer",
           "print_figures", "quiet_seconds", "quiet_window", "reconnected"]

#: The first back-off window after a failure (seconds), doubled per failure in a row.
BACKOFF_FIRST = 1.0


@dataclass
class QuietFigures:
    """What the servers (and PostgreSQL) spent over a window in which nothing changed."""

    seconds: float
    server_cpu: list[float]  # CPU seconds per server over the window
    postgres_cpu: float | None
    requests: int
    server_rss: list[float]  # resident MiB of each server at the window's end (VmRSS)
    #: The collections after the setup's compile, before the window (`collected`).
    collections: list[float | None] = field(default_factory=list)

    def per_minute(self, cpu: float) -> float:
        return cpu * 60 / self.seconds


@dataclass
class RestartFigures:
    """A server restarted under waiting devices: SIGTERM at t = 0."""

    stopped: float  # the old process had exited
    listening: float  # the new one answered /readyz
    reconnected: float | None  # every device's poll held again (None: not within the limit)
    held: int
    devices: int
    errors: dict[str, int] = field(default_factory=dict)


def prefer(args: Any, etag: str | None) -> dict[str, str]:
    """The waiting poll's header, for a conditional poll in waiting mode."""
    return {"Prefer": f"wait={args.wait:g}"} if etag and args.polling == "waiting" else {}


def quiet_seconds(args: Any) -> float:
    """`--quiet`, in waiting mode rounded up to a whole number of waits. Why: the setup
    leaves the devices waiting in step (they all learnt their state within seconds of each
    other), so in a window of 90 s with `--wait 60` each device's poll comes back once,
    not 1.5 times: the CPU per minute read from it was two thirds of the steady state's."""
    if args.polling != "waiting" or not args.quiet:
        return float(args.quiet)
    return math.ceil(args.quiet / args.wait) * float(args.wait)


def pause(args: Any, device: Any, retry: float | None) -> float:
    """Seconds until a device's next poll (module docstring); `retry`: what the server asked
    for (Retry-After), None for none."""
    jittered = args.period * random.uniform(1 - args.jitter, 1 + args.jitter)
    outcome, device.outcome = device.outcome, None
    if retry is not None:
        return retry
    if args.polling != "waiting":
        return jittered
    if outcome in ("held", "changed"):
        device.failures = 0
        return 0.0
    if outcome == "plain" and not device.holding:
        return jittered
    device.failures += 1
    window = BACKOFF_FIRST * 2 ** min(device.failures - 1, 30)
    return random.uniform(0, window) if window < args.period else \
        random.uniform(args.period / 2, args.period)


async def first_holds_over(args: Any, steady: float) -> None:
    """In waiting mode, until every device's first held poll (sent as the setup ended, at
    `steady`, a `time.monotonic()`) has run out. Why: that first poll was parsed and taken
    through the request stack, and its renewals are not (docs/server.md, "Renewals skip the
    request stack"): a window that starts at the steady state spends its first wait
    answering the first polls, and reads more than the steady state costs."""
    if args.polling == "waiting":
        await asyncio.sleep(max(0.0, steady + args.wait + 2 - time.monotonic()))


async def quiet_window(servers: list[Any], postgres_pid: int | None, seconds: float,
                       stats: Any, tree_cpu: Any) -> QuietFigures:
    """Measure `seconds` of steady state: nothing is pushed meanwhile."""
    before = [sum(cpu_seconds(s.process.pid)) for s in servers]
    postgres_before = tree_cpu(postgres_pid) if postgres_pid else None
    stats.reset()
    await asyncio.sleep(seconds)
    after = [sum(cpu_seconds(s.process.pid)) for s in servers]
    return QuietFigures(seconds, [a - b for a, b in zip(after, before, strict=True)],
                        tree_cpu(postgres_pid) - postgres_before
                        if postgres_pid and postgres_before is not None else None,
                        sum(stats.counts.values()), [_rss_mib(s.process.pid) for s in servers])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _metrics(port: int, token: str) -> dict[str, float] | None:
    """The unlabelled samples of the server on `port`'s `/metrics` (None: it does not
    answer); `token`: one that may read them."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
            request, timeout=5) as answer:
        text = answer.read().decode()
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if not sample.labels}
    return None


def held_polls(port: int, token: str) -> int | None:
    """`margo_waiting_polls_held` of the server on `port` (None: it does not answer);
    `token`: one that may read `/metrics`."""
    samples = _metrics(port, token)
    held = samples.get("margo_waiting_polls_held") if samples is not None else None
    return int(held) if held is not None else None


def _collection_done(port: int, token: str) -> float | None:
    """Seconds the server's collection after its last compile took, once it ran (None:
    not yet, or no answer)."""
    samples = _metrics(port, token)
    if samples is None:
        return None
    collected = samples.get("margo_compile_collection_last_timestamp_seconds", 0.0)
    if collected < samples.get("margo_compile_last_success_timestamp_seconds", 0.0):
        return None
    return samples.get("margo_compile_collection_duration_seconds_sum", 0.0)


async def collected(servers: list[Any], token: str, limit: float) -> list[float | None]:
    """Wait (at most `limit` seconds) until each server has run the full collection that
    follows its last compile (`wfm.fleet.compiles`: once devices have taken the change up,
    at most `COLLECT_LATEST` after it). Why: it walks the whole heap once per compile (about
    a second at 10,000 devices), so a quiet window that starts as the setup ends would
    count it as steady-state CPU. Returned: the seconds each server's collections took in
    all (None: not done within the limit), printed beside the window's figures."""
    deadline = time.monotonic() + limit
    done: list[float | None] = [None] * len(servers)
    while time.monotonic() < deadline:
        for index, server in enumerate(servers):
            if done[index] is None:
                done[index] = await asyncio.to_thread(_collection_done, server.port, token)
        if all(seconds is not None for seconds in done):
            break
        await asyncio.sleep(0.5)
    return done


async def reconnected(port: int, token: str, devices: int, started: float,
                      limit: float) -> float | None:
    """Seconds after `started` until the server on `port` holds `devices` polls (None: not
    within `limit` seconds)."""
    while time.monotonic() - started < limit:
        held = await asyncio.to_thread(held_polls, port, token)
        if held is not None and held >= devices:
            return time.monotonic() - started
        await asyncio.sleep(0.25)
    return None


def print_figures(results: list[Any], args: Any) -> None:
    """The quiet window's and the restart's figures of each run that measured them."""
    quiet = [r for r in results if r.quiet is not None]
    if quiet:
        print(f"\nnothing changing ({args.polling} polling"
              + (f", wait={args.wait:g}" if args.polling == "waiting" else
                 f", P = {args.period:g} s") + "): CPU seconds per minute (resident memory "
              "at the end), requests per minute")
        for r in quiet:
            figures: QuietFigures = r.quiet
            servers = "; ".join(f"server {i}: {figures.per_minute(cpu):.2f} s ({rss:.0f} MiB)"
                                for i, (cpu, rss) in enumerate(zip(
                                    figures.server_cpu, figures.server_rss, strict=True)))
            postgres = (f"; PostgreSQL: {figures.per_minute(figures.postgres_cpu):.2f} s"
                        if figures.postgres_cpu is not None else "")
            per_request = sum(figures.server_cpu) / max(figures.requests, 1) * 1e6
            print(f"  {r.store}: {servers}{postgres}; "
                  f"{figures.requests * 60 / figures.seconds:,.0f} requests per minute "
                  f"(over {figures.seconds:g} s; {per_request:.0f} µs of server CPU each)")
            if figures.collections:
                took = ", ".join("not within the limit" if seconds is None
                                 else f"{seconds:.2f} s" for seconds in figures.collections)
                print(f"    before the window, the collection after the setup's compile: "
                      f"{took}")
    for r in results:
        restart: RestartFigures | None = r.restart
        if restart is None:
            continue
        back = (f"{restart.reconnected:.1f} s" if restart.reconnected is not None
                else f"NOT within the limit ({restart.held:,} of {restart.devices:,} held)")
        errors = ", ".join(f"{k}: {v:,}" for k, v in sorted(restart.errors.items())) or "none"
        print(f"\nserver restart ({r.store}, SIGTERM at t = 0): old process gone "
              f"{restart.stopped:.1f} s, new one ready {restart.listening:.1f} s, every "
              f"device's poll held again {back}; errors the devices met: {errors}")
