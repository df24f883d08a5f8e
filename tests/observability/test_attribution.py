"""The live cost snapshot, read from another thread while the engine runs: per-sequence
device time adds up to the engine's busy time and block counts to the pool's."""

from __future__ import annotations

import time

import pytest

from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.runtime.engine import Engine
from headroom.runtime.request import SamplingParams

pytestmark = pytest.mark.slow


def test_snapshot_adds_up_to_the_engine_and_the_block_manager(default_model):
    config = Config(cache=CacheConfig(num_blocks=128),
                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    engine = Engine(config, loaded=default_model)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # Distinct prompts of different lengths: no block is shared, prefills take 1-3 steps.
    requests = [engine.new_request([1000 + 97 * i + j for j in range(30 + 40 * i)], sampling) for i in range(4)]
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
    # Snapshots of all four running: every busy second so far went to one of them.
    full = [s for s in snapshots if len(s.sequences) == 4 and s.steps > 0]
    assert len(full) >= 5
    for snap in full:
        assert sum(s.device_time_s for s in snap.sequences) == pytest.approx(snap.busy_s, rel=1e-6)
        assert sum(s.device_share for s in snap.sequences) == pytest.approx(1.0, rel=1e-6)
        assert sum(s.blocks_held for s in snap.sequences) == snap.used_blocks
        for seq in snap.sequences:
            assert seq.kv_share == seq.blocks_held / 128
            assert seq.tokens_processed <= seq.prompt_tokens + seq.output_tokens
            assert seq.max_tokens == 40 and seq.status in ("waiting", "running")
    # Device time follows tokens: the longest prompt has used the most.
    last = full[-1]
    by_prompt = sorted(last.sequences, key=lambda s: s.prompt_tokens)
    assert by_prompt[-1].device_time_s > by_prompt[0].device_time_s
    # Finished, the pool is empty and the snapshot too.
    final = engine.snapshot()
    assert final.sequences == () and final.used_blocks == 0
    engine.block_manager.check_invariants()
