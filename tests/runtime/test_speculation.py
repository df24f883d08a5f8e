"""Speculative decoding's parts without a model: the n-gram proposer, the sampler's
verification (greedy exactly, sampled by its distribution) and the price the speculator
puts on guesses (scripted step costs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from headroom.config import ConfigError, SpeculativeConfig
from headroom.contracts.request import AdmissionRecord, Request, SamplingParams, SizeClass
from headroom.executor.grammar import Constraint
from headroom.executor.sampler import Sampler
from headroom.runtime.speculation import Row, Speculator, draft_seconds, propose_ngram, shared_catch_up
from headroom.runtime.step_cost import StepCost, attention_pairs
from headroom.runtime.suffix import Walk

EOS = 2
VOCAB = 8
_ids = itertools.count()


def make_request(outputs: list[int] = (), size_class: SizeClass | None = None, **sampling) -> Request:
    request = Request(f"s{next(_ids)}", [1, 5, 7], SamplingParams(**sampling))
    request.admission = AdmissionRecord(size_class=size_class)
    for token in outputs:
        request.append_output(token)
    return request


# ---- the proposer ----------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 2, 3]
    # "2 3" occurs at 1 and at 6; the latest (6) is followed by 4 5 8.
    assert propose_ngram(tokens, 2, 4, 3) == [4, 5, 8]
    # With a 3-token suffix "8 2 3" there is no match; "2 3" is the longest that occurs.
    assert propose_ngram(tokens, 3, 4, 3) == []
    assert propose_ngram(tokens, 1, 4, 2) == [4, 5]


def test_ngram_prefers_the_longer_match_and_stops_at_the_end():
    tokens = [3, 1, 2, 5, 9, 1, 2, 8, 3, 1, 2]
    # "3 1 2" occurs at 0 (then 5 9 1); "1 2" last occurred at 5 (then 8 3 1).
    assert propose_ngram(tokens, 2, 3, 3) == [5, 9, 1]
    assert propose_ngram(tokens, 2, 2, 3) == [8, 3, 1]
    # A match right before the suffix is followed by the suffix itself, cut at the end.
    assert propose_ngram([4, 4, 4], 1, 1, 5) == [4]
    assert propose_ngram([4], 1, 2, 3) == []
    assert propose_ngram([1, 2, 3], 1, 2, 0) == []


def test_the_config_takes_vllms_shape_and_refuses_a_minimum_above_the_maximum():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=1)
    assert config.enabled and not SpeculativeConfig(method="off").enabled
    assert SpeculativeConfig() == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2
    )
    with pytest.raises(ConfigError, match=r"prompt_lookup_min must be <= prompt_lookup_max \(4 > 2\)"):
        SpeculativeConfig(method="ngram", prompt_lookup_max=2, prompt_lookup_min=4)
    with pytest.raises(ConfigError, match="speculative.num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    # A draft model is named exactly where it is the method.
    assert SpeculativeConfig(method="draft_model", model="/models/draft.gguf").enabled
    for method, model in (("draft_model", None), ("ngram", "/models/draft.gguf")):
        with pytest.raises(ConfigError, match="model names the draft, and is given exactly when method is draft_model"):
            SpeculativeConfig(method=method, model=model)


# ---- verification ----------------------------------------------------------------------


def rows(*best: int) -> torch.Tensor:
    """Logits whose argmax is each given token, one row each."""
    logits = torch.zeros(len(best), VOCAB)
    for i, token in enumerate(best):
        logits[i, token] = 5.0
    return logits


def test_greedy_keeps_guesses_up_to_the_first_the_model_disagrees_with_then_its_own_token():
    sampler = Sampler({EOS})
    a, b, c = make_request(temperature=0), make_request(temperature=0), make_request(temperature=0)
    # Request rows first (after the last token), then each request's rows after its guesses.
    # a guesses 3 4 5; the model says 3 4 6 (after the last token, after 3, after 4), and 7
    # after 5: 3 and 4 are kept, 5 is not, and 6 is a's own token.
    # b guesses 1; the model says 0 after the last token: the guess is rejected.
    # c guesses nothing; its token is its row's argmax.
    logits = torch.cat([rows(3, 0, 4), rows(4, 6, 7), rows(1)])
    result = sampler(logits, [a, b, c], [[3, 4, 5], [1], []])
    assert result.token_ids == [3, 0, 4]
    assert result.more == {0: [(4, None), (6, None)], 1: []}


def test_greedy_keeps_every_guess_the_model_agrees_with_and_adds_one():
    sampler = Sampler({EOS})
    request = make_request(temperature=0, logprobs=1)
    logits = torch.cat([rows(3), rows(4, 5)])
    result = sampler(logits, [request], [[3, 4]])
    assert result.token_ids == [3]
    assert [t for t, _ in result.more[0]] == [4, 5]
    expected = logits.log_softmax(dim=-1)
    assert result.logprobs[0].logprob == pytest.approx(expected[0, 3].item())
    assert [lp.logprob for _, lp in result.more[0]] == pytest.approx([expected[1, 4].item(), expected[2, 5].item()])


def test_logit_bias_counts_in_verification_as_in_sampling():
    sampler = Sampler({EOS})
    request = make_request(temperature=0, logit_bias=((6, 10.0),))
    logits = torch.cat([rows(3), rows(4)])
    # The bias makes 6 the model's choice after the last token: the guess 3 is rejected.
    result = sampler(logits, [request], [[3]])
    assert result.token_ids == [6] and result.more == {0: []}


def test_penalties_count_the_guesses_before_each_position():
    sampler = Sampler({EOS})
    request = make_request(temperature=0, frequency_penalty=2.0)
    after_guess = torch.zeros(1, VOCAB)
    after_guess[0, 3], after_guess[0, 4] = 5.0, 4.0  # 3 penalised by 2 falls under 4
    # Position 0 has no output to penalise: 3, the guess, is kept. At position 1 the kept 3
    # is output, penalised by 2: 4 is the model's choice, as decoding one a step gives.
    result = sampler(torch.cat([rows(3), after_guess]), [request], [[3]])
    assert (result.token_ids, result.more) == ([3], {0: [(4, None)]})


def test_min_tokens_hold_back_the_end_only_at_the_positions_before_it():
    sampler = Sampler({EOS})
    request = make_request(outputs=[1], temperature=0, min_tokens=2)
    first, second = torch.zeros(1, VOCAB), torch.zeros(1, VOCAB)
    first[0, EOS], first[0, 5] = 6.0, 5.0  # one token made of two: the end is masked, 5 kept
    second[0, EOS] = 6.0  # two made after the guess: the end may come
    result = sampler(torch.cat([first, second]), [request], [[5]])
    assert (result.token_ids, result.more) == ([5], {0: [(EOS, None)]})


def test_sampled_tokens_follow_the_target_distribution_whatever_the_guess():
    """Rejection sampling with a guess the proposer was sure of must leave the first token
    distributed as p, and the second (after a kept guess) as p at the next row. N draws of a
    frequency with probability q have standard deviation sqrt(q(1-q)/N); the bound below is
    5 of those (a fixed seed makes the run deterministic; 5 sigma is where a correct sampler
    would fail about one seed in 10^6 per frequency)."""
    n = 6000
    sampler = Sampler({EOS}, seed=1234)
    first = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.5])
    second = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    guess = [5, 1]  # p(5) ~ 0.21 at the first row: often rejected
    requests = [make_request(temperature=0.8) for _ in range(n)]
    logits = torch.cat([first.expand(n, -1), torch.stack([second, first] * n)])
    result = sampler(logits, requests, [guess] * n)
    tokens = torch.tensor(result.token_ids)
    p = (first / 0.8).softmax(dim=-1)
    for token in range(VOCAB):
        q = p[token].item()
        seen = (tokens == token).float().mean().item()
        assert abs(seen - q) <= 5 * (q * (1 - q) / n) ** 0.5, (token, seen, q)
    kept = [i for i in range(n) if result.token_ids[i] == guess[0]]
    assert all(len(result.more[i]) >= 1 for i in kept)
    assert all(result.more[i] == [] for i in range(n) if i not in kept)
    seconds = torch.tensor([result.more[i][0][0] for i in kept])
    p2 = (second / 0.8).softmax(dim=-1)
    for token in range(VOCAB):
        q = p2[token].item()
        seen = (seconds == token).float().mean().item()
        assert abs(seen - q) <= 5 * (q * (1 - q) / len(kept)) ** 0.5, (token, seen, q)


def test_a_seeded_request_draws_the_same_tokens_with_guesses_as_without():
    """Verification draws each position as decoding one token a step does, from the
    request's own generator: the same seed gives the same tokens, guessed or not."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))

    def decode() -> list[int]:  # one token a step: row j is the logits after j tokens
        sampler, request = Sampler({EOS}), make_request(temperature=1.0, seed=7)
        sampler.add(request)
        return [sampler(logits[j : j + 1].clone(), [request]).token_ids[0] for j in range(4)]

    def guessed(guess: list[int]) -> list[int]:
        sampler, request = Sampler({EOS}, seed=99), make_request(temperature=1.0, seed=7)
        sampler.add(request)
        result = sampler(logits[: len(guess) + 1].clone(), [request], [guess])
        return [result.token_ids[0], *(t for t, _ in result.more[0])]

    plain = decode()
    assert guessed(plain[:3]) == plain  # every guess right: all kept, and the fourth drawn
    wrong = [plain[0], (plain[1] + 1) % VOCAB, plain[2]]
    assert guessed(wrong) == plain[:2]  # the draw at the second position differs: it ends there


