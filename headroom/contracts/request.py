"""A request as the runtime sees it: tokens, counters, sampling settings and the facts
(timestamps, resources held) that spans and metrics are built from later."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from headroom.contracts.repetition import LoopTracker, RepetitionDetection


class Priority(NamedTuple):
    """Who is served first, compared as a tuple (higher first, preempted last): an
    operator's deprioritisation, then the tier, then the request's own value; arrival
    breaks ties after these. A tier so always outranks what a request asks for itself."""

    kept: int = 1  # 0 once an operator or a policy deprioritised it: below every tier
    tier: int = 0  # the tier's priority ([admission.tiers])
    value: int = 0  # the request's own, negated from the API's so that higher runs first

    def first(self) -> tuple[int, int, int]:
        """A sort key on which what is served first comes first."""
        return (-self.kept, -self.tier, -self.value)


class SizeClass(enum.StrEnum):
    """What admission protects (short) from what it throttles (long); a string, so that
    labels, JSON and logs carry its name."""

    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REPETITION = 6  # a loop: vLLM's repetition_detection or the server's loop policy

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REPETITION: "repetition",
}


@dataclass(frozen=True)
class Bounds:
    """A sampling parameter's range, declared once: the API schemas' constraints
    (app/schemas.py) and SamplingParams' own check both come from it."""

    low: float
    high: float
    low_open: bool = False  # (low, high] rather than [low, high]

    def holds(self, value: float) -> bool:
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high  # NaN fails

    def constraints(self) -> dict[str, Any]:
        """As pydantic's Field takes them."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high, "allow_inf_nan": False}

    def check(self, name: str, value: float) -> None:
        if not self.holds(value):
            raise ValueError(f"{name} must be {self}, got {value}")

    def __str__(self) -> str:
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


TOP_P = Bounds(0, 1, low_open=True)
PENALTY = Bounds(-2, 2)  # OpenAI's presence and frequency penalties
REPETITION_PENALTY = Bounds(0, 2, low_open=True)  # vLLM's
LOGIT_BIAS = Bounds(-100, 100)
# The API takes OpenAI's [0, 2]; the engine itself any temperature >= 0.
API_TEMPERATURE = Bounds(0, 2)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Return the chosen token's logprob, plus this many top alternatives (None: no logprobs).
    logprobs: int | None = None
    # OpenAI's penalties, over the tokens generated so far: subtract frequency_penalty
    # per occurrence and presence_penalty once for any occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and transformers') multiplicative penalty on every token of the prompt and
    # output: positive logits divided by it, negative ones multiplied. 1: off.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # vLLM's: finish (reason "repetition") once the output ends in a repeated pattern.
    repetition_detection: RepetitionDetection | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self) -> None:
        self._check_sampling()
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        self._check_penalties()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    def _check_sampling(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        TOP_P.check("top_p", self.top_p)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")  # what a torch generator takes

    def _check_penalties(self) -> None:
        PENALTY.check("presence_penalty", self.presence_penalty)
        PENALTY.check("frequency_penalty", self.frequency_penalty)
        REPETITION_PENALTY.check("repetition_penalty", self.repetition_penalty)
        if not all(LOGIT_BIAS.holds(bias) for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must be {LOGIT_BIAS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class AdmissionRecord:
    """What admission decided about a request, written once at the boundary
    (app/admission_gate.py) before the engine sees it; all None where admission is off."""

    tenant: str | None = None
    tier: str | None = None
    size_class: SizeClass | None = None  # the class its latencies are reported under
    predicted_output_tokens: float | None = None
    predicted_output_tokens_p90: float | None = None
    decision: str | None = None  # admit | wait | reject | route
    deadline: float | None = None  # time.monotonic() by which it must finish (wall-clock budget)
    # time.monotonic() by which its first token is due: the gateway's TTFT objective
    # (x-llm-d-slo-ttft-ms), which orders it within its tier, earliest first.
    first_token_due: float | None = None
    # Loops (contracts/repetition.py): the tenant's policy and remediation ladder (None: the server's).
    loop_policy: str | None = None
    ladder: tuple[str, ...] | None = None


@dataclass
class Estimate:
    """The length probe's (runtime/probe.py) as the sequence runs, every few generated tokens."""

    remaining_tokens: float | None = None  # as of at_tokens
    at_tokens: int | None = None
    runaway_probability: float | None = None  # that it runs to its max_tokens
    runaway_flagged_at: int | None = None  # output tokens when first predicted to run away


