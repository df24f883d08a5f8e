"""What one finished HTTP request was, computed once from the facts on its Request and
handed to every sink: the span, the metrics, the log line and the head-of-line monitor.

Times are seconds from the request's arrival at the HTTP handler, so that
queue_wait_s <= ttft_s <= e2e_s always holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from headroom.contracts.request import Request
from headroom.observability.request_metrics import NO_CLASS, RequestMetrics


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    endpoint: str
    model: str
    http_status: int
    tenant: str | None
    tier: str | None
    size_class: str
    ran: bool  # it reached the engine (not rejected, routed or invalid)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    abort_cause: str | None = None
    error: str | None = None
    admission_decision: str | None = None
    predicted_output_tokens: float | None = None
    predicted_output_tokens_p90: float | None = None
    admission_wait_s: float | None = None
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float = 0.0
    device_time_s: float = 0.0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_block_seconds: float = 0.0
    peak_blocks: int = 0
    preemptions: int = 0
    tokens_processed: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first token
    admin_actions: tuple[str, ...] = ()
    runaway_probability: float | None = None  # the length probe's last estimate
    runaway_flagged_at: int | None = None  # output tokens when it was first predicted to run away
    max_tokens_cap: int | None = None  # an operator's or a policy's cap under the requested one
    ignore_eos: bool = False  # only max_tokens (or a stop string) could end it
    requested_max_tokens: int | None = None  # the client's, before any cap
    loop_detected_at: int | None = None  # output tokens when the server's loop detector fired
    lora: str | None = None  # the LoRA adapter it ran under (None: the base model)

    @classmethod
    def build(
        cls,
        *,
        request_id: str,
        endpoint: str,
        model: str,
        http_status: int,
        arrival: float,
        end: float,
        request: Request | None,
        tenant: str | None,
        tier: str | None,
        error: str | None = None,
    ) -> FinishedRequest:
        common = {
            "request_id": request_id,
            "endpoint": endpoint,
            "model": model,
            "http_status": http_status,
            "tenant": tenant,
            "tier": tier,
            "error": error,
            "e2e_s": end - arrival,
        }
        if request is None:
            return cls(size_class=NO_CLASS, ran=False, **common)
        stop = request.stop_reason
        return cls(
            ran=request.admitted_time is not None,
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
            max_tokens=request.max_tokens,
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            finish_reason=request.status.finish_reason if request.is_finished else None,
            stop_reason=None if stop is None else str(stop),
            abort_cause=request.abort_cause,
            admission_decision=request.admission.decision,
            predicted_output_tokens=request.predicted_output_tokens,
            predicted_output_tokens_p90=request.admission.predicted_output_tokens_p90,
            kv_block_seconds=request.resources.kv_block_seconds,
            peak_blocks=request.resources.peak_blocks,
            preemptions=request.num_preemptions,
            tokens_processed=request.resources.num_processed_tokens,
            first_token_at=request.first_token_time,
            admin_actions=tuple(request.admin_actions),
            runaway_probability=request.estimate.runaway_probability,
            runaway_flagged_at=request.estimate.runaway_flagged_at,
            max_tokens_cap=request.max_tokens_cap,
            requested_max_tokens=request.sampling.max_tokens,
            loop_detected_at=request.loop_detected_at,
            ignore_eos=request.sampling.ignore_eos,
            lora=request.lora.name if request.lora is not None else None,
            **asdict(RequestMetrics.of(request, arrival, end)),
            **common,
        )
