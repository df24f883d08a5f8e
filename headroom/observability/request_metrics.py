"""What one request waited for and cost, computed once from the timestamps and counters
on its Request: its span's attributes, its log line, its metrics samples and, where a
server or tenant asks for it, the `metrics` object of its response all report these.

Times are seconds from the request's arrival at the HTTP handler, so that
admission_wait_s <= queue_wait_s <= ttft_s always holds."""

from __future__ import annotations

from dataclasses import dataclass

from headroom.contracts.request import Request

NO_CLASS = "none"  # the size-class label of requests admission did not classify


@dataclass(frozen=True)
class RequestMetrics:
    size_class: str
    cached_tokens: int  # prompt tokens served from the prefix cache
    admission_wait_s: float | None  # arrival -> admitted
    queue_wait_s: float | None  # arrival -> first engine step (the admission wait included)
    ttft_s: float | None  # arrival -> first output token
    tpot_s: float | None  # mean time per output token after the first (mean inter-token latency)
    device_time_s: float  # its share of every engine step it was part of
    # Speculative decoding: tokens guessed for it, and those it kept (0 and 0 without it).
    spec_draft_tokens: int
    spec_accepted_tokens: int

    @classmethod
    def of(cls, request: Request, arrival: float, end: float) -> RequestMetrics:
        """`request`, which arrived at `arrival`; `end` stands in for its finish while it
        has none (a request whose client left before the engine finished it)."""
        ran = request.admitted_time is not None
        finished = request.finished_time if request.finished_time is not None else end
        first = request.first_token_time
        tpot = None
        if first is not None and request.num_output_tokens > 1:
            tpot = (finished - first) / (request.num_output_tokens - 1)

        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - arrival

        return cls(
            # Its latencies belong to the class it was admitted as, also after a move to
            # the long lane (its device time from the move on is charged as long).
            size_class=request.admitted_class or request.size_class or NO_CLASS,
            cached_tokens=request.num_cached_tokens,
            admission_wait_s=since_arrival(request.admitted_time),
            queue_wait_s=since_arrival(request.first_scheduled_time if ran else None),
            ttft_s=since_arrival(first),
            tpot_s=tpot,
            device_time_s=request.resources.device_time_s,
            spec_draft_tokens=request.resources.num_draft_tokens,
            spec_accepted_tokens=request.resources.num_accepted_tokens,
        )
