"""OpenTelemetry traces: one span per sequence, exported over OTLP.

The exporter and its endpoint come from the standard OTEL_* environment variables;
tracing is off unless an OTLP endpoint is set. Spans go through a BatchSpanProcessor,
whose own thread serialises and sends them, so neither the engine nor the event loop
ever waits on a collector. A dead collector costs dropped spans, which are counted.

A sequence's span starts when its HTTP request arrives and ends when it finishes; the
phases (admission, queue, prefill, decode) are children built at the end from the
timestamps on the Request, so nothing is done per token.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from headroom.config import ConfigError

PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()


def exporter_from_env(environ: Mapping[str, str] = os.environ) -> SpanExporter | None:
    """The OTLP span exporter the environment asks for, or None when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if not (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    # grpc is the Python SDK's long-standing default; the spec's default (http/protobuf)
    # is one variable away.
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")
    return OTLPSpanExporter()  # reads endpoint, headers, timeout and TLS from the environment


class CountingExporter(SpanExporter):
    """Passes spans on and counts what the collector took and what was lost."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    def __init__(self, exporter: SpanExporter | None, version: str = "0"):
        self.exporter = CountingExporter(exporter) if exporter is not None else None
        # Monotonic request timestamps become wall-clock span times through one offset.
        self._wall_minus_mono_ns = time.time_ns() - time.monotonic_ns()
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if self.exporter is None:
            return
        attributes = {"service.version": version}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "headroom"
        # The SDK counts spans its queue dropped as a metric; this reader lets us read it.
        self._processor_metrics = InMemoryMetricReader()
        self._meters = MeterProvider(metric_readers=[self._processor_metrics])
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(self.exporter, meter_provider=self._meters))
        self._tracer = self._provider.get_tracer("headroom", version)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_minus_mono_ns

    def start(self, name: str, headers: Mapping[str, str], start_s: float) -> Span | None:
        """A sequence's span, child of the caller's when a W3C traceparent header came."""
        if self._tracer is None:
            return None
        parent = _PROPAGATOR.extract(headers)
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=self.wall_ns(start_s))

    def phase(self, parent: Span, name: str, start_s: float, end_s: float, attributes: dict | None = None) -> None:
        """A finished child span of `parent` between two monotonic times."""
        assert self._tracer is not None
        context = trace.set_span_in_context(parent)
        child = self._tracer.start_span(name, context=context, start_time=self.wall_ns(start_s),
                                        attributes=attributes)
        child.end(end_time=self.wall_ns(max(end_s, start_s)))

    def end(self, span: Span, end_s: float, attributes: dict, error: str | None = None) -> None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.wall_ns(end_s))

    def dropped_spans(self) -> int:
        """Spans lost to a full queue or a failed export since start."""
        if self.exporter is None:
            return 0
        dropped = self.exporter.failed
        data = self._processor_metrics.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != "otel.sdk.processor.span.processed":
                        continue
                    for point in metric.data.data_points:
                        if point.attributes.get("error.type"):
                            dropped += int(point.value)
        return dropped

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop."""
        if self._provider is not None:
            self._provider.shutdown()
            self._meters.shutdown()
