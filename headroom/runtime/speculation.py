"""Speculative decoding's proposals and their price.

A decode row that guesses k tokens runs as 1 + k decode rows, one a position over the
same blocks: the model computes the logits after its last token and after each guess in
one pass, with the arithmetic that decoding them one a step would use; the sampler keeps the
guesses the target model agrees with (executor/sampler.py: verify) plus one token of its
own, and the rest are dropped (their cache slots are written again by the next step).

Proposals are n-gram prompt lookup, as vLLM's "ngram" method: the tokens that followed the
latest earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min); suffix decoding, as vLLM's "suffix" (runtime/suffix.py); or a draft
model's greedy tokens, as vLLM's "draft_model" (runtime/drafter.py).

The price: one step that makes n tokens in S seconds makes n + E in S + D with a row's
guesses, where D is what its k guesses add to the step (the step-cost model's price) and E
the tokens they are expected to add: sum(a**i, i = 1..k) for the row's measured acceptance
a, or less where the proposal's own odds are lower (a suffix walk's path frequencies; n-gram
guesses bring none). The guesses pay where E * S > n * D, the step's tokens per second then rising. While
rows of a shorter class than long decode, n counts only them, and long rows never guess:
their guesses would stretch the protected rows' step for another class's gain. Rows are
offered in the policy's order, shorter classes first, and each row takes the k that
gains most; so where a step is bound by arithmetic (many rows) D is large beside S / n
and nothing is guessed, and where it is bound by reading the weights (a few rows) D is
small and guesses are nearly free. A draft model's guesses cost its forwards too, priced by
the draft's own step-cost model and counted in D: its catch-up (a row's prompt enters the
draft's cache once, a cost shared by the steps left to the row: shared_catch_up) and k - 1
decodes for the row, and the fixed cost of each forward no row before it needed. They are
priced before they are drafted (the draft is paid for whatever the row keeps), by the
row's acceptance alone. Until the draft's cost model has a fit (a Drafter built without
Drafter.build's timed start-up steps), its forwards are priced as free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from headroom.config import SpeculativeConfig
from headroom.contracts.request import Request, SizeClass
from headroom.runtime.step_cost import StepCost, StepCostModel, attention_pairs
from headroom.runtime.suffix import SuffixCache, Walk

if TYPE_CHECKING:
    from headroom.runtime.drafter import Drafter

REFIT_STEPS = 8
CAUGHT_UP = 2  # the most a step of guessing leaves the draft behind (runtime/drafter.py)


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


def room(request: Request) -> int:
    """The most tokens that may be guessed for request: all but the last of those left,
    which is the model's own."""
    return request.max_tokens - request.num_output_tokens - 1


def step_pairs(num_tokens: int, context: int, guessed: bool) -> int:
    """Attention pairs of a row of num_tokens on `context`; a row that guessed runs as a
    decode row a position (executor/model_runner.py), each over its own prefix."""
    if guessed:  # the sum of attention_pairs(1, context + j) for j < num_tokens
        return num_tokens * (context + 1) + num_tokens * (num_tokens - 1) // 2
    return attention_pairs(num_tokens, context)


def added_seconds(fit: StepCost, context: int, k: int) -> float:
    """What k guesses after a decode row at `context` add to a step: k tokens, each a decode
    row over its own prefix."""
    extra = step_pairs(1 + k, context, True) - attention_pairs(1, context)
    return fit.per_token_s * k + (fit.per_pair_s + fit.decode_extra_s) * extra


def shared_catch_up(pending: int, left: int, per_step: int) -> float:
    """The draft tokens a step of guessing is charged for a row `pending` tokens behind in
    the draft's cache, with `left` tokens to make. A step of guessing leaves the draft
    CAUGHT_UP tokens behind at most (the target's own token, and the last guess where all
    were kept); what a row is behind past that (its prompt, on its first guess) enters the
    draft once, a cost shared by the steps that make its `left` tokens at up to `per_step`
    a step."""
    if pending <= CAUGHT_UP:
        return pending
    return CAUGHT_UP + (pending - CAUGHT_UP) * per_step / max(per_step, left)


def draft_seconds(fit: StepCost, length: int, pending: float, k: int, forwards: int) -> float:
    """What drafting k guesses for a row of `length` tokens costs the draft model: a forward
    of the `pending` tokens its cache lacks (a share of them, from shared_catch_up), then
    k - 1 decodes, batched with the other rows' (`forwards`: the forwards they already
    take, whose fixed cost is paid)."""
    first = attention_pairs(pending, length - pending)
    decodes = (k - 1) * length + k * (k - 1) // 2  # attention_pairs(1, length + i - 1), i < k
    decode_pairs = decodes + (first if pending == 1 else 0)
    arithmetic = fit.per_token_s * (pending + k - 1) + fit.per_pair_s * (first + decodes)
    return arithmetic + fit.decode_extra_s * decode_pairs + fit.base_s * max(0, k - forwards)


