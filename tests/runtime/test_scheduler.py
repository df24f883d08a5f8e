from __future__ import annotations

import pytest

from headroom.config import REQUEST_PRIORITY_BOUND
from headroom.contracts.request import Priority, RequestStatus
from tests.runtime.factories import EOS, create_request, create_scheduler, run_step


def test_decodes_first_then_prefill_chunks_within_budget():
    s = create_scheduler(max_num_batched_tokens=16, block_size=4)
    a = create_request(prompt=6, max_tokens=10)
    s.add_request(a)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == [6] and a.num_output_tokens == 1
    b = create_request(prompt=40, max_tokens=2)
    s.add_request(b)
    out, _ = run_step(s)
    # a decodes (1 token) first; b gets the remaining 15 tokens of the budget.
    assert [r.request_id for r in out.requests] == [a.request_id, b.request_id]
    assert out.num_scheduled_tokens == [1, 15] and out.num_decodes == 1
    assert b.num_computed_tokens == 15 and b.num_output_tokens == 0
    run_step(s)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == [1, 10]  # 15 + 15 + 10 = 40: b's prefill completes
    assert b.num_output_tokens == 1
    s.block_manager.check_invariants()


def test_chunked_prefill_off_schedules_whole_prompts_only():
    s = create_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = create_request(prompt=10), create_request(prompt=10)
    s.add_request(a)
    s.add_request(b)
    out, _ = run_step(s)
    assert out.requests == [a] and out.num_scheduled_tokens == [10]
    out, _ = run_step(s)
    assert out.requests == [a, b] and out.num_scheduled_tokens == [1, 10]


def test_max_num_seqs_bounds_the_batch():
    s = create_scheduler(max_num_seqs=2)
    reqs = [create_request(prompt=4) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    out, _ = run_step(s)
    assert out.requests == reqs[:2] and s.num_waiting == 1


def test_priority_orders_admission():
    s = create_scheduler(max_num_seqs=1)
    low, high = create_request(priority=0), create_request(priority=5)
    s.add_request(low)
    s.add_request(high)
    out, _ = run_step(s)
    assert out.requests == [high]


def test_a_tier_always_outranks_a_requests_own_priority():
    """Standard-tier requests asking for the most urgent priority the API takes, a premium
    one asking for the least, and a deprioritised premium one: one seat, so the order in
    which they run is the order of their priorities, whatever they asked for."""
    standard_tier, premium_tier = 1, 2
    s = create_scheduler(max_num_seqs=1)
    urgent = [create_request(prompt=4, max_tokens=1) for _ in range(2)]
    for r in urgent:
        r.priority = Priority(tier=standard_tier, value=REQUEST_PRIORITY_BOUND)  # the API's -1000
    premium = create_request(prompt=4, max_tokens=1)
    premium.priority = Priority(tier=premium_tier, value=-REQUEST_PRIORITY_BOUND)  # the API's +1000
    demoted = create_request(prompt=4, max_tokens=1)
    demoted.priority = Priority(kept=0, tier=premium_tier, value=REQUEST_PRIORITY_BOUND)
    for r in (demoted, *urgent, premium):
        s.add_request(r)
    ran = []
    while s.has_work():
        out, _ = run_step(s)
        ran += [r for r in out.requests if r not in ran]
    assert ran == [premium, *urgent, demoted]
    s.block_manager.check_invariants()


def test_finish_on_eos_length_and_stop_token_frees_blocks():
    s = create_scheduler()
    eos = create_request(max_tokens=10)
    length = create_request(max_tokens=2)
    stop = create_request(max_tokens=10, stop_token_ids=(9,))
    for r in (eos, length, stop):
        s.add_request(r)
    run_step(s, token=5)
    out = s.schedule()
    tokens = {eos.request_id: EOS, length.request_id: 5, stop.request_id: 9}
    s.update_from_output(out, [tokens[r.request_id] for r in out.requests])
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert length.status == RequestStatus.FINISHED_LENGTH
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 9
    assert s.block_manager.num_used_blocks == 0 and not s.has_work()
    s.block_manager.check_invariants()


def test_ignore_eos_and_min_tokens_keep_going():
    s = create_scheduler()
    r = create_request(max_tokens=3, ignore_eos=True)
    m = create_request(max_tokens=3, min_tokens=2)
    s.add_request(r)
    s.add_request(m)
    run_step(s, token=EOS)
    assert not r.is_finished and not m.is_finished  # m has 1 < min_tokens outputs
    run_step(s, token=EOS)
    assert not r.is_finished and m.status == RequestStatus.FINISHED_STOPPED
    run_step(s, token=EOS)
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_preemption_picks_lowest_priority_then_newest_and_resumes():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens each need 2 blocks, then a third.
    s = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    old = create_request(prompt=8, max_tokens=8, priority=1)
    mid = create_request(prompt=8, max_tokens=8, priority=0)
    new = create_request(prompt=8, max_tokens=8, priority=1)
    for r in (old, mid, new):
        s.add_request(r)
    run_step(s)  # all prefilled: 6 blocks used, each has 9 tokens -> needs a 3rd block to decode
    assert s.block_manager.num_free_blocks == 0
    out, _ = run_step(s)
    assert out.preempted[0] is mid and mid.status == RequestStatus.PREEMPTED
    assert mid.num_computed_tokens == 0 and mid.num_preemptions == 1
    s.block_manager.check_invariants()
    for _ in range(40):
        if not s.has_work():
            break
        run_step(s)
        s.block_manager.check_invariants()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (old, mid, new))
    assert mid.num_output_tokens == 8 and s.block_manager.num_used_blocks == 0


