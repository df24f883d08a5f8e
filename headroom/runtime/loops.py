"""The server's loop policy, applied on the engine thread right after a step's tokens are
appended: a sequence whose output ends in a repeated pattern (contracts/repetition.py) is
flagged, capped or stopped, once, by its tenant's policy or the server's ([admin]
loop_policy). A request that brings its own repetition_detection has asked for exactly
that test (the scheduler applies it) and one that sets ignore_eos asked for every token,
so the server's detector leaves them alone. One under a JSON grammar is never cut (that
would leave invalid JSON): a loop found in it is steered to close the value it loops in
(executor/grammar.py), as often as it loops; where the grammar cannot close there, it
runs on to its max_tokens and finishes as length. Other grammars are left to themselves."""

from __future__ import annotations

from dataclasses import dataclass

from headroom.config import AdminConfig
from headroom.contracts.repetition import LoopTracker, RepetitionDetection
from headroom.contracts.request import Request
from headroom.executor.grammar import CLOSE_WITHIN


@dataclass(frozen=True)
class Finding:
    action: str  # flag | cap | stop, or close under a grammar
    what: str  # for the log, the span and /admin/sequences


@dataclass(frozen=True)
class LoopWatch:
    """The server's loop policy as the engine applies it: which sequences it watches, what
    it does on a loop it finds."""

    policy: str
    detection: RepetitionDetection
    cap_tokens: int

    @classmethod
    def of(cls, config: AdminConfig) -> LoopWatch:
        return cls(config.loop_policy, config.loop_detection, config.cap_tokens)

    def watches(self, request: Request) -> bool:
        params = request.sampling
        return (request.loop_policy or self.policy) != "off" and params.repetition_detection is None

    def acts_on(self, request: Request) -> bool:
        """Whether a loop found in request is flagged, capped or stopped (not steered)."""
        return self.watches(request) and not request.sampling.ignore_eos and request.grammar is None

    def attach(self, request: Request) -> None:
        """Give request the tracker its detectors need, if any."""
        own = request.sampling.repetition_detection
        sizes = [own.max_pattern_size] if own is not None else []
        if self.acts_on(request) or (
            self.watches(request) and request.grammar is not None and request.grammar.steerable
        ):
            sizes.append(self.detection.max_pattern_size)
        if sizes:
            request.loop_tracker = LoopTracker(max(sizes))

    def check(self, request: Request) -> Finding | None:
        """What to do about request now: the first time its output is found looping, or
        under a grammar, each time it is found looping and is not already being closed."""
        constraint = request.grammar
        steered = constraint is not None and constraint.steerable and self.watches(request)
        if (
            request.loop_tracker is None
            or not (steered or self.acts_on(request))
            or request.loop_detected_at is not None
            or (steered and constraint.closing)
            or request.num_output_tokens < request.sampling.min_tokens
        ):
            return None
        period = request.loop_tracker.period(self.detection)
        if period is None:
            return None
        what = (
            f"a {period}-token pattern repeated {self.detection.min_count} times "
            f"at {request.num_output_tokens} output tokens"
        )
        if steered:
            # Not recorded as the sequence's loop: a steered sequence is no violation for
            # the policies and its length is still the model's (the predictor's labels).
            constraint.closing = CLOSE_WITHIN
            return Finding("close", what)
        request.loop_period, request.loop_detected_at = period, request.num_output_tokens
        return Finding(request.loop_policy or self.policy, what)