# ---- the price -------------------------------------------------------------------------


class ScriptedCost:
    """A step costs base + per_token * tokens (attention free)."""

    def __init__(self, base: float, per_token: float):
        self.base, self.per_token = base, per_token

    num_steps = 0

    def cost(self) -> StepCost:
        return StepCost(self.base, self.per_token, 0.0)


def repeating(size_class: SizeClass | None = None) -> Request:
    """A greedy request whose output repeats its prompt: the proposer always finds a guess."""
    request = Request(f"s{next(_ids)}", [4, 5, 6, 7] * 4, SamplingParams(max_tokens=64, temperature=0))
    request.admission = AdmissionRecord(size_class=size_class)
    request.append_output(4)
    return request


def speculator(cost: ScriptedCost, k: int = 4) -> Speculator:
    return Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k), cost)


def test_guesses_are_given_where_the_step_is_bound_by_its_fixed_cost():
    # One row: a step of 10 ms plus 0.1 ms a token; a guess at one in two costs 0.1 ms and
    # is worth 5 ms.
    requests = [repeating()]
    plan = speculator(ScriptedCost(0.010, 0.0001)).plan([Row(r, 17) for r in requests], 1, 18, 18, 100)
    assert plan == {requests[0].request_id: [5, 6, 7, 4]}


