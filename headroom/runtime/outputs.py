"""What the engine hands back: per-request output deltas, and its own counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.runtime.request import Request
from headroom.runtime.sampler import TokenLogprob


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