@dataclass(frozen=True)
class Acceptance:
    """A sequence's guesses so far: its measured acceptance, a prior of one in two."""

    proposed: int = 0
    accepted: int = 0

    @classmethod
    def of(cls, request: Request) -> Acceptance:
        return cls(request.resources.num_draft_tokens, request.resources.num_accepted_tokens)

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
        self._fit: StepCost | None = None
        self._draft_fit: StepCost | None = None  # the drafter's, taken with _fit
        self._fit_at = 0  # the cost model's step count when _fit was taken
        self.suffixes = SuffixCache(config) if config.method == "suffix" else None
        self.drafter: Drafter | None = None  # the engine's, with method draft_model (runtime/drafter.py)
        self.priced = True  # tests of the outputs turn the price off, to guess wherever a row can
        self.drafted_s = 0.0  # seconds the draft model's forwards took in the last plan()

    def eligible(self, request: Request) -> bool:
        """Guesses are verified exactly as decoding would draw each token (penalties,
        min_tokens and a grammar's mask moved by the guesses before it: executor/sampler.py
        verify), except while the loop detector steers a grammar closed (its mask is
        narrowed a token at a time), and where one token is left."""
        return (request.grammar is None or not request.grammar.closing) and room(request) > 0

    def propose(self, wanted: list[tuple[Request, int]]) -> list[Walk]:
        """At most k guesses for each (request, k) (the caller keeps k within max_tokens: the
        last token is the model's own). An n-gram match says nothing of its own odds: its
        tokens' chances are left at 1, for the row's measured acceptance to decide."""
        c = self.config
        if self.drafter is not None:  # one forward a position for all the rows
            return self.drafter.propose(wanted)
        if self.suffixes is not None:
            return [self.suffixes.propose(request, k) for request, k in wanted]
        walks = []
        for request, k in wanted:
            tokens = propose_ngram(request.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)
            walks.append(Walk(tokens, [1.0] * len(tokens)))
        return walks

    def plan(self, rows: list[Row], tokens: int, pairs: int, decode_pairs: int, budget: int) -> dict[str, list[int]]:
        """Guesses for some of `rows` (the step's decode rows, in the policy's order), within
        `budget` tokens, for a step of `tokens`, `pairs` and `decode_pairs` so far."""
        protected = [row for row in rows if row.request.size_class != SizeClass.LONG]
        if protected and len(protected) < len(rows):
            rows = protected  # long rows never stretch a shorter class's step
        beneficiaries = len(rows)
        fit = self._price()
        drafting = fit is not None and self.drafter is not None and self._draft_fit is not None
        seconds = 0.0 if fit is None else fit.predict(tokens, pairs, decode_pairs)
        forwards = 0  # the draft's forwards the rows taken so far need
        self.drafted_s = 0.0
        # Priced before anything is looked up: where no guess pays (a step of many rows), the
        # proposer costs nothing either. The budget is held for the most each row may take.
        wanted: list[tuple[Row, int]] = []
        for row in rows:
            if budget <= 0:
                break
            request = row.request
            if not self.eligible(request):
                continue
            # k guesses are worth at most k * rate steps and cost at least k times one: a row
            # whose rate cannot pay for one guess cannot pay for more.
            rate = Acceptance.of(request).rate
            if fit is not None and rate * seconds <= beneficiaries * added_seconds(fit, row.context, 1):
                continue
            most = min(self.config.num_speculative_tokens, budget, room(request))
            if drafting:  # the draft is paid for before its guesses are seen: k is chosen now
                pending = shared_catch_up(self.drafter.pending(request), room(request) + 1, 1 + most)
                cost = partial(draft_seconds, self._draft_fit, request.num_tokens, pending, forwards=forwards)
                most, added = self._best(row, [1.0] * most, fit, seconds, beneficiaries, cost)
                if not most:
                    continue
                seconds += added
                forwards = max(forwards, most)
            wanted.append((row, most))
            budget -= most
        walks = self.propose([(row.request, most) for row, most in wanted]) if wanted else []
        if self.drafter is not None:
            self.drafted_s = self.drafter.spent_s if wanted else 0.0
        drafts: dict[str, list[int]] = {}
        for (row, _), walk in zip(wanted, walks, strict=True):
            k = len(walk.tokens)  # a drafting row's k, priced above; or unpriced: guess, and learn the price
            if fit is not None and not drafting:  # the guesses that gain most
                k, added = self._best(row, walk.chances, fit, seconds, beneficiaries, lambda j: 0.0)
                seconds += added
            if k:
                drafts[row.request.request_id] = walk.tokens[:k]
        return drafts

    @staticmethod
    def _best(
        row: Row, chances: list[float], fit: StepCost, seconds: float, beneficiaries: int, draft: Callable[[int], float]
    ) -> tuple[int, float]:
        """The number of guesses (of at most len(chances)) that gains most for a step of
        `seconds`, by the lesser of the row's acceptance and the proposal's own odds, and what
        they add to the step (the draft's forwards, `draft(k)`, among it); (0, 0.0) where
        none pays."""
        acceptance = Acceptance.of(row.request)
        best, best_gain, best_added, odds = 0, 0.0, 0.0, 0.0
        for j, chance in enumerate(chances, 1):
            odds += chance
            added = added_seconds(fit, row.context, j) + draft(j)
            gain = min(acceptance.expected(j), odds) * seconds - beneficiaries * added
            if gain > best_gain:
                best, best_gain, best_added = j, gain, added
        return best, best_added

    def _price(self) -> StepCost | None:
        """The step-cost model's fit, taken again every REFIT_STEPS steps: a fit costs about
        as much as pricing a step of 32 rows, and prices move slowly. Unpriced, every row
        that can guess does (as before any step is learned)."""
        if not self.priced:
            return None
        steps = self.cost.num_steps
        if self._fit is None or steps - self._fit_at >= REFIT_STEPS:
            self._fit, self._fit_at = self.cost.cost(), steps
            self._draft_fit = self.drafter.cost.cost() if self.drafter is not None else None
        return self._fit

    @staticmethod
    def verified(request: Request, proposed: int, accepted: int) -> None:
        request.resources.num_draft_tokens += proposed
        request.resources.num_accepted_tokens += accepted

    def preempted(self, request: Request) -> None:
        """A preempted row's draft cache goes with its own (it is rebuilt on its next guess)."""
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

    def finished(self, request: Request) -> None:
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        if self.suffixes is not None:
            self.suffixes.add(request)