@dataclass
class Resources:
    """What a request has used, updated by the engine's accounting (runtime/stats.py) every
    step it is in; its guesses by the scheduler as it takes a step's tokens."""

    num_blocks_held: int = 0
    peak_blocks: int = 0
    device_time_s: float = 0.0  # its token share of every step's wall time
    kv_block_seconds: float = 0.0
    num_processed_tokens: int = 0  # including recomputation after preemption
    busy_at_arrival: float = 0.0  # the engine's busy seconds when it arrived: its share's denominator
    num_draft_tokens: int = 0  # tokens guessed for it (speculative decoding)
    num_accepted_tokens: int = 0  # of those, the ones it kept


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request runs under: its name, and the number its load got, which
    salts the prefix cache's keys (a name reloaded with other weights never hits the old
    blocks)."""

    name: str
    uid: int
    # Its arithmetic per token beside the base model's linears' (its parameters over theirs):
    # what a row under it costs more, charged to its request's share of a step.
    cost: float = 0.0

    def key(self) -> bytes:
        return b"lora:%d" % self.uid


@dataclass
class Request:
    """One sequence. Each part has one writer: the admission record the admission gate,
    the estimate the length probe, the resources the accounting, the counters and status
    the scheduler, the outcome (stop_reason, abort_cause, operator actions) the runtime's
    output and control paths."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority = field(default_factory=Priority)
    arrival_time: float = field(default_factory=time.monotonic)
    admission: AdmissionRecord = field(default_factory=AdmissionRecord)
    estimate: Estimate = field(default_factory=Estimate)
    resources: Resources = field(default_factory=Resources)
    moved_to: SizeClass | None = None  # the class the runtime moved it to in flight (probe, operator)
    admitted_time: float | None = None  # when admission let it through to the engine
    lora: AdapterRef | None = None  # set at construction; None: the base model
    # The loop tracker fed with every output token (contracts/repetition.py), and the
    # server detector's finding.
    loop_tracker: LoopTracker | None = None
    loop_period: int | None = None  # the repeated pattern's size, in tokens
    loop_detected_at: int | None = None  # output tokens when the server's detector fired

    status: RequestStatus = RequestStatus.WAITING
    submit_order: int = 0  # set by the scheduler; the last tie-breaker
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V is in the cache; catches up with num_tokens step by step.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    stop_reason: str | int | None = None  # the stop string or token that ended it
    abort_cause: str | None = None  # client_disconnect | shutdown | engine_error | wall_clock_budget | admin
    # Operator actions (admin API or automatic policy) taken on it, in order.
    admin_actions: list[str] = field(default_factory=list)
    max_tokens_cap: int | None = None  # an operator's cap below sampling.max_tokens
    # Structured output: an xgrammar matcher (executor/grammar.py) that masks every token
    # this sequence samples and advances with it; None: unconstrained.
    grammar: Any = None

    # Timestamps (time.monotonic) for spans and metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    # prompt + output in one list, so slicing a block's tokens never copies the whole.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.all_token_ids = list(self.prompt_token_ids)

    # The admission record's, read where the request is at hand (written only as a whole).
    @property
    def tenant(self) -> str | None:
        return self.admission.tenant

    @property
    def tier(self) -> str | None:
        return self.admission.tier

    @property
    def admitted_class(self) -> SizeClass | None:
        return self.admission.size_class

    @property
    def size_class(self) -> SizeClass | None:
        """The lane it runs in: admission's class, unless the runtime moved it since."""
        return self.moved_to or self.admission.size_class

    @property
    def predicted_output_tokens(self) -> float | None:
        return self.admission.predicted_output_tokens

    @property
    def deadline(self) -> float | None:
        return self.admission.deadline

    @property
    def loop_policy(self) -> str | None:
        return self.admission.loop_policy

    @property
    def ladder(self) -> tuple[str, ...] | None:
        return self.admission.ladder

    @property
    def deprioritized(self) -> bool:
        return not self.priority.kept

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def estimated_remaining_tokens(self, probed: bool = True) -> float | None:
        """Output tokens still to come: the probe's estimate less what was generated
        since it, else (or with probed False) the admission-time prediction less the
        output so far; never more than max_tokens (an operator's cap included) leaves."""
        left = self.max_tokens - self.num_output_tokens
        estimate = self.estimate
        if probed and estimate.remaining_tokens is not None:
            since = self.num_output_tokens - (estimate.at_tokens or 0)
            return min(max(estimate.remaining_tokens - since, 0.0), left)
        if self.predicted_output_tokens is not None:
            return min(max(self.predicted_output_tokens - self.num_output_tokens, 0.0), left)
        return None

    @property
    def max_tokens(self) -> int:
        if self.max_tokens_cap is not None:
            return min(self.sampling.max_tokens, self.max_tokens_cap)
        return self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


class ContextOverflow(ValueError):
    """A prompt and completion that do not fit the context; `param` is the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def completion_limit(prompt_tokens: int, max_tokens: int | None, max_len: int) -> int:
    """The one context-length check (the API's, with a tenant's limit, and the engine's):
    max_tokens where the prompt and it fit in max_len tokens, all the room left where
    max_tokens is None; else ContextOverflow in OpenAI's words."""
    if max_tokens is None:
        if prompt_tokens >= max_len:
            raise ContextOverflow(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {prompt_tokens} tokens, leaving no room for completion tokens.",
                "messages",
            )
        return max_len - prompt_tokens
    if prompt_tokens + max_tokens > max_len:
        raise ContextOverflow(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
    return max_tokens


def check_fits(request: Request, max_model_len: int, cache_tokens: int, vocab: int) -> None:
    """Raise ValueError where a request can never run: longer than the model's context or
    the whole KV cache, or naming a token the vocabulary lacks."""
    completion_limit(request.num_prompt_tokens, request.sampling.max_tokens, max_model_len)
    total = request.num_prompt_tokens + request.sampling.max_tokens
    if total > cache_tokens:
        raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the KV cache of {cache_tokens} tokens")
    if any(not 0 <= t < vocab for t in request.prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(not 0 <= t < vocab for t, _ in request.sampling.logit_bias):
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
