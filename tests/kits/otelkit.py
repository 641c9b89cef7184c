"""The OpenTelemetry Collector the tests send to, and what it received:
`tools.otel.collector`, which the benchmarks use too."""

from __future__ import annotations

from tools.otel.collector import (
    Collector,
    LogRecord,
    MetricPoint,
    Received,
    Span,
    attributes,
    read_output,
    running_collector,
)

__all__ = ["Collector", "LogRecord", "MetricPoint", "Received", "Span", "attributes",
           "read_output", "running_collector"]
