"""What the engine hands back: per-request output deltas, and its own counters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from headroom.contracts.request import Priority, Request
from headroom.executor.sampler import TokenLogprob
from headroom.runtime.step_cost import StepCost


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    request: Request | None = field(default=None, repr=False)


OutputSink = Callable[[RequestOutput], None]


@dataclass
class EngineStats:
    steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    requests_started: int = 0  # requests that got their first step
    prefix_cache_queries: int = 0  # prompt tokens of those, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    aborts: Counter[str] = field(default_factory=Counter)  # by cause (Request.abort_cause)
    device_time_by_class: Counter[str] = field(default_factory=Counter)  # seconds, by size class
    probe_estimates: int = 0  # length probe estimates made (rows)
    probe_decisions: Counter[str] = field(default_factory=Counter)  # changed by them: order, victim, long_lane
    loops: Counter[str] = field(default_factory=Counter)  # found by the server's detector, by action taken
    policy_actions: Counter[str] = field(default_factory=Counter)  # the automatic policies', by action
    # Speculative decoding, as vLLM's spec_decode_* counters: rows that guessed, tokens
    # guessed, and those of them the model kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Gauges, filled in only on the copy Engine.counters returns (0 on the live counters),
    # so that a scrape reads them and the counters at one instant.
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    def count_guesses(self, drafts: dict[str, list[int]], accepted: int) -> None:
        """drafts: a step's guesses by request; accepted: how many of them the sequences kept."""
        if drafts:
            self.spec_drafts += len(drafts)
            self.spec_draft_tokens += sum(len(guess) for guess in drafts.values())
            self.spec_accepted_tokens += accepted

    def copy(self) -> EngineStats:
        return replace(
            self,
            finished=Counter(self.finished),
            aborts=Counter(self.aborts),
            device_time_by_class=Counter(self.device_time_by_class),
            probe_decisions=Counter(self.probe_decisions),
            loops=Counter(self.loops),
            policy_actions=Counter(self.policy_actions),
        )


@dataclass(frozen=True)
class LongLaneState:
    enabled: bool
    factor: float  # the head-of-line loop's scale on the allowance, in (0, 1]
    short_ttft_target_s: float
    allowance_s: float | None  # what long prefill may add to the next step (None: no limit now)
    step_cost: StepCost | None  # None until the engine has run some prefill
    steps_observed: int
    chunk_tokens: dict[int, int]  # context -> long chunk that fits the allowance now


@dataclass(frozen=True)
class SequenceSnapshot:
    """One live sequence's cost: what it holds and what it has used, at one instant."""

    request_id: str
    tenant: str | None
    tier: str | None
    size_class: str | None
    status: str  # waiting | running | preempted
    priority: Priority
    age_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    predicted_output_tokens: float | None
    blocks_held: int
    kv_share: float  # of the whole pool
    device_time_s: float
    device_share: float  # of the engine's busy time since it arrived
    kv_block_seconds: float
    tokens_processed: int
    preemptions: int
    ttft_s: float | None
    budget_left_s: float | None = None  # wall-clock budget left (None: no budget)
    deprioritized: bool = False
    admin_actions: tuple[str, ...] = ()
    # The length probe's latest estimate (None: not estimated, or the probe is off).
    predicted_remaining_tokens: float | None = None
    runaway_probability: float | None = None
    runaway_flagged_at: int | None = None  # output tokens when first predicted to run away
    loop_period: int | None = None  # the repeated pattern's size, when the server's detector fired
    loop_detected_at: int | None = None  # output tokens then
    loop_policy: str | None = None  # what the detector does on a loop here (the tenant's, else the server's)
    ladder: tuple[str, ...] | None = None  # the tenant's remediation ladder (None: the server's)
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)

    @classmethod
    def of(
        cls, request: Request, now: float, busy_s: float, blocks_held: int, num_blocks: int, in_step_s: float = 0.0
    ) -> SequenceSnapshot:
        """request at `now`, with the engine busy busy_s in all (the step running now counted
        as far as it has got, in_step_s of it this request's)."""
        lifetime_busy = busy_s - request.resources.busy_at_arrival
        device_time = request.resources.device_time_s + in_step_s
        first = request.first_token_time
        return cls(
            request_id=request.request_id,
            tenant=request.tenant,
            lora=request.lora.name if request.lora is not None else None,
            tier=request.tier,
            size_class=request.size_class,
            status=request.status.name.lower(),
            priority=request.priority,
            age_s=now - request.arrival_time,
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
            max_tokens=request.max_tokens,
            predicted_output_tokens=request.predicted_output_tokens,
            blocks_held=blocks_held,
            kv_share=blocks_held / num_blocks,
            device_time_s=device_time,
            device_share=device_time / lifetime_busy if lifetime_busy > 0 else 0.0,
            kv_block_seconds=request.resources.kv_block_seconds,
            tokens_processed=request.resources.num_processed_tokens,
            preemptions=request.num_preemptions,
            ttft_s=None if first is None else first - request.arrival_time,
            budget_left_s=None if request.deadline is None else request.deadline - now,
            deprioritized=request.deprioritized,
            admin_actions=tuple(request.admin_actions),
            predicted_remaining_tokens=request.estimated_remaining_tokens()
            if request.estimate.at_tokens is not None
            else None,
            runaway_probability=request.estimate.runaway_probability,
            runaway_flagged_at=request.estimate.runaway_flagged_at,
            loop_period=request.loop_period,
            loop_detected_at=request.loop_detected_at,
            loop_policy=request.loop_policy,
            ladder=request.ladder,
        )

    @property
    def progress(self) -> float | None:
        """Output so far over the predicted output (above 1: running past its prediction)."""
        if not self.predicted_output_tokens:
            return None
        return self.output_tokens / self.predicted_output_tokens


class UnknownSequence(LookupError):
    """No live or recently finished sequence has this id."""


class SequenceFinished(Exception):
    """The sequence finished before the action reached it."""

    def __init__(self, request_id: str, finish_reason: str | None):
        super().__init__(f"sequence {request_id!r} has already finished ({finish_reason})")
        self.finish_reason = finish_reason


@dataclass(frozen=True)
class EngineSnapshot:
    taken_at: float  # time.monotonic()
    busy_s: float  # the engine's step time since it started
    steps: int
    num_blocks: int
    used_blocks: int
    sequences: tuple[SequenceSnapshot, ...]

    @property
    def running(self) -> int:
        return sum(s.status == "running" for s in self.sequences)

    @property
    def waiting(self) -> int:
        return len(self.sequences) - self.running
