"""Is the device's OpenTelemetry collector there? For a device that is not a Kubernetes
cluster (a Compose host, a render device), the doctor's `otel-collector` check and the
capability report's `otelCollector` both ask the collector itself.

An OTLP/HTTP receiver answers an empty export request (`POST <collector>/v1/logs`,
`Content-Type: application/x-protobuf`, no body: a valid, empty `ExportLogsServiceRequest`)
with 200; anything else that answers is not one. A configured gRPC endpoint must accept a
TCP connection (speaking HTTP/2 to it would take a gRPC client, which the device does not
need otherwise). The probe never raises: it says what it found.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from reconciler.telemetry import TelemetryConfig

__all__ = ["CollectorProbe", "CollectorWatch", "probe_collector"]


@dataclass(frozen=True)
class CollectorProbe:
    found: bool
    detail: str


def _grpc_reachable(url: str, timeout: float) -> str | None:
    """None when `url`'s host and port accept a TCP connection; else why not."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 4317)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except OSError as exc:
        return f"the OTLP/gRPC endpoint {url} refuses connections ({exc.strerror or exc})"


def probe_collector(config: TelemetryConfig, *, timeout: float = 3.0) -> CollectorProbe:
    """Ask the configured collector (see the module docstring)."""
    url = f"{config.collector}/v1/logs"
    verify: str | bool = str(config.ca_file) if config.ca_file else True
    try:
        answer = httpx.post(url, content=b"", timeout=timeout, verify=verify,
                            headers={"Content-Type": "application/x-protobuf"})
    except httpx.HTTPError as exc:
        return CollectorProbe(False, f"no OTLP/HTTP receiver answers at {config.collector}: "
                                     f"{exc or type(exc).__name__}")
    if answer.status_code != 200:
        return CollectorProbe(False, f"{url} answered {answer.status_code} to an empty OTLP "
                                     "export: not an OTLP/HTTP receiver")
    grpc = config.inject.grpc_endpoint if config.inject else None
    if grpc and urlsplit(grpc).hostname == urlsplit(config.collector).hostname:
        # Only where the workloads' gRPC address is one this host can try too (a
        # container's view, such as host.docker.internal, may not resolve here).
        problem = _grpc_reachable(grpc, timeout)
        if problem:
            return CollectorProbe(False, problem)
    return CollectorProbe(True, f"an OTLP/HTTP receiver answers at {config.collector}")


class CollectorWatch:
    """`otelCollector` for the host capability report, without holding a cycle up: a
    daemon thread probes every `every` seconds, and a call answers with the latest result
    (the first call waits for the first probe, at most `timeout` seconds; a collector that
    drops packets would otherwise cost every cycle the probe's timeout)."""

    def __init__(self, config: TelemetryConfig, *, every: float = 30.0,
                 timeout: float = 2.0) -> None:
        self.config, self.every, self.timeout = config, every, timeout
        self._found = False
        self._first = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            self._found = probe_collector(self.config, timeout=self.timeout).found
            self._first.set()
            time.sleep(self.every)

    def __call__(self) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="collector-probe",
                                            daemon=True)
            self._thread.start()
        self._first.wait(self.timeout + 1)
        return self._found
