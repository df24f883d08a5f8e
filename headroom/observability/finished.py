"""What one finished HTTP request was, computed once from the facts on its Request and
handed to every sink: the span, the metrics, the log line and the head-of-line monitor.

Times are seconds from the request's arrival at the HTTP handler, so that
queue_wait_s <= ttft_s <= e2e_s always holds."""

from __future__ import annotations

from dataclasses import dataclass

from headroom.runtime.request import Request

NO_CLASS = "none"  # the size-class label of requests admission did not classify


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
    kv_block_seconds: float = 0.0
    peak_blocks: int = 0
    preemptions: int = 0
    tokens_processed: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first token
    admin_actions: tuple[str, ...] = ()
    runaway_probability: float | None = None  # the in-flight probe's last estimate
    runaway_flagged_at: int | None = None  # output tokens when it was first predicted to run away

    @classmethod
    def build(cls, *, request_id: str, endpoint: str, model: str, http_status: int, arrival: float, end: float,
              request: Request | None, tenant: str | None, tier: str | None, error: str | None = None,
              ) -> FinishedRequest:
        common = {"request_id": request_id, "endpoint": endpoint, "model": model, "http_status": http_status,
                  "tenant": tenant, "tier": tier, "error": error, "e2e_s": end - arrival}
        if request is None:
            return cls(size_class=NO_CLASS, ran=False, **common)
        ran = request.admitted_time is not None
        finished = request.finished_time if request.finished_time is not None else end

        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - arrival

        tpot = None
        if request.first_token_time is not None and request.num_output_tokens > 1:
            tpot = (finished - request.first_token_time) / (request.num_output_tokens - 1)
        stop = request.stop_reason
        return cls(
            # Its latencies belong to the class it was admitted as, also after a move to
            # the long lane (its device time from the move on is charged as long).
            size_class=request.admitted_class or request.size_class or NO_CLASS,
            ran=ran,
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            max_tokens=request.max_tokens,
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            finish_reason=request.status.finish_reason if request.is_finished else None,
            stop_reason=None if stop is None else str(stop),
            abort_cause=request.abort_cause,
            admission_decision=request.admission_decision,
            predicted_output_tokens=request.predicted_output_tokens,
            predicted_output_tokens_p90=request.predicted_output_tokens_p90,
            admission_wait_s=since_arrival(request.admitted_time),
            queue_wait_s=since_arrival(request.first_scheduled_time if ran else None),
            ttft_s=since_arrival(request.first_token_time),
            tpot_s=tpot,
            device_time_s=request.device_time_s,
            kv_block_seconds=request.kv_block_seconds,
            peak_blocks=request.peak_blocks,
            preemptions=request.num_preemptions,
            tokens_processed=request.num_processed_tokens,
            first_token_at=request.first_token_time,
            admin_actions=tuple(request.admin_actions),
            runaway_probability=request.runaway_probability,
            runaway_flagged_at=request.runaway_flagged_at,
            **common,
        )
