"""Speculative decoding's proposals and their price.

A decode row that guesses k tokens runs as 1 + k decode rows, one a position over the
same blocks: the model computes the logits after its last token and after each guess in
one pass, with the arithmetic that decoding them one a step would use; the sampler keeps the
guesses the target model agrees with (executor/sampler.py: verify) plus one token of its
own, and the rest are dropped (their cache slots are written again by the next step).

Proposals are n-gram prompt lookup, as vLLM's "ngram" method: the tokens that followed the
latest earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min).

The price: one step that makes n tokens in S seconds makes n + E in S + D with a row's
guesses, where D is what its k guesses add to the step (the step-cost model's price) and E
the tokens they are expected to add, sum(a**i, i = 1..k) for the row's measured acceptance
a. The guesses pay where E * S > n * D, the step's tokens per second then rising. While
rows of a shorter class than long decode, n counts only them, and long rows never guess:
their guesses would stretch the protected rows' step for another class's gain. Rows are
offered in the policy's order, shorter classes first, and each row takes the k that
gains most; so where a step is bound by arithmetic (many rows) D is large beside S / n
and nothing is guessed, and where it is bound by reading the weights (a few rows) D is
small and guesses are nearly free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from headroom.config import SpeculativeConfig
from headroom.contracts.request import Request, SizeClass
from headroom.runtime.step_cost import StepCostModel, attention_pairs


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens,
    for the longest n in [min_n, max_n] that occurs; [] where none does."""
    size = len(tokens)
    if size < min_n + 1 or k <= 0:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = array[size - n :]
        # Candidates end before the suffix itself; the first token narrows them cheaply.
        starts = np.flatnonzero(array[: size - n] == suffix[0])
        for start in starts[::-1]:
            if start + n < size and np.array_equal(array[start : start + n], suffix):
                follow = array[start + n : start + n + k]
                if len(follow):
                    return follow.tolist()
    return []


def step_pairs(num_tokens: int, context: int, guessed: bool) -> int:
    """Attention pairs of a row of num_tokens on `context`; a row that guessed runs as a
    decode row a position (executor/model_runner.py), each over its own prefix."""
    if guessed:
        return sum(attention_pairs(1, context + j) for j in range(num_tokens))
    return attention_pairs(num_tokens, context)


@dataclass
class Acceptance:
    """A sequence's guesses so far: its measured acceptance, a prior of one in two."""

    proposed: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.proposed + 2)

    def expected(self, k: int) -> float:
        """Tokens k guesses are expected to add: each is kept only if all before it were."""
        a = self.rate
        return sum(a**i for i in range(1, k + 1))


@dataclass
class Row:
    """A decode row of the step being scheduled, as the speculator sees it."""

    request: Request
    context: int  # tokens computed before this step


class Speculator:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel):
        self.config = config
        self.cost = cost
        self.acceptance: dict[str, Acceptance] = {}

    def eligible(self, request: Request) -> bool:
        """Guesses are verified exactly where a token's distribution does not depend on the
        tokens sampled before it in the same step: not under penalties (they count the
        output), min_tokens still to reach (its mask moves with the count) or a grammar
        (its matcher advances token by token)."""
        return (
            not request.sampling.penalized
            and request.num_output_tokens >= request.sampling.min_tokens
            and request.grammar is None
            and request.max_tokens - request.num_output_tokens > 1
        )

    def propose(self, request: Request) -> list[int]:
        c = self.config
        room = request.max_tokens - request.num_output_tokens - 1  # the last token is the model's own
        return propose_ngram(
            request.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max, min(c.num_speculative_tokens, room)
        )

    def plan(self, rows: list[Row], tokens: int, pairs: int, decode_pairs: int, budget: int) -> dict[str, list[int]]:
        """Guesses for some of `rows` (the step's decode rows, in the policy's order), within
        `budget` tokens, for a step of `tokens`, `pairs` and `decode_pairs` so far."""
        protected = [row for row in rows if row.request.size_class != SizeClass.LONG]
        if protected and len(protected) < len(rows):
            rows = protected  # long rows never stretch a shorter class's step
        beneficiaries = len(rows)
        seconds = self.cost.predict(tokens, pairs, decode_pairs)
        drafts: dict[str, list[int]] = {}
        for row in rows:
            if budget <= 0:
                break
            request = row.request
            if not self.eligible(request):
                continue
            guess = self.propose(request)[:budget]
            if not guess:
                continue
            acceptance = self.acceptance.setdefault(request.request_id, Acceptance())
            best, best_gain, best_cost = 0, 0.0, 0.0
            for k in range(1, len(guess) + 1):
                added = self._added(tokens, pairs, decode_pairs, row.context, k) if seconds > 0 else 0.0
                gain = acceptance.expected(k) * seconds - beneficiaries * added
                if seconds <= 0 or gain > best_gain:  # nothing learned yet: guess, and learn the price
                    best, best_gain, best_cost = k, gain, added
            if best == 0:
                continue
            drafts[request.request_id] = guess[:best]
            budget -= best
            tokens += best
            extra = step_pairs(1 + best, row.context, True) - attention_pairs(1, row.context)
            pairs, decode_pairs, seconds = pairs + extra, decode_pairs + extra, seconds + best_cost
        return drafts

    def _added(self, tokens: int, pairs: int, decode_pairs: int, context: int, k: int) -> float:
        """What k guesses after a decode row at `context` add to the step."""
        extra = step_pairs(1 + k, context, True) - attention_pairs(1, context)
        return self.cost.predict(tokens + k, pairs + extra, decode_pairs + extra) - self.cost.predict(
            tokens, pairs, decode_pairs
        )

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        acceptance = self.acceptance.setdefault(request_id, Acceptance())
        acceptance.proposed += proposed
        acceptance.accepted += accepted

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
