"""OpenTelemetry spans of a change's way through the fleet, when `margo serve
--otlp-endpoint URL` is given (off by default): receive push -> compile -> each device's
adoption (manifest served, or Git fetch delivered) -> its report.

Every span is recorded whole once its end is known, with the times it really started and
ended (`Tracing.record`): nothing is held open in memory while a device takes minutes or
days to install, and a device's spans can be recorded by whichever replica receives its
report, as children of the compile span another replica recorded (the parent's ids travel
through the database with the change: `wfm.fleet.leadtime`). Export is the SDK's batch
processor with the OTLP/HTTP exporter: a bounded queue (spans beyond it are dropped, never
waited for) drained by a thread of its own, so no request ever waits on the collector.
The SDK is imported only when tracing is on.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["QUEUE_SPANS", "OpenSpan", "Tracing"]

log = logging.getLogger("margo.wfm.tracing")
#: Spans waiting for export at most (the SDK drops newer ones when full).
QUEUE_SPANS = 8192
#: A span context as stored with a change: "<trace id hex>:<span id hex>".
Context = str


class Tracing:
    """Records finished spans (no-ops without an endpoint)."""

    def __init__(self, endpoint: str | None, *, instance: str | None = None) -> None:
        self.enabled = endpoint is not None
        self._provider: Any = None
        self._tracer: Any = None
        if endpoint is None:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({
            "service.name": "margo-wfm",
            "service.instance.id": instance or f"{socket.gethostname()}:{os.getpid()}"})
        # Not the global provider: the server's spans stay the server's, whatever else the
        # process (a test, an embedding program) set up.
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=5),
            max_queue_size=QUEUE_SPANS, schedule_delay_millis=1000))
        self._tracer = self._provider.get_tracer("margo.wfm")

    def begin(self, name: str, *, start: float, parent: Context | None = None,
              links: Iterable[Context] = ()) -> OpenSpan:
        """A span whose end is not known yet (a compile: one at a time, so at most one is
        held open); its context is known at once, for the device spans under it."""
        if self._tracer is None:
            return OpenSpan(None, start)
        return OpenSpan(self._start(name, start, parent, links, None), start)

    def record(self, name: str, *, start: float, end: float, parent: Context | None = None,
               links: Iterable[Context] = (), attributes: Mapping[str, Any] | None = None,
               ) -> Context | None:
        """Record a finished span (`start`, `end`: Unix times), a child of `parent` (a
        context `record` returned, here or on another replica), linked to `links`; its
        context, or None when tracing is off."""
        if self._tracer is None:
            return None
        opened = OpenSpan(self._start(name, start, parent, links, attributes), start)
        opened.end(end)
        return opened.context

    def _start(self, name: str, start: float, parent: Context | None,
               links: Iterable[Context], attributes: Mapping[str, Any] | None) -> Any:
        from opentelemetry import trace

        return self._tracer.start_span(
            name, context=_context(parent), start_time=_ns(start),
            links=[trace.Link(c) for c in (_span_context(link) for link in links) if c],
            attributes=_attributes(attributes))

    def close(self) -> None:
        """Export what is queued (a few seconds at most) and stop."""
        if self._provider is not None:
            try:
                self._provider.shutdown()
            except Exception:  # a collector that is gone must not fail the shutdown
                log.warning("exporting the last spans failed", exc_info=True)


class OpenSpan:
    """A span begun and not ended yet (`Tracing.begin`); all no-ops when tracing is off."""

    def __init__(self, span: Any, start: float) -> None:
        self._span, self._start = span, start
        ids = None if span is None else span.get_span_context()
        self.context: Context | None = (None if ids is None
                                         else f"{ids.trace_id:032x}:{ids.span_id:016x}")

    def end(self, end: float, attributes: Mapping[str, Any] | None = None, *,
            error: str | None = None) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span, self._span = self._span, None
        span.set_attributes(_attributes(attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(max(end, self._start)))


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _span_context(context: Context | None) -> Any:
    if not context:
        return None
    from opentelemetry import trace

    try:
        trace_id, span_id = (int(part, 16) for part in context.split(":"))
    except ValueError:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))


def _context(parent: Context | None) -> Any:
    """An OpenTelemetry context whose current span is `parent` (None: a new trace)."""
    from opentelemetry import context, trace

    span_context = _span_context(parent)
    if span_context is None:
        return context.Context()  # a root, whatever the calling thread's context holds
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))