def test_guesses_are_withheld_where_each_token_costs_what_the_step_does():
    # 32 rows at 1 ms a token and 1 ms of fixed cost: one more token costs 1 ms, and a row's
    # share of the step (33 ms / 32) times its expected gain (< 1 token) is worth about as
    # much at best, less than what the other 31 rows lose.
    requests = [repeating() for _ in range(32)]
    plan = speculator(ScriptedCost(0.001, 0.001)).plan([Row(r, 17) for r in requests], 32, 32 * 18, 32 * 18, 100)
    assert plan == {}


def test_the_k_that_gains_most_is_taken_as_acceptance_is_measured():
    cost = ScriptedCost(0.010, 0.002)
    spec = speculator(cost)
    request = repeating()
    # The prior (one in two): a first guess is worth 0.5 * 10 ms against 2 ms; a fourth
    # 0.0625 * 10 ms = 0.6 ms < 2 ms.
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {request.request_id: [5, 6]}
    spec.verified(request, proposed=40, accepted=40)  # it keeps every guess
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {request.request_id: [5, 6, 7, 4]}
    spec.verified(request, proposed=1000, accepted=0)  # then none (41 in 1042 kept)
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {}


def test_a_suffix_walk_is_priced_by_the_lesser_of_its_own_odds_and_the_rows_acceptance():
    cost = ScriptedCost(0.010, 0.0055)
    suffix = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=4), cost)
    # "1 2" was followed by 9, 8 and 7: the walk's first token has one chance in three. At
    # the prior's one in two a guess is worth 7.75 ms against 5.5; at one in three, 5.2 ms.
    request = Request(f"s{next(_ids)}", [1, 2, 9, 1, 2, 8, 1, 2, 7, 1, 2], SamplingParams(max_tokens=64))
    assert suffix.plan([Row(request, 10)], 1, 11, 11, 100) == {}
    assert speculator(cost).plan([Row(request, 10)], 1, 11, 11, 100) == {request.request_id: [7]}
    # A walk whose every step is certain is priced by the acceptance alone, as n-gram's is.
    cost = ScriptedCost(0.010, 0.002)
    suffix = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=4), cost)
    sure = repeating()
    assert suffix.plan([Row(sure, 17)], 1, 18, 18, 100) == {sure.request_id: [5, 6]}
    assert speculator(cost).plan([Row(sure, 17)], 1, 18, 18, 100) == {sure.request_id: [5, 6]}


