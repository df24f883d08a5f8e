"""The step-cost model learns from every step, forgets what is stale, and starts from costs
timed at start-up; while shorter requests decode, long decodes take turns within what the
step may grow by. Scripted costs and a fake clock make every number exact."""

from __future__ import annotations

import itertools

import pytest

from headroom.runtime.step_cost import HALF_LIFE_STEPS, StepCostModel, StepSample, attention_pairs
from tests.runtime.factories import create_request, create_scheduler, run_step
from tests.runtime.test_long_lane import BASE, PER_PAIR, PER_TOKEN, Clock, scripted_cost, teach


def test_a_primed_model_is_ready_and_fits_the_start_up_steps_exactly():
    model = StepCostModel()
    model.prime(start_up_samples())
    assert model.ready and model.num_steps == 0
    fit = model.cost()
    assert (fit.base_s, fit.per_token_s, fit.per_pair_s) == pytest.approx((BASE, PER_TOKEN, PER_PAIR), rel=1e-6)


def test_the_last_fit_prices_without_fitting_again_until_something_fits():
    model = StepCostModel()
    assert model.predict_last(1, 64) == 0.0  # nothing learned
    model.prime(start_up_samples())
    before = model.predict_last(1, 64)  # the first fit, made here
    assert before == pytest.approx(scripted_cost(1, 64))
    for t, c in itertools.product((1, 16, 64, 256), (0, 500, 2000)):  # a neighbour: three times the price
        model.observe(t, attention_pairs(t, c), 3 * scripted_cost(t, attention_pairs(t, c)))
    assert model.predict_last(1, 64) == before  # the tuner's watch: the price from before
    after = model.predict(1, 64)
    assert after > 1.2 * before and model.predict_last(1, 64) == after


def start_up_samples() -> list[StepSample]:
    return [
        StepSample(t, attention_pairs(t, c), scripted_cost(t, attention_pairs(t, c)))
        for t, c in ((64, 0), (1, 64), (64, 960))
    ]


def test_a_few_slow_first_steps_are_forgotten_not_locked_in():
    # Two cold 32-token steps at 2.6 s each (a busy host) come first. The steps after
    # them take the chunks the model hands out (at least 16 tokens, beside three decodes)
    # and cost what the scripted cost says. Under it 60 tokens fit in 0.125 s at context 0.
    model = StepCostModel()
    model.prime(start_up_samples())
    assert model.tokens_within(0.125, 0, 512) == 60
    for _ in range(2):
        model.observe(32, attention_pairs(32, 0), 2.6)
    # Read as a large fixed cost, the cold steps would allow any chunk: never more than
    # twice the largest step held.
    assert model.tokens_within(0.125, 0, 512) <= 2 * 64
    context, sizes = 0, []
    for _ in range(2 * HALF_LIFE_STEPS):
        tokens = max(16, model.tokens_within(0.125, context, 512))
        pairs = attention_pairs(tokens, context) + 3 * attention_pairs(1, 40)
        model.observe(tokens + 3, pairs, scripted_cost(tokens + 3, pairs))
        sizes.append(tokens)
        context = (context + tokens) % 3000
    assert model.cost().per_token_s == pytest.approx(PER_TOKEN, rel=0.05)
    assert model.tokens_within(0.125, 0, 512) == pytest.approx(60, abs=3)
    assert max(sizes) <= 2 * 64 * 2  # the trust region grows only as larger steps are measured


def test_learning_from_every_step_does_not_let_decodes_wash_out_a_prefill_price():
    model = StepCostModel()
    teach(model)
    for _ in range(5000):  # a long stretch of nothing but 8-sequence decodes
        pairs = attention_pairs(1, 700) * 8
        model.observe(8, pairs, scripted_cost(8, pairs))
    assert model.cost().per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)


def decoding(s, requests) -> None:
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        run_step(s)


def turns_scheduler(long_decode_max_skip: int):
    s = create_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        num_blocks=4000,
        clock=Clock(),
        long_lane_quiet_s=1e9,
        long_decode_max_skip=long_decode_max_skip,
    )
    teach(s.cost)
    return s


def long_decodes_meet_shorts(s, num_long: int = 3):
    """Long requests at 3,000 tokens decoding, then two short ones started: returns the
    longs, the shorts and the step that started them."""
    longs = [create_request(prompt=3000, size_class="long", max_tokens=500) for _ in range(num_long)]
    for r in longs:
        s.add_request(r)
    decoding(s, longs)
    shorts = [create_request(prompt=10, size_class="short", max_tokens=100) for _ in range(2)]
    for r in shorts:
        s.add_request(r)
    out, _ = run_step(s)  # the step that starts them: long decodes sit out
    return longs, shorts, out


def test_long_decodes_take_turns_within_the_shorter_requests_time_per_token():
    # Two short decodes cost base 0.010 + 2 x 0.002 = 0.014 s; long rows may add half of
    # that, 0.007 s. A long decode at a 3,000-token context costs 0.002 + 3e-3 = 0.005 s:
    # one fits a step, and the others, having sat out one step (long_decode_max_skip 1),
    # run in the next one whatever it costs.
    s = turns_scheduler(long_decode_max_skip=1)
    longs, ran = long_rows_beside_shorts(s, 6)
    first, second, third = (r.request_id for r in longs)
    # All three sat out the shorts' first step, so all run; then the one that fits runs
    # alone, and the two it left out run together, in turns.
    assert ran[0] == sorted([first, second, third])
    assert [len(r) for r in ran[1:]] == [1, 2, 1, 2, 1]
    for a, b in itertools.pairwise(ran):
        assert set(a) | set(b) == {first, second, third}  # none sits out two steps in a row


