"""Spans over the real OTLP wire formats, into receivers running in this process: a gRPC
TraceService (grpcio + opentelemetry-proto) and an OTLP/HTTP endpoint."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import socket
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

CONFIG = Config(cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=8))
PHASES = ("admission", "queue", "prefill", "decode")
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Collected:
    """Every span any export delivered, with its resource's attributes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[dict, object]] = []
        self.raw: list[bytes] = []  # each OTLP/HTTP export's body, decompressed

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, raw: bytes = b"") -> None:
        with self.lock:
            self.raw.append(raw)
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collected: Collected):
        self.collected = collected
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        self.collected.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(None)


class HttpReceiver:
    def __init__(self, collected: Collected):
        self.collected = collected

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces", self.path
                assert self.headers["Content-Type"] == "application/x-protobuf"
                collected.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body), body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attributes(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


def run_workload(monkeypatch, default_model, protocol: str, receiver_cls) -> tuple[list, list[dict], Collected]:
    collected = Collected()
    receiver = receiver_cls(collected)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    server = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    seen = []
    try:
        for i, traceparent in enumerate([True, False, True, False]):
            headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"} if traceparent else {}
            stream = client.chat.completions.create(
                model=server.engine.loaded.name,
                messages=[{"role": "user", "content": f"Say {i} words about tea."}],
                max_tokens=6 + i,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
                extra_body={"ignore_eos": True},
            )
            chunks = list(stream)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            seen.append(
                {
                    "id": chunks[0].id,
                    "usage": chunks[-1].usage,
                    "finish": finish,
                    "traceparent": traceparent,
                    "max_tokens": 6 + i,
                }
            )
    finally:
        server.stop()  # flushes the batch processor
        receiver.stop()
    return seen, collected.spans, collected


@pytest.mark.parametrize("protocol,receiver_cls", [("grpc", GrpcReceiver), ("http/protobuf", HttpReceiver)])
def test_one_span_per_sequence_with_phases_and_attributes(monkeypatch, default_model, protocol, receiver_cls):
    seen, spans, _ = run_workload(monkeypatch, default_model, protocol, receiver_cls)
    roots = [s for _, s in spans if s.name == "POST /v1/chat/completions"]
    assert len(roots) == len(seen)
    assert {r[0]["service.name"] for r in spans} == {"headroom"}
    by_id = {attributes(s.attributes)["gen_ai.response.id"]: s for s in roots}
    assert set(by_id) == {s["id"] for s in seen}

    for sent in seen:
        root = by_id[sent["id"]]
        attrs = attributes(root.attributes)
        if sent["traceparent"]:
            assert root.trace_id.hex() == CALLER_TRACE
            assert root.parent_span_id.hex() == CALLER_SPAN
        else:
            assert root.trace_id.hex() != CALLER_TRACE
            assert root.parent_span_id == b""
        assert root.kind == root.SPAN_KIND_SERVER
        usage = sent["usage"]
        assert attrs["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
        assert attrs["gen_ai.request.max_tokens"] == sent["max_tokens"]
        assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == sent["max_tokens"]
        assert attrs["gen_ai.response.finish_reasons"] == sent["finish"] == ["length"]
        assert attrs["http.response.status_code"] == 200
        # No tenant config: the client's API key is its identity (named by its hash).
        assert attrs["headroom.tenant"] == "key-" + hashlib.sha256(b"unused").hexdigest()[:12]
        assert attrs["headroom.tier"] == "standard"
        assert attrs["headroom.size_class"] in ("short", "medium", "long")
        assert attrs["headroom.admission.decision"] == "admit"
        assert attrs["headroom.predicted_output_tokens"] > 0
        assert attrs["headroom.predicted_output_tokens_p90"] >= attrs["headroom.predicted_output_tokens"]
        duration = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
        assert 0 <= attrs["headroom.queue_wait_s"] <= attrs["headroom.ttft_s"] <= attrs["headroom.e2e_s"]
        assert attrs["headroom.e2e_s"] == pytest.approx(duration, abs=1e-3)
        assert 0 < attrs["headroom.device_time_s"] <= duration
        assert attrs["headroom.peak_blocks"] >= 1 and attrs["headroom.kv_block_seconds"] > 0
        assert attrs["headroom.preemptions"] == 0

        children = {s.name: s for _, s in spans if s.parent_span_id == root.span_id}
        assert set(children) == set(PHASES)
        for name in PHASES:
            child = children[name]
            assert child.trace_id == root.trace_id
            assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
            assert child.end_time_unix_nano <= root.end_time_unix_nano
        # The phases follow one another: admission -> queue -> prefill -> decode.
        for earlier, later in itertools.pairwise(PHASES):
            assert children[earlier].end_time_unix_nano == children[later].start_time_unix_nano
        first_token = (children["prefill"].end_time_unix_nano - root.start_time_unix_nano) / 1e9
        assert first_token == pytest.approx(attrs["headroom.ttft_s"], abs=1e-6)


def test_a_dead_collector_costs_only_counted_spans(monkeypatch, default_model):
    # Nothing listens on this port: every export fails, and the requests do not notice.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    server = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    tracing = server.app[keys.OBSERVABILITY].tracing
    try:
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
    finally:
        server.stop()
    # 3 sequences x (1 span + 4 phases), all lost and all counted.
    assert tracing.exporter.exported == 0
    assert tracing.dropped_spans() == 15