def test_the_protected_rows_guess_first_and_long_rows_never_beside_them():
    cost = ScriptedCost(0.010, 0.0001)
    short, long_ = repeating(SizeClass.SHORT), repeating(SizeClass.LONG)
    spec = speculator(cost)
    # Long rows come last in the step's order, and beside a short row they never guess.
    plan = spec.plan([Row(short, 17), Row(long_, 17)], 2, 36, 36, 100)
    assert plan == {short.request_id: [5, 6, 7, 4]}
    # The budget goes to the rows in order: the first short row takes what there is.
    other = repeating(SizeClass.SHORT)
    plan = spec.plan([Row(short, 17), Row(other, 17)], 2, 36, 36, 3)
    assert plan == {short.request_id: [5, 6, 7]}
    # Alone, a long row guesses.
    assert spec.plan([Row(long_, 17)], 1, 18, 18, 100) == {long_.request_id: [5, 6, 7, 4]}


def test_rows_guess_whatever_moves_their_distribution_but_a_grammar_being_closed():
    """Penalties, min_tokens and a grammar move a row's distribution with its tokens;
    verification follows them position by position (tests/runtime/test_speculative_decoding.py).
    A grammar the loop detector is closing is narrowed a token at a time: it never guesses;
    nor a row with one token left."""
    spec = speculator(ScriptedCost(0.010, 0.0001))
    penalized = repeating()
    penalized.sampling = SamplingParams(max_tokens=64, temperature=0, frequency_penalty=0.5)
    waiting_for_min = repeating()
    waiting_for_min.sampling = SamplingParams(max_tokens=64, temperature=0, min_tokens=5)
    last = repeating()
    last.sampling = SamplingParams(max_tokens=2, temperature=0)  # one token left: nothing to guess
    near_end = repeating()
    near_end.sampling = SamplingParams(max_tokens=3, temperature=0)  # two left: one guess at most
    constrained = repeating()
    constrained.grammar = Constraint(matcher=None)
    closing = repeating()
    closing.grammar = Constraint(matcher=None)
    closing.grammar.closing = 3
    rows_ = [Row(r, 17) for r in (penalized, waiting_for_min, last, near_end, constrained, closing)]
    every = [5, 6, 7, 4]
    assert spec.plan(rows_, 6, 108, 108, 100) == {
        penalized.request_id: every,
        waiting_for_min.request_id: every,
        near_end.request_id: [5],
        constrained.request_id: every,
    }


# ---- a draft model's price -------------------------------------------------------------


class ScriptedDraft:
    """A draft model at unit level: each forward costs `base` and `per_token` a token
    (attention free), every row is `behind` tokens behind, and it guesses what the n-gram
    proposer finds. It keeps what it was asked for."""

    def __init__(self, base: float, per_token: float = 0.0, behind: int = 1):
        self.cost = ScriptedCost(base, per_token)
        self.behind = behind
        self.asked: list[list[tuple[str, int]]] = []
        self.spent_s = 0.0

    def pending(self, request: Request) -> int:
        return self.behind

    def propose(self, wanted: list[tuple[Request, int]]) -> list[Walk]:
        self.asked.append([(request.request_id, k) for request, k in wanted])
        self.spent_s = self.cost.base * max(k for _, k in wanted)
        return [Walk(propose_ngram(r.all_token_ids, 2, 4, k), [1.0] * k) for r, k in wanted]


def drafting(draft_base: float, **draft) -> tuple[Speculator, ScriptedDraft]:
    """A speculator of a 10 ms step and 0.1 ms a token, its draft `draft_base` a forward."""
    spec = Speculator(SpeculativeConfig(method="draft_model", model="/draft.gguf"), ScriptedCost(0.010, 0.0001))
    spec.drafter = ScriptedDraft(draft_base, **draft)
    return spec, spec.drafter