def test_newest_preemption_order_ignores_priority():
    s = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False, preemption_order="newest")
    reqs = [create_request(prompt=8, max_tokens=8, priority=p) for p in (0, 5, 9)]
    for r in reqs:
        s.add_request(r)
    run_step(s)
    out, _ = run_step(s)
    assert out.preempted[0] is reqs[2]


def test_higher_priority_waiting_request_displaces_lower_priority_running():
    s = create_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    low = create_request(prompt=12, max_tokens=4, priority=0)
    s.add_request(low)
    run_step(s)
    urgent = create_request(prompt=8, max_tokens=4, priority=3)
    s.add_request(urgent)
    out, _ = run_step(s)
    assert low in out.preempted and urgent in out.requests
    equal = create_request(prompt=8, max_tokens=4, priority=3)
    s.add_request(equal)
    out, _ = run_step(s)
    assert equal not in out.requests and not out.preempted  # never displaces its equal


def test_prefix_cache_hit_skips_shared_blocks():
    s = create_scheduler(block_size=4)
    system = list(range(200, 212))  # 3 full blocks
    a = create_request(prompt=system + [1, 2, 3], max_tokens=5)
    s.add_request(a)
    run_step(s)
    b = create_request(prompt=system + [4, 5], max_tokens=2)
    s.add_request(b)
    out, _ = run_step(s)
    assert b.num_cached_tokens == 12 and out.num_scheduled_tokens[-1] == 2
    assert s.block_manager.block_table(b.request_id)[:3] == s.block_manager.block_table(a.request_id)[:3]
    s.block_manager.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_token():
    s = create_scheduler(block_size=4)
    prompt = list(range(300, 308))
    a = create_request(prompt=prompt, max_tokens=1)
    s.add_request(a)
    run_step(s)
    b = create_request(prompt=prompt, max_tokens=1)
    s.add_request(b)
    out, _ = run_step(s)
    assert b.num_cached_tokens == 4 and out.num_scheduled_tokens == [4]
    assert b.num_output_tokens == 1


def test_abort_waiting_and_running_frees_everything():
    s = create_scheduler(max_num_seqs=1)
    a, b = create_request(), create_request()
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    assert s.finish_request(b.request_id, RequestStatus.FINISHED_ABORTED) is b
    assert s.finish_request(a.request_id, RequestStatus.FINISHED_ABORTED) is a
    assert s.finish_request(a.request_id, RequestStatus.FINISHED_ABORTED) is None
    assert s.block_manager.num_used_blocks == 0 and not s.has_work()
    s.block_manager.check_invariants()


def test_duplicate_request_id_is_rejected():
    s = create_scheduler()
    r = create_request()
    s.add_request(r)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(r)
