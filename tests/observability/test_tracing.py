"""Exporter selection from the OTEL_* environment, and span-loss accounting."""

from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from headroom.config import ConfigError
from headroom.observability.tracing import Tracing, exporter_from_env


def test_tracing_is_off_unless_an_endpoint_is_set():
    assert exporter_from_env({}) is None
    assert exporter_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None
    assert Tracing(None).enabled is False
    assert Tracing(None).start("POST /v1/completions", {}, time.monotonic()) is None


@pytest.mark.parametrize(
    "env,kind",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, GrpcExporter),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            HttpExporter,
        ),
        # The traces-specific variable wins over the general one.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            HttpExporter,
        ),
    ],
)
def test_protocol_picks_the_exporter(env, kind):
    assert type(exporter_from_env(env)) is kind


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
    ],
)
def test_standard_switches_turn_tracing_off(env):
    assert exporter_from_env(env) is None


def test_an_unknown_protocol_is_a_config_error():
    with pytest.raises(ConfigError, match="'http/json' is not supported; use one of grpc, http/protobuf"):
        exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


class BlockedExporter(SpanExporter):
    """Holds the first export until released, like a collector that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait()  # the test releases it, on failure too
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def test_a_full_queue_drops_spans_and_counts_them(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "2")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    inner = BlockedExporter()
    tracing = Tracing(inner)
    now = time.monotonic()
    ended = threading.Event()

    def end_ten() -> None:
        for i in range(10):
            span = tracing.start(f"span {i}", {}, now)
            tracing.end(span, now + 0.001, {"i": i})
        ended.set()

    ender = threading.Thread(target=end_ten)
    ender.start()
    try:
        # Ending a span never waits on the exporter: all ten end while it is still held.
        # (The timeout only keeps a broken build from hanging here.)
        assert ended.wait(60), "ending a span waited on a hung exporter"
    finally:
        inner.release.set()
        ender.join()
    tracing.shutdown()
    dropped = tracing.dropped_spans()
    assert inner.exported + dropped == 10
    assert dropped >= 7  # the queue holds 2 and the blocked export at most 1
    assert tracing.exporter.exported == inner.exported and tracing.exporter.failed == 0
