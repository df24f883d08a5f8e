"""Scheduling policy: tier priority, predicted-short-first with ageing, long lane, victims.
Predictions stay under max_tokens, as admission's do: the estimate is capped by it."""

from __future__ import annotations

import dataclasses
import time

from headroom.contracts.request import Estimate, RequestStatus
from tests.runtime.factories import create_request, create_scheduler, run_step


def test_predicted_short_first_within_a_priority():
    s = create_scheduler(max_num_seqs=1)
    now = time.monotonic()
    long = create_request(predicted=400, max_tokens=500, arrival=now)
    short = create_request(predicted=20, max_tokens=500, arrival=now)
    s.add_request(long)
    s.add_request(short)
    out, _ = run_step(s)
    assert out.requests == [short]


def test_priority_beats_prediction():
    s = create_scheduler(max_num_seqs=1)
    now = time.monotonic()
    urgent_long = create_request(predicted=400, max_tokens=500, priority=2, arrival=now)
    short = create_request(predicted=20, max_tokens=500, priority=1, arrival=now)
    s.add_request(short)
    s.add_request(urgent_long)
    out, _ = run_step(s)
    assert out.requests == [urgent_long]


def test_ageing_lets_an_old_long_request_overtake():
    # rank = predicted - 50 tok/s * waited: 400 - 50*10 = -100 beats 20 - 0 = 20.
    s = create_scheduler(max_num_seqs=1, ageing_tokens_per_s=50.0)
    now = time.monotonic()
    old_long = create_request(predicted=400, max_tokens=500, arrival=now - 10)
    fresh_short = create_request(predicted=20, max_tokens=500, arrival=now)
    s.add_request(fresh_short)
    s.add_request(old_long)
    out, _ = run_step(s)
    assert out.requests == [old_long]


def test_without_predictions_order_is_fcfs():
    s = create_scheduler(max_num_seqs=1)
    first, second = create_request(), create_request()
    s.add_request(second)  # submitted first, but arrived later
    s.add_request(first)
    out, _ = run_step(s)
    assert out.requests == [first]


def due(request, seconds_from_now: float):
    request.admission = dataclasses.replace(request.admission, first_token_due=time.monotonic() + seconds_from_now)
    return request


def test_a_ttft_objective_goes_first_within_its_tier_earliest_due_first():
    """The gateway's x-llm-d-slo-ttft-ms: requests with a first token due go first within
    their tier, earliest due first; the others keep predicted-short-first among themselves;
    a higher tier still goes before any of them; once a request's first token is out, its
    due time no longer counts."""
    s = create_scheduler(max_num_seqs=1)
    now = time.monotonic()
    short = create_request(predicted=5, max_tokens=500, arrival=now - 30)
    later = due(create_request(predicted=400, max_tokens=500, arrival=now), 2.0)
    sooner = due(create_request(predicted=400, max_tokens=500, arrival=now), 0.5)
    above = create_request(predicted=400, max_tokens=500, priority=1, arrival=now)
    for r in (short, later, sooner, above):
        s.add_request(r)
    order = sorted(s.waiting, key=lambda r: s.policy.order_key(r, now))
    assert order == [above, sooner, later, short]
    sooner.first_token_time = now
    assert sorted(s.waiting, key=lambda r: s.policy.order_key(r, now)) == [above, later, short, sooner]
    sooner.first_token_time = None
    out, _ = run_step(s)
    assert out.requests == [above]
    s.finish_request(above.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(s)
    assert out.requests == [sooner]  # the step takes it before the shorter, older request too


def test_long_lane_concurrency_cap():
    s = create_scheduler(max_num_seqs=4, long_max_running=1)
    a, b = create_request(size_class="long"), create_request(size_class="long")
    c = create_request(size_class="short")
    for r in (a, b, c):
        s.add_request(r)
    out, _ = run_step(s)
    assert out.requests == [a, c] and b.status == RequestStatus.WAITING


def test_long_lane_kv_share():
    # 10 blocks of 4 tokens; long requests may hold at most 50% = 5 blocks.
    s = create_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, long_kv_share=0.5, enable_prefix_caching=False)
    a = create_request(prompt=12, size_class="long")  # 3 blocks
    b = create_request(prompt=12, size_class="long")  # 3 more would make 6 > 5
    c = create_request(prompt=12, size_class="medium")
    for r in (a, b, c):
        s.add_request(r)
    out, _ = run_step(s)
    assert out.requests == [a, c]


