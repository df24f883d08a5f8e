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
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
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
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
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
        self.submitted = 0  # handed to export(), whatever came of it
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.submitted += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - whatever broke, the spans are lost: count them
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


class BoundedBatchProcessor(SpanProcessor):
    """The SDK's BatchSpanProcessor, with its queue's overflow counted: a span that would
    not fit (spans accepted but not yet handed to the exporter fill the queue) is dropped
    here, where it is counted, instead of inside the SDK, where it is only logged."""

    def __init__(self, exporter: CountingExporter, max_queue_size: int):
        self.exporter = exporter
        self.max_queue_size = max_queue_size
        self.accepted = 0
        self.dropped = 0
        self.inner = BatchSpanProcessor(exporter, max_queue_size=max_queue_size)

    def on_start(self, span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        # Only ever an overestimate of the SDK queue's length (the worker pops a batch
        # before it calls export), so the SDK's own queue never overflows.
        if self.accepted - self.exporter.submitted >= self.max_queue_size:
            self.dropped += 1
            return
        self.accepted += 1
        self.inner.on_end(span)

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
        queue_size = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048"))
        self.processor = BoundedBatchProcessor(self.exporter, queue_size)
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(self.processor)
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
        child = self._tracer.start_span(name, context=context, start_time=self.wall_ns(start_s), attributes=attributes)
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
        return self.processor.dropped + self.exporter.failed

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop."""
        if self._provider is not None:
            self._provider.shutdown()
