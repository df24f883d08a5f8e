"""The live cost snapshot, read from another thread while the engine runs: each sequence's
device time is its token share of every step it was in, the step running included, and
block counts add up to the pool's."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow


def test_snapshot_adds_up_to_the_engine_and_the_block_manager(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    )
    engine = Engine(config, loaded=default_model)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # Distinct prompts of different lengths: no block is shared, prefills take 1-3 steps.
    requests = [engine.new_request([1000 + 97 * i + j for j in range(30 + 40 * i)], sampling) for i in range(4)]
    # The oracle's record, taken on the engine thread: each step's tokens per sequence and
    # the engine's busy seconds before it (so a step's time is the next one's less its own).
    steps: list[tuple[float, dict[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if not out.is_empty:
            steps.append(
                (
                    engine.stats.step_time_s,
                    {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)},
                )
            )
        return out

    engine.scheduler.schedule = recording_schedule
    engine.start()
    try:
        for request in requests:
            engine.submit(request, lambda _: None)
        snapshots = []
        deadline = time.monotonic() + 60
        while not all(r.is_finished for r in requests) and time.monotonic() < deadline:
            snapshots.append(engine.snapshot())
            time.sleep(0.01)
    finally:
        engine.stop()
    starts = [busy for busy, _ in steps] + [engine.stats.step_time_s]
    assert len(steps) == engine.stats.steps

    def token_shares(completed: int, busy: float) -> Counter[str]:
        """Each sequence's share of the first `completed` steps, and of the one running
        after them as far as `busy` has got."""
        shares = Counter()
        for k, (start, tokens) in enumerate(steps[: completed + 1]):
            elapsed = (starts[k + 1] if k < completed else busy) - start
            for rid, n in tokens.items():
                shares[rid] += elapsed * n / sum(tokens.values())
        return shares

    final = token_shares(len(steps), engine.stats.step_time_s)
    assert set(final) == {r.request_id for r in requests}
    for request in requests:
        assert request.resources.device_time_s == pytest.approx(final[request.request_id], rel=1e-9)
    # Snapshots of all four running: every busy second so far went to one of them, by tokens.
    full = [s for s in snapshots if len(s.sequences) == 4 and s.steps > 0]
    assert len(full) >= 5
    # A row processes its guesses (n-gram speculation is on by default), kept or not; those it
    # did not keep by the end are at least those it had not kept by any snapshot.
    dropped = {r.request_id: r.resources.num_draft_tokens - r.resources.num_accepted_tokens for r in requests}
    for snap in full:
        shares = token_shares(snap.steps, snap.busy_s)
        for seq in snap.sequences:
            assert seq.device_time_s == pytest.approx(shares[seq.request_id], rel=1e-9, abs=1e-12)
        assert sum(s.device_time_s for s in snap.sequences) == pytest.approx(snap.busy_s, rel=1e-6)
        assert sum(s.device_share for s in snap.sequences) == pytest.approx(1.0, rel=1e-6)
        assert sum(s.blocks_held for s in snap.sequences) == snap.used_blocks
        for seq in snap.sequences:
            assert seq.kv_share == seq.blocks_held / 128
            assert seq.tokens_processed <= seq.prompt_tokens + seq.output_tokens + dropped[seq.request_id]
            assert seq.max_tokens == 40 and seq.status in ("waiting", "running")
    # Device time follows tokens: the longest prompt has used the most.
    last = full[-1]
    by_prompt = sorted(last.sequences, key=lambda s: s.prompt_tokens)
    assert by_prompt[-1].device_time_s > by_prompt[0].device_time_s
    # Finished, the pool is empty and the snapshot too.
    final = engine.snapshot()
    assert final.sequences == () and final.used_blocks == 0
    engine.block_manager.check_invariants()
