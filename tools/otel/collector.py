"""A real OpenTelemetry Collector (tools/otel, built from the pinned Go modules) on loopback,
and a reader for what it received: for the tests (`kits.otelkit`) and the benchmarks.

    with running_collector(tmp_path) as collector:      # OTLP/HTTP and OTLP/gRPC receivers
        collector.http, collector.grpc                  # "http://127.0.0.1:PORT"
        collector.wait_for("a log", lambda: collector.log_records())

The collector writes everything it receives (logs, metrics, traces) with the contrib file
exporter, one OTLP/JSON document per line; `Received` parses that file into plain records:
resource and record attributes flattened into dicts (`intValue` as int, arrays as lists).
One collector is shared by a test session (`otel_collector` in tests/reconciler/conftest.py);
tests tell their records apart by attributes (device id, deployment id, service name).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from tools.otel.otelbuild import binary
from tools.polling import poll_until
from tools.processes import die_with_parent, free_port, stop, wait_until_ready

__all__ = ["Collector", "LogRecord", "MetricPoint", "Received", "Span", "attributes",
           "read_output", "running_collector"]

T = TypeVar("T")


def _value(value: dict[str, Any]) -> Any:
    """One OTLP/JSON AnyValue as plain data."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes(value["kvlistValue"].get("values", []))
    return None


def attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    """OTLP/JSON key-value list → dict."""
    return {item["key"]: _value(item.get("value") or {}) for item in items or []}


@dataclass(frozen=True)
class LogRecord:
    body: Any
    severity: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


@dataclass(frozen=True)
class MetricPoint:
    """One data point of one metric (sums and gauges: `value`; histograms: `count` and
    `sum`)."""

    name: str
    kind: str  # sum | gauge | histogram
    attributes: dict[str, Any]
    resource: dict[str, Any]
    value: float | None = None
    count: int | None = None
    sum: float | None = None


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: dict[str, Any]


@dataclass
class Received:
    logs: list[LogRecord]
    metrics: list[MetricPoint]
    spans: list[Span]


def _points(metric: dict[str, Any], resource: dict[str, Any]) -> Iterator[MetricPoint]:
    name = metric.get("name", "")
    for kind in ("sum", "gauge"):
        for point in (metric.get(kind) or {}).get("dataPoints", []):
            raw = point.get("asDouble", point.get("asInt"))
            yield MetricPoint(name, kind, attributes(point.get("attributes")), resource,
                              value=None if raw is None else float(raw))
    for point in (metric.get("histogram") or {}).get("dataPoints", []):
        yield MetricPoint(name, "histogram", attributes(point.get("attributes")), resource,
                          count=int(point.get("count", 0)), sum=float(point.get("sum", 0.0)))


def read_output(path: Path) -> Received:
    """Parse the file exporter's output (one OTLP/JSON export request per line; a line still
    being written is ignored)."""
    received = Received([], [], [])
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return received
    for line in lines:
        try:
            document = json.loads(line)
        except ValueError:
            continue
        for resource_logs in document.get("resourceLogs", []):
            resource = attributes((resource_logs.get("resource") or {}).get("attributes"))
            for scope_logs in resource_logs.get("scopeLogs", []):
                scope = str((scope_logs.get("scope") or {}).get("name", ""))
                for record in scope_logs.get("logRecords", []):
                    received.logs.append(LogRecord(
                        body=_value(record.get("body") or {}),
                        severity=str(record.get("severityText", "")),
                        attributes=attributes(record.get("attributes")),
                        resource=resource, scope=scope))
        for resource_metrics in document.get("resourceMetrics", []):
            resource = attributes((resource_metrics.get("resource") or {}).get("attributes"))
            for scope_metrics in resource_metrics.get("scopeMetrics", []):
                for metric in scope_metrics.get("metrics", []):
                    received.metrics.extend(_points(metric, resource))
        for resource_spans in document.get("resourceSpans", []):
            resource = attributes((resource_spans.get("resource") or {}).get("attributes"))
            for scope_spans in resource_spans.get("scopeSpans", []):
                received.spans.extend(Span(
                    name=str(span.get("name", "")), trace_id=str(span.get("traceId", "")),
                    span_id=str(span.get("spanId", "")),
                    parent_span_id=str(span.get("parentSpanId", "")),
                    kind=int(span.get("kind", 0)), attributes=attributes(span.get("attributes")),
                    resource=resource, status=dict(span.get("status") or {}))
                    for span in scope_spans.get("spans", []))
    return received


_CONFIG = {
    "receivers": {"otlp": {"protocols": {"http": {"endpoint": None},
                                         "grpc": {"endpoint": None}}}},
    "processors": {"batch": {"timeout": "100ms"}},
    "exporters": {"file": {"path": None, "flush_interval": "100ms"}},
    "service": {
        "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        "pipelines": {signal: {"receivers": ["otlp"], "processors": ["batch"],
                               "exporters": ["file"]}
                      for signal in ("logs", "metrics", "traces")}},
}


@dataclass
class Collector:
    """A running collector: its OTLP endpoints (base URLs) and what it received."""

    http: str
    grpc: str
    output: Path
    process: subprocess.Popen[bytes]

    @property
    def grpc_address(self) -> str:
        return self.grpc.removeprefix("http://")

    def received(self) -> Received:
        return read_output(self.output)

    def log_records(self, **match: Any) -> list[LogRecord]:
        """Log records whose attributes (or resource attributes) include `match`."""
        return [r for r in self.received().logs
                if all({**r.resource, **r.attributes}.get(k) == v for k, v in match.items())]

    def spans(self, **match: Any) -> list[Span]:
        """Spans whose attributes (or resource attributes) include `match`."""
        return [s for s in self.received().spans
                if all({**s.resource, **s.attributes}.get(k) == v for k, v in match.items())]

    def metric_points(self, name: str, **match: Any) -> list[MetricPoint]:
        return [p for p in self.received().metrics if p.name == name
                and all({**p.resource, **p.attributes}.get(k) == v for k, v in match.items())]

    def wait_for(self, what: str, predicate: Callable[[], T], timeout: float = 30.0) -> T:
        return poll_until(what, predicate, timeout=timeout, interval=0.2)


@contextmanager
def running_collector(folder: Path) -> Iterator[Collector]:
    """The collector on two free loopback ports, writing to `<folder>/received.jsonl`."""
    folder.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    config = json.loads(json.dumps(_CONFIG))
    protocols = config["receivers"]["otlp"]["protocols"]
    protocols["http"]["endpoint"] = f"127.0.0.1:{http_port}"
    protocols["grpc"]["endpoint"] = f"127.0.0.1:{grpc_port}"
    output = folder / "received.jsonl"
    config["exporters"]["file"]["path"] = str(output)
    (folder / "collector.yaml").write_text(yaml.safe_dump(config))
    log_path = folder / "collector.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(binary()), "--config", f"file:{folder / 'collector.yaml'}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)

    def ready() -> bool:
        # An empty export request is a valid one: 200 means the OTLP/HTTP receiver runs.
        answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/logs", content=b"",
                            headers={"Content-Type": "application/x-protobuf"}, timeout=2)
        return answer.status_code == 200

    try:
        wait_until_ready(process, ready, "the OpenTelemetry Collector", log_path)
        yield Collector(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{grpc_port}",
                        output, process)
    finally:
        stop(process)
