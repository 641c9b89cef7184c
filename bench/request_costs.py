"""Benchmark: the server's CPU for each request a device's update makes (issue 34).

    .venv/bin/python -m bench.request_costs [--requests 3000]

One real `margo serve` (SQLite, one client, one device with one deployment). One
keep-alive connection sends each kind of request `--requests` times, one after another, as
a device does: a manifest poll answered 200 and one answered 304, the deployment's YAML,
and status reports (each saying another state than the one before, so each is stored and
added to the history, as `installing` then `installed` are). Printed: the server's CPU
(user and system, from /proc) per request of each kind, and for status reports how it
splits between the event loop's thread and the store's writer. Why: push → every device
installed is bound by the server's one interpreter (docs/benchmarks.md), and this says
what each of a device update's requests costs there, without 10,000 devices around it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.devices import intent
from tools.fleetserver import MANIFEST, capabilities, fleet_server, write_fleet
from tools.margoserver import margo_server
from tools.processes import cpu_seconds, thread_cpu_seconds

DEVICE = "cost-1"
STATES = ("installing", "installed")


@contextmanager
def _server(work: Path, pids: list[int]) -> Iterator[tuple[str, str, int]]:
    """A server whose fleet gives `DEVICE` one deployment: (base URL, token, its pid)."""
    @contextmanager
    def start(data: Path, *args: str) -> Iterator[str]:
        with margo_server(data, *args) as server:
            pids.append(server.process.pid)
            yield server.url

    with fleet_server(work, fleet=write_fleet(work / "fleet", intents={}),
                      start=start) as server:
        server.put_capabilities(capabilities("k8s-single-amd64", DEVICE))
        server.edit_intent(DEVICE, intent(DEVICE))
        server.wait_for_deployments(1)
        yield server.base, server.token, pids[0]


class Device:
    """One keep-alive connection, speaking as the device."""

    def __init__(self, base: str, token: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.auth = {"Authorization": f"Bearer {token}"}
        manifest, self.etag = self._manifest()
        self.version: int = manifest["manifestVersion"]
        self.deployment: dict[str, str]
        [self.deployment] = manifest["deployments"]

    def _manifest(self) -> tuple[dict[str, Any], str]:
        self.conn.request("GET", "/api/v1/deployments", headers={**self.auth,
                                                                  "Accept": MANIFEST})
        answer = self.conn.getresponse()
        return json.loads(answer.read()), answer.headers["ETag"]

    def request(self, method: str, path: str, headers: dict[str, str],
                body: bytes | None = None) -> int:
        self.conn.request(method, path, body=body, headers={**self.auth, **headers})
        answer = self.conn.getresponse()
        answer.read()
        return answer.status

    def kinds(self) -> dict[str, Callable[[int], int]]:
        deployment_id = self.deployment["deploymentId"]

        def status(index: int) -> int:
            state = STATES[index % 2]
            body = json.dumps({"deploymentId": deployment_id, "deviceId": DEVICE,
                               "adoptedManifestVersion": self.version,
                               "status": {"state": state},
                               "components": [{"name": "web", "state": state}]}).encode()
            return self.request("POST", f"/api/v1/deployments/{deployment_id}/status",
                                {"Content-Type": "application/json"}, body)

        return {
            "manifest poll answered 200": lambda _: self.request(
                "GET", "/api/v1/deployments", {"Accept": MANIFEST}),
            "manifest poll answered 304": lambda _: self.request(
                "GET", "/api/v1/deployments", {"Accept": MANIFEST, "If-None-Match": self.etag}),
            "deployment YAML": lambda _: self.request("GET", self.deployment["url"], {}),
            "status report (stored)": status,
        }


def measure(device: Device, pid: int, requests: int) -> None:
    print(f"{'request':<28} {'status':>6} {'server CPU':>11} {'loop':>7} {'writer':>7}"
          "   (µs per request)")
    for name, send in device.kinds().items():
        statuses = {send(index) for index in range(100)}  # (warm: caches, connection)
        threads = thread_cpu_seconds(pid)
        before, started = sum(cpu_seconds(pid)), time.monotonic()
        for index in range(requests):
            send(index)
        spent = sum(cpu_seconds(pid)) - before
        by_thread = {tid: cpu - threads.get(tid, 0.0)
                     for tid, cpu in thread_cpu_seconds(pid).items()}
        loop = by_thread.pop(str(pid))  # (the main thread's id is the process's)
        writer = max(by_thread.values(), default=0.0)
        per = 1e6 / requests
        print(f"{name:<28} {'/'.join(map(str, sorted(statuses))):>6} {spent * per:>11.0f} "
              f"{loop * per:>7.0f} {writer * per:>7.0f}   "
              f"({(time.monotonic() - started) * per:.0f} µs each end to end)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="margo-bench-costs-") as tmp, \
            _server(Path(tmp), []) as (base, token, pid):
        device = Device(base, token)
        print(f"one SQLite server, one device, one keep-alive connection, "
              f"{args.requests:,} requests of each kind in turn")
        measure(device, pid, args.requests)
        device.conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
