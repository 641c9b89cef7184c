"""Benchmark: how long a device needs to reach the live replica when the server URL it uses
stops answering (docs/device.md, "Several server URLs").

    .venv/bin/python -m bench.failover [--trials 3] [--interval 5s] [--timeout 10s]
        [--sources margo-rest,git] [--faults refused,silent] [--setups single,balancer,fallback]

Two real `margo serve` replicas on one PostgreSQL database (tools/replicas.py, on a private
server: tools/postgres.py), a real OCI registry, and the real `margo device run` (render
driver, tools/devices.py) in its own process. Each trial gives a new device a first
URL that leads to replica A, lets it install its deployment, then breaks that way in:

* `refused`: replica A is killed (SIGKILL): its port refuses connections;
* `silent`: the device reaches A through a proxy (tools/netproxy.py) that is silenced:
  open connections carry nothing and new ones are accepted and never answered.

and changes the device's intent. The figure is the time from the new state being served
(by replica B) until B holds the device's `installed` report about the new bytes, so it
includes up to one polling interval, the apply and the status report. Setups:

* `single`: `server.url` is A's way in, nothing else (never reaches B);
* `balancer`: `server.url` is a round-robin balancer without health checks in front of A's
  way in and B (tools/balancer.py: 502 when its upstream fails). Other devices' traffic
  goes through it too (a thread sends `GET /livez` at random moments), so each request of
  the device reaches either replica at random: alone, the round robin would send the same
  requests of every cycle to the same replica;
* `fallback`: `server.url` is A's way in, `server.fallbackUrls` is B.

A trial that has not converged after `--give-up` seconds counts as "not within".
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from tools.balancer import balancing
from tools.charts import publish_example_charts
from tools.devices import Device, current, intent, new_device, new_digest, running_device
from tools.netproxy import CuttableProxy, cuttable_proxy
from tools.polling import poll_until
from tools.postgres import running_postgres
from tools.registry import running_registry
from tools.replicas import ReplicaPair, replica_pair


def configure(device: Device, args: argparse.Namespace, fallbacks: list[str]) -> None:
    config = yaml.safe_load(device.config.read_text())
    config["server"]["timeout"] = args.timeout
    config["schedule"]["interval"] = args.interval
    if fallbacks:
        config["server"]["fallbackUrls"] = fallbacks
    device.config.write_text(yaml.safe_dump(config))


@contextlib.contextmanager
def other_traffic(url: str) -> Iterator[None]:
    """Requests of other devices through the balancer at random moments (module docstring)."""
    done = threading.Event()

    def send() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.wait(random.uniform(0.0, 0.2)):
                with contextlib.suppress(httpx.HTTPError):
                    http.get(f"{url}/livez")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)


def entry(setup: str, balancer_url: str | None, first: str, second: str) -> tuple[str, list[str]]:
    """The device's server.url and fallbackUrls for a setup."""
    if setup == "balancer":
        assert balancer_url is not None
        return balancer_url, []
    return first, [second] if setup == "fallback" else []


def trial(pair: ReplicaPair, proxy: CuttableProxy, source: str, fault: str, setup: str,
          name: str, args: argparse.Namespace) -> float | None:
    """One device through one fault (module docstring): seconds to converge, None if not."""
    first, second = pair.replicas
    server = pair.servers[1]
    way_in = proxy.url if fault == "silent" else first.base
    with contextlib.ExitStack() as stack:
        balancer = (stack.enter_context(balancing([way_in, second.base]))
                    if setup == "balancer" else None)
        if balancer is not None:
            stack.enter_context(other_traffic(balancer.url))
        url, fallbacks = entry(setup, balancer.url if balancer else None, way_in, second.base)
        device = new_device(server, name, source=source, url=url)
        configure(device, args, fallbacks)
        stack.enter_context(running_device(device))
        old = poll_until("the first install", lambda: current(server, name), timeout=120,
                         interval=0.1)
        if fault == "refused":
            first.kill()
        else:
            proxy.silence()
        server.edit_intent(name, intent(name, greeting="Bonjour"))
        new = poll_until("the new state", lambda: new_digest(server, name, old), timeout=60,
                         interval=0.05)
        served = time.monotonic()
        try:
            poll_until("the report about the new state", lambda: current(server, name, new),
                       timeout=args.give_up, interval=0.1)
        except TimeoutError:
            return None
        return time.monotonic() - served


def restore(pair: ReplicaPair, proxy: CuttableProxy) -> None:
    """Replica A back up on its port, its proxy passing traffic again."""
    first = pair.replicas[0]
    if first.process is None or first.process.poll() is not None:
        first.start()
    proxy.restore()


def describe(times: list[float | None], give_up: float) -> str:
    done = [t for t in times if t is not None]
    missed = len(times) - len(done)
    parts = []
    if done:
        parts.append(f"median {statistics.median(done):.1f} s (min {min(done):.1f}, "
                     f"max {max(done):.1f})")
    if missed:
        parts.append(f"{missed} of {len(times)} not within {give_up:g} s")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--interval", default="5s", help="the device's schedule.interval")
    parser.add_argument("--timeout", default="10s", help="the device's server.timeout")
    parser.add_argument("--give-up", type=float, default=150.0)
    parser.add_argument("--sources", default="margo-rest,git")
    parser.add_argument("--faults", default="refused,silent")
    parser.add_argument("--setups", default="single,balancer,fallback")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="margo-bench-failover-"))
    with running_registry(work / "registry") as registry, running_postgres() as postgres:
        publish_example_charts(registry)
        with replica_pair(work / "fleet", database=postgres.create_database("failover"),
                          registry=registry) as pair, \
                cuttable_proxy(pair.replicas[0].port) as proxy:
            print(f"interval {args.interval}, server.timeout {args.timeout}; seconds from the "
                  "new state served to the device's report about it stored (PostgreSQL with "
                  "fsync=off: tools/postgres.py)")
            run(pair, proxy, args)


def run(pair: ReplicaPair, proxy: CuttableProxy, args: argparse.Namespace) -> None:
    """Every combination of source, fault and setup, `--trials` times: one line each."""
    count = 0
    for source in args.sources.split(","):
        for fault in args.faults.split(","):
            for setup in args.setups.split(","):
                times = []
                for _ in range(args.trials):
                    count += 1
                    try:
                        times.append(trial(pair, proxy, source, fault, setup, f"d{count}",
                                           args))
                    finally:
                        restore(pair, proxy)
                print(f"{source:10} {fault:8} {setup:9} {describe(times, args.give_up)}",
                      flush=True)


if __name__ == "__main__":
    main()
