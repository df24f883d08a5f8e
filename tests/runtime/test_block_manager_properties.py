"""Property test: BlockManager + Scheduler under random add / abort / step / finish."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headroom.contracts.request import RequestStatus
from tests.runtime.factories import EOS, create_request, create_scheduler, run_step

SHARED_PREFIX = list(range(500, 516))

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 20),  # prompt tokens
            st.integers(1, 12),  # max_tokens
            st.integers(0, 3),  # priority
            st.booleans(),  # shares a prefix with others
        ),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.sampled_from([7, 7, 7, EOS])),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(9, 24),
    block_size=st.sampled_from([2, 4, 8]),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_no_block_leaked_or_double_owned(ops, num_blocks, block_size, chunked, caching):
    s = create_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
    )
    bm = s.block_manager
    live = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, priority, shared = op
            prompt = (SHARED_PREFIX[:n] if shared else None) or n
            request = create_request(prompt=prompt, max_tokens=max_tokens, priority=priority)
            if bm.blocks_needed(request.num_prompt_tokens + max_tokens) <= num_blocks:
                s.add_request(request)
                live.append(request)
        elif op[0] == "abort" and live:
            victim = live[op[1] % len(live)]
            s.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
        elif op[0] == "step":
            run_step(s, token=op[1])
            # Every scheduled request holds exactly the blocks its tokens need.
            for r in s.running:
                assert len(bm.block_table(r.request_id)) == bm.blocks_needed(r.num_computed_tokens)
        bm.check_invariants()
        for r in live:
            if r.is_finished:
                assert r.request_id not in bm.tables
    # Drain: everything finishes on its own (no deadlock), then no block is held.
    for _ in range(500):
        if not s.has_work():
            break
        run_step(s)
        bm.check_invariants()
    assert not s.has_work()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks and not bm.tables
    assert all(b.ref_count == 0 for b in bm.blocks)
    for r in live:
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert 1 <= r.num_output_tokens <= r.max_tokens
