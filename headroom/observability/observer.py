"""One place that sees every request begin and end, and feeds the span, the metrics,
the log line and the head-of-line monitor from the same facts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from opentelemetry.trace import Span, format_trace_id

from headroom.config import ObservabilityConfig
from headroom.contracts.request import Request
from headroom.observability.finished import FinishedRequest
from headroom.observability.hol import HolMonitor, HolState
from headroom.observability.ledger import Usage, UsageLedger
from headroom.observability.logs import log_finished
from headroom.observability.metrics import AdmissionView, Metrics, refused_outcome
from headroom.observability.predictor_health import PredictorHealth
from headroom.observability.split import SplitSignal, SplitState
from headroom.observability.tracing import Tracing, exporter_from_env
from headroom.observability.windows import LatencyWindows
from headroom.runtime.engine import Engine

log = logging.getLogger("headroom.observability")

# A Responses request is a chat request under another shape (headroom/app/responses.py).
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "chat"}


@dataclass
class RequestTrace:
    """What the handler learns about one HTTP request as it goes."""

    endpoint: str
    arrival: float  # time.monotonic() when the handler started
    span: Span | None
    request_id: str | None = None
    tenant: str | None = None
    tier: str | None = None
    engine_request: Request | None = None  # once it is built
    prompt: list[dict] | None = None  # the messages, only kept when prompt logging is on

    @property
    def trace_id(self) -> str | None:
        if self.span is None:
            return None
        return format_trace_id(self.span.get_span_context().trace_id)


class Observability:
    def __init__(
        self,
        config: ObservabilityConfig,
        engine: Engine,
        admission: AdmissionView | None,
        tracing: Tracing | None = None,
    ):
        self.config = config
        self.engine = engine
        self.tracing = tracing if tracing is not None else Tracing(exporter_from_env(), package_version())
        self.predictor_health = PredictorHealth(config.predictor_health_window, config.predictor_health_min_requests)
        self.metrics = Metrics(engine, admission, self.tracing.dropped_spans, self.predictor_health)
        self.ledger = (
            UsageLedger(config.usage_ledger_path, config.usage_retention_days) if config.usage_ledger_path else None
        )
        self.windows = LatencyWindows()
        self.split = SplitSignal()
        self.split_state: SplitState | None = None
        self.hol = HolMonitor(config, self.windows)
        if self.tracing.enabled:
            log.info("tracing: exporting spans over OTLP")

    def start(self, endpoint: str, headers, arrival: float) -> RequestTrace:
        return RequestTrace(endpoint, arrival, self.tracing.start(f"POST {endpoint}", headers, arrival))

    def finish(self, trace: RequestTrace, http_status: int, error: str | None = None) -> FinishedRequest:
        end = time.monotonic()
        model = self.engine.loaded.name
        done = FinishedRequest.build(
            request_id=trace.request_id or "",
            endpoint=trace.endpoint,
            model=model,
            http_status=http_status,
            arrival=trace.arrival,
            end=end,
            request=trace.engine_request,
            tenant=trace.tenant,
            tier=trace.tier,
            error=error,
        )
        self.metrics.observe(done)
        self.predictor_health.observe(done)
        if done.ran and done.finish_reason in ("stop", "length", "repetition"):
            self.split.observe(
                done.prompt_tokens + done.output_tokens, done.device_time_s, done.size_class, done.tenant or "none"
            )
        if not done.ran:  # one that ran is charged when the engine is done with it (charge)
            self.record_usage(Usage.of_refused(done, refused_outcome(done)))
        if done.ttft_s is not None and done.first_token_at is not None:
            self.windows.observe(done.size_class, done.first_token_at, done.ttft_s, done.e2e_s)
        if trace.span is not None:
            self._end_span(trace, done, end)
        log_finished(done, trace.trace_id, trace.prompt if self.config.log_prompts else None)
        return done

    def _end_span(self, trace: RequestTrace, done: FinishedRequest, end: float) -> None:
        span, request = trace.span, trace.engine_request
        if request is not None and done.ran:
            admitted = request.admitted_time
            self.tracing.phase(
                span,
                "admission",
                trace.arrival,
                admitted,
                {"headroom.admission.decision": done.admission_decision or "off"},
            )
            scheduled = request.first_scheduled_time
            if scheduled is not None:
                self.tracing.phase(span, "queue", admitted, scheduled)
                first = request.first_token_time
                finished = request.finished_time if request.finished_time is not None else end
                self.tracing.phase(
                    span,
                    "prefill",
                    scheduled,
                    first if first is not None else finished,
                    {"headroom.cached_tokens": done.cached_tokens},
                )
                if first is not None:
                    self.tracing.phase(span, "decode", first, finished)
        # As the HTTP conventions say: a 4xx is the caller's error, not the server span's.
        failed = done.http_status >= 500 or done.abort_cause == "engine_error"
        self.tracing.end(span, end, span_attributes(done), error=(done.error or "engine error") if failed else None)

    def refresh(self) -> HolState:
        """The head-of-line signal as of now (the server's control loop acts on it)."""
        state = self.hol.update(self.engine.snapshot(), self.engine.counters())
        metrics = self.metrics
        metrics.hol_coupling.set(1 if state.coupled else 0)
        metrics.long_device_share.set(state.long_device_share)
        for size_class, (p50, p99) in state.ttft_s.items():
            metrics.rolling_ttft.labels(size_class, "0.5").set(p50)
            metrics.rolling_ttft.labels(size_class, "0.99").set(p99)
        self.split_state = split = self.split.state()
        if split is not None:
            metrics.split_ratio.labels("tokens").set(split.tokens_ratio)
            metrics.split_ratio.labels("device_seconds").set(split.device_ratio)
        return state

    def note_hol(self, action: str | None, factor: float) -> None:
        """What the head-of-line loop did with the last signal."""
        if action is not None:
            self.metrics.hol_actions.labels(action).inc()
        self.metrics.long_lane_factor.set(factor)

    def charge(self, request: Request) -> None:
        """The engine has finished with a request it ran: charge its tenant (AsyncEngine.on_closed)."""
        self.record_usage(Usage.of_request(request))

    def record_usage(self, usage: Usage) -> None:
        self.metrics.charge(usage)
        if self.ledger is not None:
            self.ledger.record(usage)

    def shutdown(self) -> None:
        self.tracing.shutdown()
        if self.ledger is not None:
            self.ledger.close()


def span_attributes(done: FinishedRequest) -> dict:
    """OpenTelemetry GenAI attributes where they fit, headroom's own under `headroom.`."""
    attributes = {
        "gen_ai.operation.name": OPERATIONS.get(done.endpoint, done.endpoint),
        "gen_ai.request.model": done.model,
        "gen_ai.response.model": done.model,
        "gen_ai.response.id": done.request_id or None,
        "gen_ai.request.max_tokens": done.max_tokens,
        "gen_ai.request.temperature": done.temperature,
        "gen_ai.request.top_p": done.top_p,
        "gen_ai.usage.input_tokens": done.prompt_tokens if done.ran else None,
        "gen_ai.usage.output_tokens": done.output_tokens if done.ran else None,
        "gen_ai.response.finish_reasons": [done.finish_reason] if done.finish_reason else None,
        "http.request.method": "POST",
        "url.path": done.endpoint,
        "http.response.status_code": done.http_status,
        "headroom.tenant": done.tenant,
        "headroom.lora": done.lora,
        "headroom.tier": done.tier,
        "headroom.size_class": done.size_class,
        "headroom.admission.decision": done.admission_decision,
        "headroom.predicted_output_tokens": done.predicted_output_tokens,
        "headroom.predicted_output_tokens_p90": done.predicted_output_tokens_p90,
        "headroom.cached_tokens": done.cached_tokens,
        "headroom.admission_wait_s": done.admission_wait_s,
        "headroom.queue_wait_s": done.queue_wait_s,
        "headroom.ttft_s": done.ttft_s,
        "headroom.tpot_s": done.tpot_s,
        "headroom.e2e_s": done.e2e_s,
        "headroom.device_time_s": done.device_time_s if done.ran else None,
        "headroom.spec_draft_tokens": done.spec_draft_tokens if done.ran else None,
        "headroom.spec_accepted_tokens": done.spec_accepted_tokens if done.ran else None,
        "headroom.kv_block_seconds": done.kv_block_seconds if done.ran else None,
        "headroom.peak_blocks": done.peak_blocks if done.ran else None,
        "headroom.preemptions": done.preemptions if done.ran else None,
        "headroom.tokens_processed": done.tokens_processed if done.ran else None,
        "headroom.abort_cause": done.abort_cause,
        "headroom.stop_reason": done.stop_reason,
        "headroom.error": done.error,
        "headroom.admin_actions": list(done.admin_actions) or None,
        "headroom.probe.runaway_probability": done.runaway_probability,
        "headroom.probe.runaway_flagged_at_tokens": done.runaway_flagged_at,
    }
    return attributes


def package_version() -> str:
    try:
        return version("headroom-llm")
    except PackageNotFoundError:
        return "0+unknown"
