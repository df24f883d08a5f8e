"""What an engine step costs, learned from the steps the engine has run.

A step's wall time is modelled as base + per_token * tokens + per_pair * pairs +
decode_extra * decode_pairs, where `pairs` counts the (query, key) pairs attention
computes: n * (context + n) for a request given n tokens on top of `context` computed
ones (a decode row at a long context is priced by its context this way), and
`decode_pairs` the share of them that decode rows compute. A chunk's pairs are bound by
arithmetic, many queries sharing each key read; a decode row's by reading its context
once for one query, which costs more a pair wherever the cache is past the last-level
cache, so decode pairs carry a non-negative extra price (0 until steps teach it). The fit
is a weighted non-negative least squares over recent steps of every size, decodes and
small chunks included:

- rows are kept per shape bin (by the size of tokens, of pairs and of the decode rows'
  share of the pairs), so that a long run of decode-only steps never pushes out what
  the last prefill chunks taught;
- each row's weight halves every HALF_LIFE_STEPS steps observed after it, down to
  STALE_WEIGHT, so that a price learned from a few slow steps (a cold start, a busy
  host) is outvoted by the steps that follow it instead of being locked in until its
  own shape recurs;
- the engine seeds it with a few steps it times at start-up (`prime`), which are never
  forgotten and weigh as one step each, so the first long prompt is sized from this
  machine's warm cost rather than from its own first, cold chunks;
- it never hands out a chunk more than EXTRAPOLATION times the largest step it holds: a
  few slow steps may first be read as a large fixed cost (and so a cheap token), and a
  chunk sized from that would be far past anything measured.

The scheduler asks it how many prefill tokens fit in a time allowance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

ROWS_PER_BIN = 8
PAIRS_SCALE = 1024.0  # pairs are fitted in units of 1024 so the three columns are of like size
MIN_PREFILL_TOKENS = 16  # a step with fewer tokens says little about the per-token cost
HALF_LIFE_STEPS = 16
STALE_WEIGHT = 1e-2  # what a row weighs once it is old: it still pins what fresh rows leave free
PRIOR_WEIGHT = 1.0  # a start-up row weighs as a fresh step: it pins what the steps since leave open
EXTRAPOLATION = 2


def attention_pairs(num_tokens: int, context: int) -> int:
    """(query, key) pairs that n new tokens on top of `context` computed ones attend to."""
    return num_tokens * (context + num_tokens)


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_pair_s: float  # per (query, key) pair
    decode_extra_s: float = 0.0  # on top of per_pair_s, per pair of a decode row

    def predict(self, num_tokens: int, pairs: int, decode_pairs: int = 0) -> float:
        """A step's wall time by this fit (0 for an empty step)."""
        if num_tokens <= 0:
            return 0.0
        arithmetic = self.per_token_s * num_tokens + self.per_pair_s * pairs
        return self.base_s + arithmetic + self.decode_extra_s * decode_pairs


@dataclass(frozen=True)
class StepSample:
    """One timed step: its tokens, its attention pairs (decode rows' among them) and its
    wall time."""

    num_tokens: int
    pairs: int
    seconds: float
    decode_pairs: int = 0