def test_long_decodes_run_every_step_where_nothing_shorter_decodes():
    clock = Clock()
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=4000, clock=clock)
    teach(s.cost)
    longs = [create_request(prompt=3000, size_class="long", max_tokens=500) for _ in range(3)]
    for r in longs:
        s.add_request(r)
    decoding(s, longs)
    for _ in range(3):
        out, _ = run_step(s)
        assert out.num_scheduled_tokens == [1, 1, 1]


DECODE_EXTRA = 2e-6  # a decode row's pair costs three times a chunk's in these scripts


def test_decode_rows_learn_a_price_per_pair_of_their_own():
    # Chunks cost as in the long lane's script; a decode row's pairs cost DECODE_EXTRA
    # more each (its context read for one query, where a chunk shares each key read).
    model = StepCostModel()
    teach(model)
    for rows in (1, 2, 4, 8):
        for context in (100, 1000, 3000):
            pairs = rows * attention_pairs(1, context)
            model.observe(rows, pairs, scripted_cost(rows, pairs) + DECODE_EXTRA * pairs, decode_pairs=pairs)
    fit = model.cost()
    assert (fit.base_s, fit.per_token_s, fit.per_pair_s, fit.decode_extra_s) == pytest.approx(
        (BASE, PER_TOKEN, PER_PAIR, DECODE_EXTRA), rel=1e-6
    )
    assert model.chunk_seconds(1, 3000) == pytest.approx(PER_TOKEN + (PER_PAIR + DECODE_EXTRA) * 3001, rel=1e-6)
    assert model.chunk_seconds(100, 1000) == pytest.approx(PER_TOKEN * 100 + PER_PAIR * 100 * 1100, rel=1e-6)
    assert model.predict(2, 5000, decode_pairs=4000) == pytest.approx(
        BASE + PER_TOKEN * 2 + PER_PAIR * 5000 + DECODE_EXTRA * 4000, rel=1e-6
    )
    # Without decode steps to learn from, decode pairs cost what a chunk's do.
    plain = StepCostModel()
    teach(plain)
    assert plain.cost().decode_extra_s == 0.0


def priced_as_decodes(s) -> None:
    """Teaches the scheduler's model that a decode row's pairs cost DECODE_EXTRA more: a
    long decode at 3,000 context then costs 0.002 + 3e-6 x 3001 = 0.011 s, over the 0.007 s
    that two short decodes leave."""
    for context in (100, 1000, 3000):
        pairs = attention_pairs(1, context)
        s.cost.observe(1, pairs, scripted_cost(1, pairs) + DECODE_EXTRA * pairs, decode_pairs=pairs)


def long_rows_beside_shorts(s, steps: int, num_long: int = 3) -> tuple[list, list[list[str]]]:
    """The long requests, and the long decodes each of `steps` steps runs beside two short
    ones (which run every step, and alone in the step that starts them)."""
    longs, shorts, out = long_decodes_meet_shorts(s, num_long)
    short_ids = {r.request_id for r in shorts}
    assert {r.request_id for r in out.requests} == short_ids
    ran = []
    for _ in range(steps):
        out, _ = run_step(s)
        ids = {r.request_id for r in out.requests}
        assert short_ids <= ids <= short_ids | {r.request_id for r in longs}
        ran.append(sorted(ids - short_ids))
    return longs, ran


def test_long_decodes_priced_as_decodes_sit_out_whatever_fits_no_more():
    # No long row fits a step: each sits out one step (long_decode_max_skip 1) and then
    # runs whatever it costs, all three together.
    s = turns_scheduler(long_decode_max_skip=1)
    priced_as_decodes(s)
    _, ran = long_rows_beside_shorts(s, 6)
    assert [len(r) for r in ran] == [3, 0, 3, 0, 3, 0]


def test_the_long_class_keeps_one_decode_a_step_in_turns_where_none_fits():
    # No long row fits a step, and none is owed a step before it has sat out 7: the class's
    # floor alone runs one row a step, the one that sat out longest, so the three take
    # turns and each runs every third step. (All three sat out the step that started the
    # shorts.)
    s = turns_scheduler(long_decode_max_skip=7)
    priced_as_decodes(s)
    _, ran = long_rows_beside_shorts(s, 9)
    assert [len(r) for r in ran] == [1] * 9
    for window in (ran[i : i + 3] for i in range(0, 9, 3)):
        assert sorted(r[0] for r in window) == sorted({r[0] for r in ran})
    assert len({r[0] for r in ran}) == 3


def test_a_lone_long_decode_that_fits_no_step_runs_every_other_one():
    # The floor goes to a decode that sat out: one long decode alone sits out a step and
    # runs in the next, and the steps it sits out leave the budget to long chunks.
    s = turns_scheduler(long_decode_max_skip=7)
    priced_as_decodes(s)
    _, ran = long_rows_beside_shorts(s, 6, num_long=1)
    assert [len(r) for r in ran] == [1, 0] * 3
