"""The device client's own telemetry, sent to the device's collector over OTLP/HTTP with the
OpenTelemetry Python SDK (Margo: the WFM client's telemetry goes to that collector too).

Imported only when `telemetry.collector` is configured and `telemetry.export` is not false:
a device without telemetry never loads the SDK.

What is sent (resource: `service.name=margo-device`, `service.version`, `margo.device.id`,
`host.name`):

| instrument | kind | attributes |
|---|---|---|
| `margo.device.reconcile.cycles` | counter | `result`: converged, failed, skipped |
| `margo.device.reconcile.duration` | histogram, s | `result` |
| `margo.device.applies` | counter | `action` (install, upgrade, ...), `outcome` (ok, failed) |
| `margo.device.manifest.version` | gauge | `source` (margo-rest; the adopted manifestVersion) |
| `margo.device.journal.depth` | gauge | status reports waiting for delivery |
| `margo.device.sync.last_success` | gauge, s | Unix time of the last fetch the server answered |

and every record of the `margo.device` loggers (the client's log, at the level the
command line sets) as an OTLP log record, with `margo.device.id` and, where a record is
about one deployment, `margo.deployment.id` as attributes.

Never in the way of a reconcile: metrics are collected and exported by the SDK's reader
thread every `telemetry.interval`, log records by its batch thread, each export bounded by
`telemetry.timeout`. The cycle only updates a few numbers (`observe`, in the cycle's own
thread: the gauges' callbacks read those, never the state database, whose connection
belongs to that thread). A collector that is away costs failed exports in those threads
(the SDK logs them) and nothing else; `close()` gives the last export at most
`telemetry.timeout` and then lets the process exit.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from reconciler.telemetry import TelemetryConfig

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from reconciler.state import DeviceState

__all__ = ["DEPLOYMENT_ATTRIBUTE", "DEVICE_ATTRIBUTE", "SERVICE_NAME", "CycleOutcome",
           "DeviceTelemetry"]

SERVICE_NAME = "margo-device"
DEVICE_ATTRIBUTE = "margo.device.id"
DEPLOYMENT_ATTRIBUTE = "margo.deployment.id"
_LOGGER = "margo.device"
_VERSION = "0.1.0"


class CycleOutcome(Protocol):
    """What `DeviceTelemetry.observe` reads of a cycle: `reconciler.runner.CycleResult`,
    which this module does not import (the runner imports the telemetry, not back)."""

    @property
    def contacted(self) -> bool: ...
    @property
    def converged(self) -> bool: ...
    @property
    def fetched(self) -> str: ...
    @property
    def steps(self) -> Sequence[tuple[str, str, str, str]]: ...
    @property
    def pending_reports(self) -> int: ...


class _DeviceAttribute(logging.Filter):
    """Adds the device id to every record the OpenTelemetry handler sees."""

    def __init__(self, device_id: str) -> None:
        super().__init__()
        self.device_id = device_id

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, DEVICE_ATTRIBUTE, self.device_id)
        return True


class DeviceTelemetry:
    """Metrics and logs of one device client (see the module docstring)."""

    def __init__(self, config: TelemetryConfig, *, device_id: str) -> None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        self.config = config
        self.device_id = device_id
        ca = str(config.ca_file) if config.ca_file else None
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": _VERSION,
                                    DEVICE_ATTRIBUTE: device_id,
                                    "host.name": platform.node()})
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{config.collector}/v1/metrics", certificate_file=ca,
                               timeout=config.timeout),
            export_interval_millis=config.interval * 1000,
            export_timeout_millis=config.timeout * 1000)
        # Providers of our own, never the SDK's global ones: nothing else in the process
        # (and no workload) is configured by this.
        self._meters = MeterProvider(resource=resource, metric_readers=[reader])
        meter = self._meters.get_meter("margo.device", _VERSION)
        self._cycles = meter.create_counter(
            "margo.device.reconcile.cycles", unit="{cycle}", description="reconcile cycles")
        self._duration = meter.create_histogram(
            "margo.device.reconcile.duration", unit="s", description="reconcile cycle time")
        self._applies = meter.create_counter(
            "margo.device.applies", unit="{step}", description="steps applied")
        self._manifest: tuple[str, int] | None = None
        self._journal = 0
        self._last_sync: float | None = None
        self._add_gauges(meter)
        self._logs = LoggerProvider(resource=resource)
        self._logs.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=f"{config.collector}/v1/logs", certificate_file=ca,
                            timeout=config.timeout),
            schedule_delay_millis=1000, export_timeout_millis=config.timeout * 1000))
        self._handler = LoggingHandler(level=logging.NOTSET, logger_provider=self._logs)
        self._handler.addFilter(_DeviceAttribute(device_id))
        logging.getLogger(_LOGGER).addHandler(self._handler)

    def _add_gauges(self, meter: Meter) -> None:
        """The gauges read at each export: the adopted manifestVersion, the journal's depth
        and when the server last answered, as the last cycle left them."""
        from opentelemetry.metrics import CallbackOptions, Observation

        def manifest(_: CallbackOptions) -> Iterable[Observation]:
            if self._manifest is not None:
                yield Observation(self._manifest[1], {"source": self._manifest[0]})

        def journal(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(self._journal)

        def last_sync(_: CallbackOptions) -> Iterable[Observation]:
            if self._last_sync is not None:
                yield Observation(self._last_sync)

        meter.create_observable_gauge("margo.device.manifest.version", [manifest],
                                      description="the adopted manifestVersion")
        meter.create_observable_gauge("margo.device.journal.depth", [journal],
                                      unit="{report}",
                                      description="status reports waiting for delivery")
        meter.create_observable_gauge("margo.device.sync.last_success", [last_sync], unit="s",
                                      description="when the server last answered a fetch")

    def observe(self, result: CycleOutcome, seconds: float, state: DeviceState) -> None:
        """Record one finished cycle (called in the cycle's thread)."""
        if not result.contacted:
            outcome = "skipped"
        else:
            outcome = "converged" if result.converged else "failed"
        self._cycles.add(1, {"result": outcome})
        self._duration.record(seconds, {"result": outcome})
        for action, _deployment, _component, done in result.steps:
            self._applies.add(1, {"action": action,
                                  "outcome": "ok" if done == "ok" else "failed"})
        source, _version, manifest_version = state.adopted_marker()
        if manifest_version is not None:
            self._manifest = (source or "margo-rest", int(manifest_version))
        self._journal = result.pending_reports
        if result.fetched in ("unchanged", "adopted"):
            self._last_sync = time.time()

    def close(self) -> None:
        """Stop logging to the collector, then give the last exports at most
        `telemetry.timeout` seconds (in a thread the process does not wait for longer)."""
        logging.getLogger(_LOGGER).removeHandler(self._handler)
        limit = self.config.timeout

        def shut_down() -> None:
            try:
                self._meters.shutdown(timeout_millis=limit * 1000)
                self._logs.shutdown()
            except Exception as exc:
                logging.getLogger(_LOGGER).debug("telemetry shutdown: %s", exc)

        worker = threading.Thread(target=shut_down, name="telemetry-shutdown", daemon=True)
        worker.start()
        worker.join(limit + 1)

    def __enter__(self) -> DeviceTelemetry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