def test_a_draft_forward_is_priced_by_its_tokens_pairs_and_the_fixed_cost_no_other_row_paid():
    # Three tokens the draft lacks at 7 computed, then two decodes at 10 and 11.
    pairs = attention_pairs(3, 7) + attention_pairs(1, 10) + attention_pairs(1, 11)
    assert draft_seconds(StepCost(0.0, 0.0, 1.0), 10, 3, 3, 5) == pairs
    assert draft_seconds(StepCost(0.0, 1.0, 0.0), 10, 3, 3, 5) == 5  # 3 + 2 tokens
    # The fixed cost: forwards past those the rows before it need (two of them here).
    assert draft_seconds(StepCost(1.0, 0.0, 0.0), 10, 3, 3, 1) == 2
    assert draft_seconds(StepCost(1.0, 0.0, 0.0), 10, 3, 3, 3) == 0
    # A row one token behind runs as decode rows only: all its pairs carry the extra price.
    assert draft_seconds(StepCost(0.0, 0.0, 0.0, 1.0), 10, 1, 2, 0) == attention_pairs(1, 9) + attention_pairs(1, 10)


def test_a_draft_models_forwards_count_in_the_price_of_its_guesses():
    # One row, a 10.1 ms step, 0.1 ms a guessed token. A free draft: all four guesses pay
    # (as n-gram ones do).
    request = repeating()
    spec, draft = drafting(0.0)
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {request.request_id: [5, 6, 7, 4]}
    assert draft.asked == [[(request.request_id, 4)]]
    # At 3 ms a draft forward, at the prior's one in two: a first guess is worth 5.05 ms
    # against 3.1, a second 2.5 ms against 3.1: one guess, and the draft is asked for one.
    spec, draft = drafting(0.003)
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {request.request_id: [5]}
    assert draft.asked == [[(request.request_id, 1)]] and spec.drafted_s == 0.003
    # At 6 ms none pays, and the draft never runs.
    spec, draft = drafting(0.006)
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {}
    assert draft.asked == [] and spec.drafted_s == 0.0
    # A row that keeps its guesses pays for the draft's forwards even at 6 ms.
    spec.verified(request, proposed=40, accepted=40)
    assert spec.plan([Row(request, 17)], 1, 18, 18, 100) == {request.request_id: [5, 6, 7, 4]}


def test_a_draft_forward_another_row_pays_for_is_free_to_the_rows_after_it():
    # Two rows at 3 ms a draft forward. Alone in the step, the second cannot pay for one:
    # 0.5 * 10.2 ms against 2 * 3.1. After a first row that keeps its guesses took four
    # forwards, its guesses cost only their tokens in the target's step.
    keeper, newcomer = repeating(), repeating()
    spec, draft = drafting(0.003)
    assert spec.plan([Row(newcomer, 17), Row(keeper, 17)], 2, 36, 36, 100) == {}
    spec.verified(keeper, proposed=40, accepted=40)
    plan = spec.plan([Row(newcomer, 17), Row(keeper, 17)], 2, 36, 36, 100)
    assert plan == {keeper.request_id: [5, 6, 7, 4]}  # the newcomer was priced before
    plan = spec.plan([Row(keeper, 17), Row(newcomer, 17)], 2, 36, 36, 100)
    assert plan == {keeper.request_id: [5, 6, 7, 4], newcomer.request_id: [5, 6, 7, 4]}
    assert draft.asked[-1] == [(keeper.request_id, 4), (newcomer.request_id, 4)]


def test_a_rows_prompt_enters_the_draft_once_and_its_price_is_shared_by_the_steps_left():
    # A step of guessing leaves the draft two tokens behind at most; what is behind past
    # that is charged over the steps the row's tokens left take, at five a step here.
    assert shared_catch_up(2, 100, 5) == 2
    assert shared_catch_up(1002, 100, 5) == 2 + 1000 * 5 / 100
    assert shared_catch_up(1002, 2, 5) == 1002  # its last step pays all of it
    # A free forward and 0.2 ms a draft token; a 1,000-token prompt the draft has not seen.
    # With 63 tokens left, a step is charged 81 tokens (16.2 ms), more than four guesses
    # are worth (0.9375 x 10.1 ms); with 4,095 left, 3.2 tokens, and four guesses pay.
    # Charged in full (200 ms), no row would ever guess.
    spec, draft = drafting(0.0, per_token=0.0002, behind=1000)
    short = repeating()
    assert spec.plan([Row(short, 17)], 1, 18, 18, 100) == {} and draft.asked == []
    long_ = repeating()
    long_.sampling = SamplingParams(max_tokens=4096, temperature=0)
    assert spec.plan([Row(long_, 17)], 1, 18, 18, 100) == {long_.request_id: [5, 6, 7, 4]}
