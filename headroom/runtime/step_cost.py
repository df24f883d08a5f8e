"""What an engine step costs, learned from the steps the engine has run.

A step's wall time is modelled as base + per_token * tokens + per_pair * pairs, where
`pairs` counts the (query, key) pairs attention computes: n * (context + n) for a
request given n tokens on top of `context` computed ones. The fit is a non-negative
least squares over recent steps, kept per shape bin (by the size of tokens and of
pairs) so that a long run of decode-only steps never pushes out what the last prefill
chunks taught. The scheduler asks it how many prefill tokens fit in a time allowance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

ROWS_PER_BIN = 8
PAIRS_SCALE = 1024.0  # pairs are fitted in units of 1024 so the three columns are of like size
MIN_PREFILL_TOKENS = 16  # a step with fewer tokens says little about the per-token cost


def attention_pairs(num_tokens: int, context: int) -> int:
    """(query, key) pairs that n new tokens on top of `context` computed ones attend to."""
    return num_tokens * (context + num_tokens)


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_pair_s: float  # per (query, key) pair


class StepCostModel:
    def __init__(self) -> None:
        self._bins: dict[tuple[int, int], deque[tuple[float, float, float]]] = {}
        self._fit: StepCost | None = None
        self._dirty = False
        self.num_steps = 0
        self._prefill_steps = 0

    def observe(self, num_tokens: int, pairs: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        key = (num_tokens.bit_length(), int(pairs // PAIRS_SCALE).bit_length())
        rows = self._bins.get(key)
        if rows is None:
            rows = self._bins[key] = deque(maxlen=ROWS_PER_BIN)
        rows.append((float(num_tokens), pairs / PAIRS_SCALE, seconds))
        self.num_steps += 1
        self._prefill_steps += num_tokens >= MIN_PREFILL_TOKENS
        self._dirty = True

    @property
    def ready(self) -> bool:
        """Has it seen enough prefill to say what a token costs?"""
        return self._prefill_steps >= 2

    def cost(self) -> StepCost | None:
        if not self.ready:
            return None
        if self._dirty or self._fit is None:
            data = np.array([row for rows in self._bins.values() for row in rows])
            a = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
            w, _ = nnls(a, data[:, 2])
            self._fit = StepCost(float(w[0]), float(w[1]), float(w[2]) / PAIRS_SCALE)
            self._dirty = False
        return self._fit

    def predict(self, num_tokens: int, pairs: int) -> float:
        """A step's predicted wall time (0 before anything is learned)."""
        fit = self.cost()
        if fit is None or num_tokens <= 0:
            return 0.0
        return fit.base_s + fit.per_token_s * num_tokens + fit.per_pair_s * pairs

    def chunk_seconds(self, num_tokens: int, context: int) -> float:
        """What adding a prefill chunk of num_tokens at `context` adds to a step."""
        fit = self.cost()
        if fit is None or num_tokens <= 0:
            return 0.0
        return fit.per_token_s * num_tokens + fit.per_pair_s * attention_pairs(num_tokens, context)

    def tokens_within(self, seconds: float, context: int, limit: int) -> int:
        """The largest chunk (at most `limit`) that adds no more than `seconds` to a step;
        0 before anything is learned (the caller then picks a cautious size)."""
        fit = self.cost()
        if fit is None or seconds <= 0 or limit <= 0:
            return 0
        # per_pair * n^2 + (per_token + per_pair * context) * n - seconds <= 0
        a, b = fit.per_pair_s, fit.per_token_s + fit.per_pair_s * context
        if a > 0:
            n = (-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a)
        elif b > 0:
            n = seconds / b
        else:
            return limit
        n = min(limit, int(n))
        # The square root rounds; never hand out a chunk the model says is over.
        while n > 0 and self.chunk_seconds(n, context) > seconds:
            n -= 1
        return n
