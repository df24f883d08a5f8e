"""The length probe on the engine thread: after a sequence's prefill and every `every`
generated tokens, it reads the hidden state the step computed anyway (the model's
probe layer, last token) and re-estimates its remaining output tokens and the chance
that it runs to its max_tokens. The scheduler orders and picks victims by the refined
estimate (policy.py); a sequence predicted to run away, with a cap of long work, moves
to the long lane and its device time from then on is charged as long.

The probe itself (PCA and two LightGBM models) is prediction/probe_model.py; this is
what the engine does with it, on the engine's thread, inside the step's lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from headroom.contracts.request import Request, SizeClass
from headroom.contracts.schedule import SchedulerOutput
from headroom.runtime.policy import SchedulingPolicy

log = logging.getLogger("headroom.probe")


class LengthProbe(Protocol):
    layer: int
    last_point: int  # the most generated tokens it was trained to estimate at

    def predict(self, requests: list[Request], states: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(remaining output tokens, probability of running to max_tokens) per request."""
        ...


@dataclass
class ProbeRefiner:
    probe: LengthProbe
    policy: SchedulingPolicy
    every: int = 16  # generated tokens between estimates, after the one at prefill
    runaway_threshold: float = 0.8
    long_min_output: int = 512  # a runaway whose max_tokens is under this is not long work
    estimates: int = 0  # rows estimated, for metrics

    def __post_init__(self) -> None:
        # Past the last point the probe was trained at, its trees would only extrapolate
        # (a sequence 1,000 tokens into a 1,536 cap looks like a fresh 512-token one), so
        # the last estimate counts down from there (Request.estimated_remaining_tokens).
        self.last_point = self.probe.last_point

    def _is_due(self, request: Request) -> bool:
        """At each multiple of `every` generated tokens, or the first step past one: a
        sequence whose guesses were kept moves several tokens a step (and may pass the last
        point by a few tokens on the step that reaches its multiple)."""
        generated = request.num_output_tokens
        if generated - generated % self.every > self.last_point:
            return False
        last = request.estimate.at_tokens
        if last is None:
            return generated % self.every == 0
        return generated // self.every > last // self.every

    def due(self, out: SchedulerOutput) -> bool:
        """Engine.hidden_due: does any sequence that samples in this step need an estimate?"""
        return any(
            r.num_computed_tokens + n == r.num_tokens + len(out.drafts.get(r.request_id, ())) and self._is_due(r)
            for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
        )

    def observe(self, requests: list[Request], hidden: dict[int, torch.Tensor]) -> None:
        """Engine.hidden_hook: each request has generated num_output_tokens before this
        step's token; hidden[layer] holds their rows in the same order."""
        due = [i for i, r in enumerate(requests) if self._is_due(r)]
        if not due:
            return
        rows = [requests[i] for i in due]
        states = hidden[self.probe.layer][torch.tensor(due)] if len(due) < len(requests) else hidden[self.probe.layer]
        remaining, p_cap = self.probe.predict(rows, states)
        self.estimates += len(rows)
        for request, left, p in zip(rows, remaining.tolist(), p_cap.tolist(), strict=True):
            if _runs_to_cap(request):  # nothing but max_tokens can end it: no need to guess
                left, p = float(request.max_tokens), 1.0
            generated = request.num_output_tokens
            estimate = request.estimate
            estimate.remaining_tokens = min(left, request.max_tokens - generated)
            estimate.at_tokens = generated
            estimate.runaway_probability = p
            if p >= self.runaway_threshold and estimate.runaway_flagged_at is None:
                self._flag(request, p)

    def _flag(self, request: Request, p: float) -> None:
        request.estimate.runaway_flagged_at = request.num_output_tokens
        moved = ""
        if request.max_tokens >= self.long_min_output and request.size_class != SizeClass.LONG:
            request.moved_to = SizeClass.LONG
            self.policy.probe_decisions["long_lane"] += 1
            moved = "; moved to the long lane"
        log.info(
            "%s predicted to run to its %d-token cap (p=%.2f) at %d tokens%s",
            request.request_id,
            request.max_tokens,
            p,
            request.num_output_tokens,
            moved,
            extra={"sequence": request.request_id, "runaway_probability": round(p, 3)},
        )


def _runs_to_cap(request: Request) -> bool:
    sampling = request.sampling
    return sampling.ignore_eos and not sampling.stop and not sampling.stop_token_ids