class StepCostModel:
    def __init__(self) -> None:
        # bin -> rows of (tokens, pairs / PAIRS_SCALE, decode pairs / PAIRS_SCALE, seconds,
        # step index when observed)
        self._bins: dict[tuple[int, int, int], deque[tuple[float, float, float, float, int]]] = {}
        self._prior: list[tuple[float, float, float, float]] = []
        self._fit: StepCost | None = None
        self._dirty = False
        self.num_steps = 0
        self._prefill_steps = 0
        self._largest: int | None = None  # tokens of the largest step held, cached

    def prime(self, samples: list[StepSample]) -> None:
        """Seed the fit with steps timed at start-up (replacing any earlier seed)."""
        self._prior = [
            (float(s.num_tokens), s.pairs / PAIRS_SCALE, s.decode_pairs / PAIRS_SCALE, s.seconds)
            for s in samples
            if s.num_tokens > 0 and s.seconds > 0
        ]
        self._dirty = True
        self._largest = None

    def observe(self, num_tokens: int, pairs: int, seconds: float, decode_pairs: int = 0) -> None:
        """A step that computed `pairs` (query, key) pairs, `decode_pairs` of them in decode rows."""
        if num_tokens <= 0 or not seconds > 0:
            return
        # Binned by how much of the step is decode too: decode-only steps at long contexts
        # and chunks of the same pairs teach different prices, and neither may push out the other.
        key = (num_tokens.bit_length(), int(pairs // PAIRS_SCALE).bit_length(), 4 * decode_pairs // max(pairs, 1))
        rows = self._bins.get(key)
        if rows is None:
            rows = self._bins[key] = deque(maxlen=ROWS_PER_BIN)
        rows.append((float(num_tokens), pairs / PAIRS_SCALE, decode_pairs / PAIRS_SCALE, seconds, self.num_steps))
        self.num_steps += 1
        self._largest = None
        self._prefill_steps += num_tokens >= MIN_PREFILL_TOKENS
        self._dirty = True

    @property
    def ready(self) -> bool:
        """Has it a start-up seed, or seen enough prefill, to say what a token costs?"""
        return len(self._prior) >= 2 or self._prefill_steps >= 2

    def weight(self, observed_at: int) -> float:
        """What a row observed at step `observed_at` weighs now."""
        return max(STALE_WEIGHT, 0.5 ** ((self.num_steps - 1 - observed_at) / HALF_LIFE_STEPS))

    def cost(self) -> StepCost | None:
        if not self.ready:
            return None
        if self._dirty or self._fit is None:
            rows = [(*row[:4], self.weight(row[4])) for rows in self._bins.values() for row in rows]
            rows += [(*row, PRIOR_WEIGHT) for row in self._prior]
            data = np.array(rows)
            # Relative errors: a step's time varies by a factor (a busy core, a cold cache),
            # so a slow step must not outweigh many fast ones by its size alone.
            root = np.sqrt(data[:, 4]) / data[:, 3]
            a = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]]) * root[:, None]
            w, _ = nnls(a, data[:, 3] * root)
            self._fit = StepCost(float(w[0]), float(w[1]), float(w[2]) / PAIRS_SCALE, float(w[3]) / PAIRS_SCALE)
            self._dirty = False
        return self._fit

    def largest_step(self) -> int:
        """Tokens of the largest step among the rows held (start-up ones included)."""
        if self._largest is None:
            rows = [row[0] for rows in self._bins.values() for row in rows] + [row[0] for row in self._prior]
            self._largest = int(max(rows, default=0))
        return self._largest

    def predict(self, num_tokens: int, pairs: int, decode_pairs: int = 0) -> float:
        """A step's predicted wall time (0 before anything is learned)."""
        fit = self.cost()
        return 0.0 if fit is None else fit.predict(num_tokens, pairs, decode_pairs)

    def predict_last(self, num_tokens: int, pairs: int, decode_pairs: int = 0) -> float:
        """As predict, by the last fit made, without fitting again (the first is made here
        where none has been; 0 before anything is learned): for a price wanted at every
        step, where a fit would cost more than the step."""
        fit = self._fit if self._fit is not None else self.cost()
        return 0.0 if fit is None else fit.predict(num_tokens, pairs, decode_pairs)

    def decodes_seconds(self, contexts: list[int]) -> float:
        """A step's predicted wall time if it holds only decode rows at these contexts."""
        pairs = sum(attention_pairs(1, context) for context in contexts)
        return self.predict(len(contexts), pairs, decode_pairs=pairs)

    def chunk_seconds(self, num_tokens: int, context: int) -> float:
        """What adding a prefill chunk of num_tokens at `context` adds to a step (one token:
        a decode row, priced as one)."""
        fit = self.cost()
        if fit is None or num_tokens <= 0:
            return 0.0
        pairs = attention_pairs(num_tokens, context)
        extra = fit.decode_extra_s * pairs if num_tokens == 1 else 0.0
        return fit.per_token_s * num_tokens + fit.per_pair_s * pairs + extra

    def tokens_within(self, seconds: float, context: int, limit: int) -> int:
        """The largest chunk (at most `limit`) that adds no more than `seconds` to a step;
        0 before anything is learned (the caller then picks a cautious size)."""
        fit = self.cost()
        if fit is None or seconds <= 0 or limit <= 0:
            return 0
        limit = min(limit, EXTRAPOLATION * self.largest_step())
        # per_pair * n^2 + (per_token + per_pair * context) * n - seconds <= 0, whose root
        # is written as 2c / (b + sqrt(b^2 + 4ac)): the textbook form cancels to 0 when
        # per_pair is tiny beside per_token. (One token would be priced as a decode row,
        # decode_extra on top: the check below catches it.)
        a, b = fit.per_pair_s, fit.per_token_s + fit.per_pair_s * context
        if a <= 0 and b <= 0:
            return limit
        n = min(limit, int(2 * seconds / (b + (b * b + 4 * a * seconds) ** 0.5)))
        # The square root rounds either way: never hand out a chunk the model says is over,
        # nor one token short of what it says fits (a chunk priced exactly at the allowance).
        while n > 0 and self.chunk_seconds(n, context) > seconds:
            n -= 1
        if n < limit and self.chunk_seconds(n + 1, context) <= seconds:
            n += 1
        return n
