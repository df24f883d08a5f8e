"""The long lane's prefill allowance: derived from the engine's measured step cost and the
short class's TTFT target, tightened by the head-of-line loop, and bounded below by the
long class's wait. A fake clock and a scripted step cost make every chunk exact."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from headroom.config import ObservabilityConfig
from headroom.observability.hol import HolMonitor
from headroom.observability.windows import LatencyWindows
from headroom.runtime.lane import MIN_LONG_CHUNK, TIGHTEST, UNTRAINED_LONG_CHUNK, HolFeedback
from headroom.runtime.outputs import EngineSnapshot, EngineStats
from headroom.runtime.step_cost import StepCostModel, attention_pairs
from tests.runtime.factories import create_request, create_scheduler, run_step

BASE, PER_TOKEN, PER_PAIR = 0.010, 0.002, 1e-6


def scripted_cost(num_tokens: int, pairs: int) -> float:
    return BASE + PER_TOKEN * num_tokens + PER_PAIR * pairs


def teach(model: StepCostModel) -> None:
    """Steps of many shapes: decodes, short prefills, long chunks deep in a context."""
    for tokens in (1, 2, 5, 16, 40, 64, 100, 200, 300, 512):
        for context in (0, 200, 1000, 3000):
            pairs = attention_pairs(tokens, context)
            model.observe(tokens, pairs, scripted_cost(tokens, pairs))


def largest_chunk(seconds: float, context: int, limit: int) -> int:
    """The oracle: the biggest n whose scripted cost fits, found by counting up."""
    n = 0
    while n < limit and PER_TOKEN * (n + 1) + PER_PAIR * attention_pairs(n + 1, context) <= seconds:
        n += 1
    return n


def quiet_chunks(target_s: float, upto: int, prompt: int, budget: int) -> list[int]:
    """The oracle for a long prompt alone where nobody shorter has arrived lately: chunks
    of what the whole TTFT target covers at each context, or half of the budget where that
    is more, until `upto` tokens are in."""
    sizes, context = [], 0
    while context < upto:
        n = min(prompt - context, max(largest_chunk(target_s, context, budget), budget // 2))
        sizes.append(n)
        context += n
    return sizes


# A time-per-token objective so loose it never binds: for the tests of the TTFT-derived
# allowance alone (the tests of the objective itself use the default).
NO_TPOT_BOUND = 100.0


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_cost_model_recovers_a_scripted_step_cost():
    model = StepCostModel()
    assert not model.ready and model.cost() is None and model.tokens_within(1.0, 0, 512) == 0
    teach(model)
    fit = model.cost()
    assert fit.base_s == pytest.approx(BASE, rel=1e-6)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fit.per_pair_s == pytest.approx(PER_PAIR, rel=1e-6)
    # 1e-6 n^2 + 0.002 n <= 0.25 -> n = 118 (119 costs 0.2522 s).
    assert model.tokens_within(0.25, 0, 512) == 118
    for context in (0, 500, 1024, 2048, 8000):
        assert model.tokens_within(0.25, context, 512) == largest_chunk(0.25, context, 512)
    assert model.tokens_within(10.0, 0, 512) == 512  # the step's own budget still caps it
    assert model.chunk_seconds(100, 1000) == pytest.approx(PER_TOKEN * 100 + PER_PAIR * 100 * 1100, rel=1e-6)
    assert model.predict(8, 5000) == pytest.approx(BASE + PER_TOKEN * 8 + PER_PAIR * 5000, rel=1e-6)


def test_the_largest_chunk_within_a_chunks_own_price_is_that_chunk():
    # An allowance priced as exactly n tokens' cost buys n tokens, not one short of them
    # where the quadratic's root rounds down.
    model = StepCostModel()
    teach(model)
    for context in (0, 100, 1000, 3072, 9912):
        for n in (1, 16, 17, 128, 255, 256, 511):
            assert model.tokens_within(model.chunk_seconds(n, context), context, 512) == n
            assert model.tokens_within(model.chunk_seconds(n, context) * (1 - 1e-9), context, 512) == n - 1


def test_decode_only_steps_do_not_wash_out_what_prefill_taught():
    model = StepCostModel()
    teach(model)
    for _ in range(5000):  # a long stretch of nothing but 8-sequence decodes
        model.observe(8, attention_pairs(1, 700) * 8, scripted_cost(8, attention_pairs(1, 700) * 8))
    assert model.cost().per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)


def test_allowance_is_a_quarter_of_the_short_target_and_the_floor_grows_with_the_long_wait():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        num_blocks=2000,
        clock=clock,
        short_ttft_target_s=0.5,
        long_ttft_target_s=10.0,
    )
    lane = s.lane
    long = create_request(prompt=3000, size_class="long", arrival=clock.t)
    short_running = create_request(prompt=10, size_class="short", arrival=clock.t)
    short_waiting = create_request(prompt=10, size_class="short", arrival=clock.t)
    # Nobody to protect, and nobody shorter has arrived: the whole TTFT target, since the
    # first short request to come waits for all of the step it arrives during.
    assert lane.prefill_allowance([long], [], clock.t) == 0.5
    # Nobody to protect now, but one arrived lately and another may arrive during the
    # step: a quarter of the target, until long_lane_quiet_s has passed without one.
    lane.note_arrival(short_running, clock.t - 1.0)
    assert lane.prefill_allowance([long], [], clock.t) == 0.125
    assert lane.prefill_allowance([long], [], clock.t - 1.0 + s.config.long_lane_quiet_s - 0.01) == 0.125
    assert lane.prefill_allowance([long], [], clock.t - 1.0 + s.config.long_lane_quiet_s) == 0.5
    assert lane.prefill_allowance([long, short_running], [], clock.t) == 0.125
    # A step that starts a shorter request carries nothing until the long one has waited
    # long_ttft_target_s, then the whole allowance ...
    assert lane.prefill_allowance([long], [short_waiting], clock.t) == 0.0
    assert lane.prefill_allowance([long], [short_waiting], clock.t + 9.9) == 0.0
    assert lane.prefill_allowance([long], [short_waiting], clock.t + 10.0) == 0.125
    lane.factor = 0.25  # tightened by the head-of-line loop ...
    assert lane.prefill_allowance([long, short_running], [], clock.t) == 0.03125
    # ... but not below the floor, which grows with the long request's wait.
    assert lane.prefill_allowance([long, short_running], [], clock.t + 5.0) == 0.0625
    assert lane.prefill_allowance([long], [short_waiting], clock.t + 5.0) == 0.0
    assert lane.prefill_allowance([long], [short_waiting], clock.t + 60.0) == 0.125


def test_where_a_step_is_slower_than_the_target_a_long_chunk_may_stretch_it_by_a_quarter():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, short_ttft_target_s=0.5
    )
    model = s.cost
    for tokens in (1, 2, 4, 8, 16, 64, 256):  # a slow machine: 1.2 s a step before any token
        for context in (0, 500, 2000):
            model.observe(tokens, attention_pairs(tokens, context), 1.2 + PER_TOKEN * tokens)
    shorts = [create_request(prompt=10, size_class="short", arrival=clock.t) for _ in range(4)]
    long = create_request(prompt=3000, size_class="long", arrival=clock.t)
    for r in (*shorts, long):
        s.add_request(r)
    run_step(s)  # the shorts' prefill, and a first long chunk sized before anything decodes
    base = model.predict(4, sum(attention_pairs(1, r.num_computed_tokens) for r in shorts))
    assert base == pytest.approx(1.2 + 4 * PER_TOKEN, rel=1e-6)
    assert s.lane.allowance(s.running, s.waiting, clock.t) == pytest.approx(0.25 * base)  # 0.3 s > 0.125 s
    assert chunks(s, long.request_id, 1) == [model.tokens_within(0.25 * base, 0, 512 - 4)]


def chunks(s, request_id: str, steps: int) -> list[int]:
    sizes = []
    for _ in range(steps):
        out, _ = run_step(s)
        sizes.append(dict(zip([r.request_id for r in out.requests], out.num_scheduled_tokens)).get(request_id, 0))
    return sizes


def test_chunks_follow_the_learned_cost_as_the_context_grows():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        num_blocks=2000,
        clock=clock,
        short_ttft_target_s=0.5,
        short_tpot_stretch=NO_TPOT_BOUND,
    )
    teach(s.cost)
    long = create_request(prompt=1500, size_class="long", max_tokens=2, arrival=clock.t)
    short = create_request(prompt=10, size_class="short", max_tokens=500, arrival=clock.t)
    s.add_request(long)
    s.add_request(short)
    # The first step starts the short one and carries no long chunk; after it, the short
    # decodes beside each chunk.
    expected, context = [0], 0
    while context < 1500:
        n = min(1500 - context, largest_chunk(0.125, context, 512 - 1))
        expected.append(n)
        context += n
    assert chunks(s, long.request_id, len(expected)) == expected
    assert expected[1] == 60 and expected[-2] == 35  # deeper context, smaller chunks
    assert long.num_computed_tokens == 1500


def test_a_long_prompt_alone_after_a_quiet_spell_takes_chunks_of_the_whole_ttft_target_not_the_budget():
    # Nobody shorter has arrived: a fresh server's first prompt. A 512-token chunk costs
    # 1.29 s here at context 0; the first short request to arrive would wait for it all.
    # Each chunk is what the TTFT target (1 s) covers at its context instead, and never
    # under half the budget, which deep in the context is what binds.
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, short_ttft_target_s=1.0
    )
    teach(s.cost)
    long = create_request(prompt=3000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(long)
    expected = quiet_chunks(1.0, 3000, 3000, 512)
    assert chunks(s, long.request_id, len(expected)) == expected
    assert expected[:6] == [414, 360, 322, 294, 273, 256] and max(expected) < 512
    assert expected[0] == largest_chunk(1.0, 0, 512) and min(expected[:-1]) == 256
    assert long.num_computed_tokens == 3000


def test_after_a_quiet_spell_on_a_slow_machine_a_chunk_takes_at_least_half_of_the_budget():
    # A token costs 10 ms: the 0.5 s TTFT target covers 50 of them, a chunk that pays the
    # step's fixed cost for little. Half of the 512-token budget instead: 256 tokens, 2.56 s.
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, short_ttft_target_s=0.5)
    model = s.cost
    for tokens in (1, 2, 4, 8, 16, 64, 256, 512):
        for context in (0, 500, 2000):
            model.observe(tokens, attention_pairs(tokens, context), 0.04 + 0.01 * tokens)
    long = create_request(prompt=3000, size_class="long", max_tokens=2)
    assert s.lane.prefill_allowance([long], [], 0.0) == pytest.approx(2.56, rel=1e-6)
    s.add_request(long)
    assert chunks(s, long.request_id, 3) == [256, 256, 256]
    # Once a shorter request has arrived, a quarter of the target again.
    s.lane.note_arrival(create_request(prompt=10, size_class="short"), 0.0)
    assert s.lane.prefill_allowance([long], [], 1.0) == 0.125


def test_a_long_chunk_takes_its_minimum_even_where_one_token_costs_more_than_the_allowance():
    # Deep enough in a context, one token costs more than the allowance (1e-6 s a pair:
    # 0.2 s at 200,000 keys against 0.125 s). MIN_LONG_CHUNK all the same, or it crawls.
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, short_ttft_target_s=0.5)
    teach(s.cost)
    lane = s.lane
    assert lane.cost.tokens_within(0.125, 200_000, 512) == 0
    assert lane.chunk_tokens(200_000, 0.125, 512) == MIN_LONG_CHUNK
    assert lane.chunk_tokens(200_000, 0.0, 512) == 0  # no allowance at all: nothing
    assert lane.chunk_tokens(200_000, 0.125, 512, floor=False) == 0  # taking turns: it sits out
    assert lane.chunk_tokens(200_000, 0.125, 9, floor=False) == 0
    assert lane.chunk_tokens(0, 0.125, 512, floor=False) == 60
    assert lane.chunk_tokens(0, 0.125, 512) == largest_chunk(0.125, 0, 512) == 60


@pytest.mark.parametrize("max_skip", [3, 1])
def test_while_a_short_decodes_a_chunk_spends_its_time_per_token_budget_and_takes_turns(max_skip):
    # While the short one decodes, a long chunk may add what the TTFT-derived allowance
    # (0.15 s / 4 = 37.5 ms) and the short class's time-per-token budget (half of the
    # ~12 ms its decode step costs) both cover, plus what it saved sitting out. At context
    # 3,072 a token costs 2 ms + 3 ms of attention, so one step covers one token, under
    # MIN_LONG_CHUNK: the chunk sits out and carries the unspent seconds over, until they
    # cover a chunk or it has sat out max_skip steps in a row (then MIN_LONG_CHUNK). Once
    # the short one is done, MIN_LONG_CHUNK every step.
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, long_prefill_max_skip=max_skip
    )
    teach(s.cost)
    long = create_request(prompt=4000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(long)
    alone = quiet_chunks(0.15, 3072, 4000, 512)  # nobody to protect: the whole TTFT target
    assert chunks(s, long.request_id, len(alone)) == alone
    short = create_request(prompt=10, size_class="short", max_tokens=9, arrival=clock.t)
    s.add_request(short)
    context = long.num_computed_tokens
    assert largest_chunk(0.0375, context, 512) == 7
    sizes = chunks(s, long.request_id, 12)
    expected, saved, skips = [0], 0.0, 0  # nothing beside the step that starts it
    for step in range(1, 12):
        decoding = step <= 8  # its prefill step gives the first token, then 8 decodes
        left = 0.0375
        if decoding:
            tpot = 0.5 * scripted_cost(1, attention_pairs(1, 10 + step - 1))
            left = min(left, tpot) + saved
        n = largest_chunk(left, context, 512)
        if n < MIN_LONG_CHUNK:
            n = MIN_LONG_CHUNK if not decoding or skips >= max_skip else 0
        skips, saved = (0, 0.0) if n else (skips + 1, left)
        expected.append(n)
        context += n
    assert sizes == expected
    assert short.is_finished
    if max_skip == 3:  # the budget never covers MIN_LONG_CHUNK: the floor sets the pace
        assert sizes == [0, 0, 0, 0, 16, 0, 0, 0, 16, 16, 16, 16]
    else:
        assert sizes == [0, 0, 16, 0, 16, 0, 16, 0, 16, 16, 16, 16]


def test_a_long_decode_row_and_a_long_chunk_share_the_time_per_token_budget():
    # A short one decodes beside a long decode at context 2,000 and a long prompt at 0.
    # The short class's budget is half its step's ~12 ms; the long row goes first and
    # costs 2 ms + 2 ms of attention, so the chunk may spend only the ~2 ms left: it sits
    # out and saves that, until the savings cover MIN_LONG_CHUNK (~32 ms at context 0),
    # before the floor (20 steps here) would force it.
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=4000, clock=clock, long_prefill_max_skip=20
    )
    teach(s.cost)
    decoding = create_request(prompt=2000, size_class="long", max_tokens=100, arrival=clock.t)
    s.add_request(decoding)
    alone = quiet_chunks(0.15, 2000, 2000, 512)  # nobody to protect
    assert chunks(s, decoding.request_id, len(alone)) == alone
    short = create_request(prompt=10, size_class="short", max_tokens=100, arrival=clock.t)
    s.add_request(short)
    assert scheduled(run_step(s)[0]) == {short.request_id: 10}  # the long decode sits it out
    prompt = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(prompt)
    saved, skips, expected, sizes = 0.0, 0, [], []
    for _ in range(20):
        budget = 0.5 * scripted_cost(1, attention_pairs(1, short.num_computed_tokens))
        row = PER_TOKEN + PER_PAIR * attention_pairs(1, decoding.num_computed_tokens)
        left = min(0.0375, budget - row) + saved
        n = largest_chunk(left, prompt.num_computed_tokens, 512 - 2)
        if n < MIN_LONG_CHUNK:
            n = MIN_LONG_CHUNK if skips >= 20 else 0
        skips, saved = (0, 0.0) if n else (skips + 1, left)
        expected.append(n)
        step = scheduled(run_step(s)[0])
        assert step.get(decoding.request_id) == 1 and step.get(short.request_id) == 1
        sizes.append(step.get(prompt.request_id, 0))
    # The savings cover a chunk after 16 steps sitting out: without the row's price it
    # would come after 5, without the carry-over only by the floor, after 20.
    assert sizes == expected == [0] * 16 + [16, 0, 0, 0]


def chunks_after_a_wait(waited: float, steps: int) -> list[int]:
    """A 1,000-token long prompt's chunks beside a short decode, the prompt having arrived
    `waited` seconds before (the clock stands still), checked step by step against the
    oracle. Its whole prefill is scripted at 3 s, so its deadline is twice that (under
    the 10 s long_ttft_target_s): the chunk may spend the short class's budget and as much
    again times the share of the deadline waited (at most once more), plus what it saved
    sitting out."""
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, long_prefill_max_skip=20
    )
    teach(s.cost)
    short = create_request(prompt=10, size_class="short", max_tokens=100, arrival=clock.t)
    s.add_request(short)
    assert scheduled(run_step(s)[0]) == {short.request_id: 10}
    prompt = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t - waited)
    s.add_request(prompt)
    alone = PER_TOKEN * 1000 + PER_PAIR * attention_pairs(1000, 0)
    assert alone == pytest.approx(3.0)
    share = min(1.0, waited / (2 * alone))
    assert s.lane.long_wait_share([], [prompt], clock.t) == pytest.approx(share)
    saved, skips, sizes = 0.0, 0, []
    for _ in range(steps):
        budget = 0.5 * scripted_cost(1, attention_pairs(1, short.num_computed_tokens))
        left = min(0.0375, budget * (1 + share)) + saved
        n = largest_chunk(left, prompt.num_computed_tokens, 512 - 1)
        if n < MIN_LONG_CHUNK:
            n = MIN_LONG_CHUNK if skips >= 20 else 0
        skips, saved = (0, 0.0) if n else (skips + 1, left)
        step = scheduled(run_step(s)[0])
        assert step.get(short.request_id) == 1
        assert step.get(prompt.request_id, 0) == n
        sizes.append(n)
    return sizes


def test_a_long_prompts_wait_loosens_the_time_per_token_budget_on_its_chunks_up_to_its_deadline():
    # At context 0 a token costs 2 ms and the budget is half the short's ~12 ms step, so
    # each chunk sits out and saves until its savings cover MIN_LONG_CHUNK (~32 ms): sooner
    # the longer the prompt has waited, twice as soon from its deadline (6 s here) on, and
    # no sooner after.
    totals = {waited: sum(chunks_after_a_wait(waited, 24)) for waited in (0.0, 2.0, 5.0, 6.0, 18.0)}
    assert totals[0.0] < totals[2.0] < totals[5.0] < totals[6.0] == totals[18.0]
    assert 1.9 * totals[0.0] <= totals[6.0] <= 2 * totals[0.0]


def test_a_long_prompts_deadline_prices_only_what_it_must_compute_and_ends_at_its_first_token():
    clock = Clock()
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock)
    teach(s.cost)
    prompt = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t - 1.5)
    assert s.lane.long_wait_share([], [prompt], clock.t) == pytest.approx(1.5 / 6.0)  # twice its 3 s prefill
    prompt.num_cached_tokens = 500  # half of it from the prefix cache: 500 tokens at context 500 to compute
    alone = PER_TOKEN * 500 + PER_PAIR * attention_pairs(500, 500)
    assert alone == pytest.approx(1.5)
    assert s.lane.long_wait_share([], [prompt], clock.t) == pytest.approx(1.5 / (2 * alone))
    prompt.first_token_time = clock.t - 1.0  # preempted after its first token, recomputing: no deadline
    assert s.lane.long_wait_share([], [prompt], clock.t) == 0.0


def a_late_long_prompt_behind_a_running_one(**limits):
    """One long prompt part-way through its prefill, just arrived; another that has waited
    a minute, past any deadline, in the queue."""
    clock = Clock()
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, **limits)
    teach(s.cost)
    running = create_request(prompt=4000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(running)
    run_step(s)
    assert s.running == [running] and 0 < running.num_computed_tokens < 4000
    late = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t - 60.0)
    s.add_request(late)
    return s, late, clock.t


@pytest.mark.parametrize("limits", [{"long_max_running": 1}, {"long_kv_share": 0.6}])
def test_a_long_prompt_the_lane_holds_back_has_no_say_in_the_running_ones_share(limits):
    # The late prompt cannot start (the lane's seat cap, or its share of the cache: 1,000
    # blocks held and 250 more needed, over 0.6 of 2,000), so it gets no chunk: its wait
    # must not loosen the running prompt's time-per-token budget.
    s, late, now = a_late_long_prompt_behind_a_running_one(**limits)
    assert not s.lane.admits(late, s.running)
    assert s.lane.long_wait_share(s.running, s.waiting, now) == 0.0
    # Where the lane would admit it, its wait counts: the whole share.
    s, late, now = a_late_long_prompt_behind_a_running_one(long_max_running=None, long_kv_share=1.0)
    assert s.lane.admits(late, s.running)
    assert s.lane.long_wait_share(s.running, s.waiting, now) == 1.0


def test_with_no_time_per_token_stretch_long_prefill_still_moves_by_the_floor():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, short_tpot_stretch=0.0
    )
    teach(s.cost)
    long = create_request(prompt=4000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(long)
    alone = quiet_chunks(0.15, 1024, 4000, 512)
    assert chunks(s, long.request_id, len(alone)) == alone
    s.add_request(create_request(prompt=10, size_class="short", max_tokens=50, arrival=clock.t))
    assert chunks(s, long.request_id, 9) == [0, 0, 0, 0, 16, 0, 0, 0, 16]


def test_a_second_long_chunk_in_a_step_gets_only_what_the_first_left():
    # Long A has 10 prompt tokens left at context 9,912 (12 ms a token there), long B a
    # prompt at 0 (2 ms a token). A short one decodes, with a budget of 5 x its ~12 ms
    # step (the TTFT-derived allowance, 0.5 s, never binds). A's 10 tokens cost 120 ms:
    # it sits out one step, saving 60 ms, and takes them in the next, leaving ~0 for B,
    # which sits out too (the saved seconds are spent once, not once a chunk).
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=500,
        num_blocks=6000,
        clock=clock,
        short_ttft_target_s=2.0,
        short_tpot_stretch=5.0,
    )
    teach(s.cost)
    alone = quiet_chunks(2.0, 9_900, 20_000, 500)  # nobody to protect
    assert sum(alone) == 9_912
    a = create_request(prompt=sum(alone) + 10, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(a)
    assert chunks(s, a.request_id, len(alone)) == alone
    short = create_request(prompt=10, size_class="short", max_tokens=50, arrival=clock.t)
    b = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(short)
    s.add_request(b)
    steps = [scheduled(run_step(s)[0]) for _ in range(3)]
    assert steps[0] == {short.request_id: 10}  # a step that starts a short one: no chunk
    assert steps[1] == {short.request_id: 1}  # A sits out: 60 ms covers 5 of its 10 tokens
    assert steps[2] == {short.request_id: 1, a.request_id: 10}  # and B gets nothing


def test_a_deep_chunk_that_sits_out_holds_the_turn_against_a_shallow_one():
    # Long A is at context 3,072, where the allowance covers 7 tokens; long B, behind it in
    # policy order, starts at 0, where it covers 18. Were B's chunks to run while A sits
    # out, A's turn would never come; A holds it, B waits until A's prompt is in.
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=4000, clock=clock, short_tpot_stretch=NO_TPOT_BOUND
    )
    teach(s.cost)
    deep = create_request(prompt=4000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(deep)
    alone = quiet_chunks(0.15, 3072, 4000, 512)
    assert chunks(s, deep.request_id, len(alone)) == alone
    clock.t += 1.0
    shallow = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t)
    short = create_request(prompt=10, size_class="short", max_tokens=200, arrival=clock.t)
    s.add_request(shallow)
    s.add_request(short)
    assert s.lane.admits(shallow, s.running)
    assert largest_chunk(0.0375, 3072, 512) == 7 and largest_chunk(0.0375, 0, 512) == 18
    context = deep.num_computed_tokens
    sizes = [scheduled(run_step(s)[0]) for _ in range(10)]
    # The step that starts the short one carries no chunk; then A sits out twice and spends
    # the three steps' allowance, 0.1125 s, each turn.
    expected = [0] * 10
    for step in (3, 6, 9):
        expected[step] = largest_chunk(3 * 0.0375, context, 512)
        context += expected[step]
    assert [step.get(deep.request_id, 0) for step in sizes] == expected
    assert sum(alone) == 3072 and expected == [0, 0, 0, 22, 0, 0, 21, 0, 0, 21]
    assert all(shallow.request_id not in step for step in sizes)
    assert all(short.request_id in step for step in sizes)


def test_without_a_learned_cost_long_chunks_start_small():
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000)
    long = create_request(prompt=100, size_class="long", max_tokens=2)
    short = create_request(prompt=10, size_class="short", max_tokens=50)
    s.add_request(long)
    s.add_request(short)
    run_step(s)
    assert chunks(s, long.request_id, 2) == [UNTRAINED_LONG_CHUNK, UNTRAINED_LONG_CHUNK]


def test_the_tightest_loop_cannot_starve_a_long_prefill():
    # The loop has tightened the lane as far as it goes, and a new short request arrives
    # at every other step (a step that starts one gives the long one nothing until its
    # deadline: 6 s, twice its scripted 3 s prefill). The long one's share still grows
    # with its wait, whole from its deadline on.
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=64,
        max_num_batched_tokens=512,
        num_blocks=4000,
        clock=clock,
        short_ttft_target_s=0.5,
        long_ttft_target_s=10.0,
        short_tpot_stretch=NO_TPOT_BOUND,
    )
    teach(s.cost)
    s.lane.factor = TIGHTEST
    long = create_request(prompt=1000, size_class="long", max_tokens=2, arrival=clock.t)
    s.add_request(long)
    sizes = []
    for step in range(80):
        if step % 2 == 0:
            s.add_request(create_request(prompt=10, size_class="short", max_tokens=30, arrival=clock.t))
        sizes.append(chunks(s, long.request_id, 1)[0])
        clock.t += 0.5
        if long.num_computed_tokens >= 1000:
            break
    # From the second step on shorter requests decode, so a chunk the allowance cannot
    # cover at MIN_LONG_CHUNK sits out, carrying the allowance over, at most
    # long_prefill_max_skip (3) steps in a row; a step that starts a short one and allows
    # nothing leaves the turn as it was.
    context, expected, saved, skips = 0, [], 0.0, 0
    for step in range(len(sizes)):
        floor = min(1.0, 0.5 * step / 6.0)
        starts_short = step % 2 == 0
        share = (1.0 if floor >= 1.0 else 0.0) if starts_short else max(TIGHTEST, floor)
        limit = min(1000 - context, 512 - 10 - step // 2 if starts_short else 512 - (step + 1) // 2)
        allowance = 0.125 * share
        turns = allowance > 0 and step >= 1
        left = allowance + saved if turns else allowance
        n = 0
        if left > 0:
            n = largest_chunk(left, context, limit)
            if n < min(limit, MIN_LONG_CHUNK):
                n = min(limit, MIN_LONG_CHUNK) if not turns or skips >= 3 else 0
        if n > 0:
            skips, saved = 0, 0.0
        elif left > 0:
            skips, saved = skips + 1, left
        expected.append(n)
        context += n
    assert sizes == expected
    # Nothing beside the first short; at TIGHTEST the chunk sits out a turn, then spends
    # what it saved on more than MIN_LONG_CHUNK tokens.
    assert sizes[:3] == [0, 0, 0] and sizes[3] > MIN_LONG_CHUNK
    assert long.num_computed_tokens == 1000 and len(sizes) < 60


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)}


def test_a_step_that_starts_a_shorter_request_leaves_long_decodes_out_never_twice_running():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=2000, clock=clock, long_decode_max_skip=1
    )
    long = create_request(prompt=8, size_class="long", max_tokens=100, arrival=clock.t)
    medium = create_request(prompt=20, size_class="medium", max_tokens=100, arrival=clock.t)
    s.add_request(long)
    assert scheduled(run_step(s)[0]) == {long.request_id: 8}
    s.add_request(medium)
    # The step that starts the medium request: the long decode sits out.
    assert scheduled(run_step(s)[0]) == {medium.request_id: 20}
    assert scheduled(run_step(s)[0]) == {long.request_id: 1, medium.request_id: 1}  # plain decodes

    first = create_request(prompt=10, size_class="short", max_tokens=50, arrival=clock.t)
    s.add_request(first)
    # The step that starts `first`: the medium decode runs, the long one sits out.
    assert scheduled(run_step(s)[0]) == {medium.request_id: 1, first.request_id: 10}
    second = create_request(prompt=10, size_class="short", max_tokens=50, arrival=clock.t)
    s.add_request(second)
    # Another short starts at once, but the long decode sat out the step before: it runs.
    assert scheduled(run_step(s)[0]) == {
        long.request_id: 1,
        medium.request_id: 1,
        first.request_id: 1,
        second.request_id: 10,
    }
    third = create_request(prompt=10, size_class="short", max_tokens=50, arrival=clock.t)
    s.add_request(third)
    assert long.request_id not in scheduled(run_step(s)[0])
    # Nothing shorter waiting: every decode runs.
    assert scheduled(run_step(s)[0]) == {r.request_id: 1 for r in (long, medium, first, second, third)}
    assert long.num_output_tokens == 4 and medium.num_output_tokens == 6


def test_long_decodes_run_where_the_short_cannot_start_or_the_lane_is_off():
    # No seat for the short; the lane off; no room in the cache for it (9 blocks of 4: the
    # long request holds 3 and the medium one 6 once both decode, and the short needs 3).
    for seats, blocks, lane in ((2, 2000, True), (8, 2000, False), (8, 9, True)):
        s = create_scheduler(max_num_seqs=seats, max_num_batched_tokens=512, num_blocks=blocks, long_lane=lane)
        long = create_request(prompt=8, size_class="long", max_tokens=100)
        medium = create_request(prompt=20, size_class="medium", max_tokens=100)
        s.add_request(long)
        run_step(s)
        s.add_request(medium)
        # The medium one has a seat and room in every case; with the lane on, the long
        # decode sits out the step that starts it.
        starts_medium = {medium.request_id: 20} if lane else {long.request_id: 1, medium.request_id: 20}
        assert scheduled(run_step(s)[0]) == starts_medium
        run_step(s)
        short = create_request(prompt=10, size_class="short", max_tokens=50)
        s.add_request(short)
        out = scheduled(run_step(s)[0])
        assert long.request_id in out and medium.request_id in out
        assert (short.request_id in out) == (not lane)  # only the lane-off case had seat and room


def test_a_long_decode_does_not_sit_out_for_a_short_that_would_take_its_next_block():
    # 9 blocks of 4. The long request holds 2 and its next decode needs a third; the short
    # one needs 7, all that is free. Were the long decode to sit out, the short would take
    # them and the long one would be preempted a step later. It decodes, and the short waits.
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=9)
    long = create_request(prompt=8, size_class="long", max_tokens=100)
    s.add_request(long)
    run_step(s)
    short = create_request(prompt=28, size_class="short", max_tokens=50)
    s.add_request(short)
    out, _ = run_step(s)
    assert scheduled(out) == {long.request_id: 1} and out.preempted == []
    assert short in s.waiting and long.num_preemptions == 0


def test_a_long_decode_does_not_sit_out_for_a_short_queued_behind_one_that_cannot_start():
    # The medium request arrived first and needs 10 of the 10 free blocks (the long decode
    # will want one): admission stops at it, so the short behind it does not start either.
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=12)
    long = create_request(prompt=8, size_class="long", max_tokens=100, arrival=0.0)
    s.add_request(long)
    run_step(s)
    medium = create_request(prompt=40, size_class="medium", max_tokens=50, arrival=1.0)
    short = create_request(prompt=4, size_class="short", max_tokens=50, arrival=2.0)
    s.add_request(medium)
    s.add_request(short)
    for _ in range(3):
        assert scheduled(run_step(s)[0]) == {long.request_id: 1}


def test_the_head_of_line_loop_tightens_the_scheduler_and_relaxes_it():
    clock = Clock()
    s = create_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        num_blocks=2000,
        clock=clock,
        short_ttft_target_s=0.5,
        short_tpot_stretch=NO_TPOT_BOUND,
    )
    teach(s.cost)

    def set_factor(factor: float) -> None:
        s.lane.factor = factor

    feedback = HolFeedback(set_factor)
    coupled, clear = (True, 3.0, 0.8), (False, 0.4, 0.8)  # (coupled, short p99 TTFT, long share)
    actions = [feedback.update(*signal) for signal in [coupled] * 5 + [clear] * 5]
    assert actions == ["tighten"] * 4 + [None] + ["relax"] * 4 + [None]
    assert feedback.actions == {"tighten": 4, "relax": 4} and s.lane.factor == 1.0

    long = create_request(prompt=1500, size_class="long", max_tokens=2, arrival=clock.t)
    short = create_request(prompt=10, size_class="short", max_tokens=500, arrival=clock.t)
    s.add_request(long)
    s.add_request(short)
    run_step(s)
    context = long.num_computed_tokens
    assert chunks(s, long.request_id, 1) == [largest_chunk(0.125, context, 511)]
    feedback.update(*coupled)
    feedback.update(*coupled)
    assert s.lane.factor == 0.25
    context = long.num_computed_tokens
    # A quarter of the allowance covers fewer than MIN_LONG_CHUNK tokens here, and the short
    # one decodes: the chunk sits a step out and takes two steps' allowance in the next.
    assert largest_chunk(0.125 * 0.25, context, 511) < MIN_LONG_CHUNK
    assert chunks(s, long.request_id, 2) == [0, largest_chunk(2 * 0.125 * 0.25, context, 511)]
    for _ in range(10):
        feedback.update(*coupled)
    assert s.lane.factor == TIGHTEST


def test_the_loop_does_nothing_when_the_long_lane_is_off():
    calls = []
    feedback = HolFeedback(calls.append, enabled=False)
    assert feedback.update(True, 3.0, 0.9) is None and calls == []


def test_long_lane_off_means_no_long_limits():
    s = create_scheduler(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=2000, long_lane=False)
    long = create_request(prompt=100, size_class="long", max_tokens=2)
    short = create_request(prompt=10, size_class="short", max_tokens=50)
    s.add_request(long)
    s.add_request(short)
    assert chunks(s, long.request_id, 1) == [64]


def test_observability_config_is_untouched_by_the_loop():
    # The loop's one lever is the long lane's factor: were it to move the coupling
    # threshold instead, coupling would clear without the short class getting faster.
    config = ObservabilityConfig()
    before = dataclasses.asdict(config)
    clock = Clock()
    monitor = HolMonitor(config, LatencyWindows(now=clock))
    factors = []
    feedback = HolFeedback(factors.append)
    for _ in range(100):
        monitor.windows.observe("short", clock.t, 3.0, 4.0)  # a p99 TTFT over the 2 s threshold
    coupled, actions = [], []
    for interval in range(1, 7):  # as Observability.refresh: long sequences take all the engine's time
        busy = 10.0 * interval
        state = monitor.update(
            EngineSnapshot(clock.t, busy, interval, 100, 0, ()),
            EngineStats(step_time_s=busy, device_time_by_class=Counter(long=busy)),
        )
        coupled.append(state.coupled)
        actions.append(feedback.update(state.coupled, state.short_ttft_p99_s, state.long_device_share))
    assert coupled == [True] * 6 and actions == ["tighten"] * 4 + [None] * 2
    assert factors == [0.5, 0.25, 0.125, TIGHTEST]
    assert monitor.config is config
    assert dataclasses.asdict(config) == before == dataclasses.asdict(ObservabilityConfig())


def test_untrained_long_chunks_are_big_enough_to_teach_the_cost_model():
    # With no short prefill to learn from, the long chunks themselves must teach it,
    # or the lane would stay at the untrained size for the whole prompt.
    model = StepCostModel()
    for _ in range(2):
        model.observe(UNTRAINED_LONG_CHUNK + 1, attention_pairs(UNTRAINED_LONG_CHUNK, 100), 0.1)
    assert model.ready