def three_prefilled():
    """Three requests predicted 10, 300 and 50 tokens, after their prefill step; the next
    step's decodes need one block more than the pool has, so one is preempted."""
    s = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    requests = [create_request(prompt=8, max_tokens=600, priority=1, predicted=p) for p in (10, 300, 50)]
    for r in requests:
        s.add_request(r)
    run_step(s)
    return s, requests


def test_victim_is_lowest_tier_then_longest_predicted_remaining():
    s, (_, b, _) = three_prefilled()
    out, _ = run_step(s)
    assert out.preempted[0] is b


def test_the_probe_estimate_reorders_the_waiting_queue_and_counts_it():
    s = create_scheduler(max_num_seqs=1)
    now = time.monotonic()
    first = create_request(predicted=20, max_tokens=500, arrival=now)
    second = create_request(predicted=30, max_tokens=500, arrival=now)
    s.add_request(first)
    s.add_request(second)
    assert [r.request_id for r in sorted(s.waiting, key=lambda r: s.policy.order_key(r, now))] == [
        first.request_id,
        second.request_id,
    ]
    # The probe has seen `first` run (a preempted request keeps its estimate): 400 to go.
    first.estimate = Estimate(400.0, 0)
    out, _ = run_step(s)
    assert out.requests == [second]
    assert s.policy.probe_decisions == {"order": 1}


def test_the_reordered_admission_counts_when_it_preempts_a_lower_tier():
    s = create_scheduler(max_num_seqs=2, num_blocks=3, block_size=4, enable_prefix_caching=False)
    low = create_request(prompt=11, max_tokens=500, priority=0)  # all 3 blocks; its next decode fits
    s.add_request(low)
    run_step(s)
    now = time.monotonic()
    first = create_request(predicted=20, max_tokens=500, priority=1, arrival=now)
    second = create_request(predicted=30, max_tokens=500, priority=1, arrival=now)
    s.add_request(first)
    s.add_request(second)
    first.estimate = Estimate(400.0, 0)
    out, _ = run_step(s)
    assert out.requests == [second] and out.preempted == [low]
    assert s.policy.probe_decisions == {"order": 1}


def test_the_probe_estimate_counts_down_as_tokens_come():
    request = create_request(predicted=100, max_tokens=200)
    assert request.estimated_remaining_tokens() == 100.0
    request.output_token_ids.extend([5] * 10)
    assert request.estimated_remaining_tokens() == 90.0
    request.estimate = Estimate(25.0, 8)
    assert request.estimated_remaining_tokens() == 23.0  # 2 tokens since the estimate
    assert request.estimated_remaining_tokens(probed=False) == 90.0
    # An operator's cap bounds both: 15 tokens are all that can still come.
    request.max_tokens_cap = 25
    assert request.estimated_remaining_tokens() == 15.0
    assert request.estimated_remaining_tokens(probed=False) == 15.0


def test_the_probe_estimate_changes_the_victim_and_counts_it():
    s, (a, b, _) = three_prefilled()
    # Once probed, b turns out nearly done and a is the one with most to go.
    b.estimate = Estimate(2.0, 1)
    a.estimate = Estimate(500.0, 1)
    out, _ = run_step(s)
    assert out.preempted[0] is a
    assert s.policy.probe_decisions == {"victim": 1}
