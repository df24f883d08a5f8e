"""Loop detection: does a sequence's output end in one pattern repeated back to back?

The test is vLLM's `repetition_detection` (same parameters, same answer): the last
size * min_count output tokens are min_count copies of one size-token pattern, for some
size in [min_pattern_size, max_pattern_size]. It runs on the engine thread after every
token of every sequence, so it is incremental: for each period p a `LoopTracker` keeps how
many of the latest tokens equal the token p before them, and a pattern of p tokens seen c
times in a row is such a run of p * (c - 1) tokens. One token costs one comparison per
period, and no history is rescanned."""

from __future__ import annotations

from dataclasses import dataclass

# The longest period a detector may look for: it bounds the per-token work.
MAX_PATTERN_SIZE = 256


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's RepetitionDetectionParams. min_pattern_size 0 means 1."""

    max_pattern_size: int
    min_pattern_size: int = 0
    min_count: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.max_pattern_size <= MAX_PATTERN_SIZE:
            raise ValueError(f"max_pattern_size must be in [1, {MAX_PATTERN_SIZE}], got {self.max_pattern_size}")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise ValueError(f"min_pattern_size must be in [0, max_pattern_size], got {self.min_pattern_size}")
        if self.min_count < 2:
            raise ValueError(f"min_count must be >= 2, got {self.min_count}")


class LoopTracker:
    """One sequence's run lengths by period, advanced with each output token."""

    __slots__ = ("runs",)

    def __init__(self, max_period: int):
        self.runs = [0] * (max_period + 1)  # runs[p]: latest tokens equal to the token p before

    def push(self, output: list[int]) -> None:
        """Account for output[-1], just appended."""
        runs, last, n = self.runs, output[-1], len(output)
        for p in range(1, min(len(runs), n)):
            runs[p] = runs[p] + 1 if output[n - 1 - p] == last else 0

    def period(self, detection: RepetitionDetection) -> int | None:
        """The smallest pattern size that detection finds repeated at the end, if any."""
        runs = self.runs
        top = min(detection.max_pattern_size, len(runs) - 1)
        for p in range(max(detection.min_pattern_size, 1), top + 1):
            if runs[p] >= p * (detection.min_count - 1):
                return p
        return None


def first_detection(output: list[int], detection: RepetitionDetection) -> tuple[int, int] | None:
    """(output tokens, pattern size) when a tracker fed output token by token would first
    fire, or None (for tests, benches and offline tuning)."""
    tracker, seen = LoopTracker(detection.max_pattern_size), []
    for token in output:
        seen.append(token)
        tracker.push(seen)
        if (period := tracker.period(detection)) is not None:
            return len(seen), period
    return None
