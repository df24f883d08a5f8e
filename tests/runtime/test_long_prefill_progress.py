"""A long prefill on a real engine whose first chunks ran slow (a cold start on a busy
host) still finishes at a rate the policy guarantees: the step-cost model forgets those
steps instead of locking in their price, and a long chunk never takes fewer than
MIN_LONG_CHUNK tokens when it takes any, nor sits out more than long_prefill_max_skip
steps in a row (while shorter requests decode, a chunk its allowance cannot cover takes
turns)."""

from __future__ import annotations

import math
import random
import time

from headroom.config import Config
from headroom.contracts.request import AdmissionRecord, SamplingParams, SizeClass
from headroom.runtime.engine import Engine
from headroom.runtime.lane import MIN_LONG_CHUNK
from tests.steps import before_each_step

PROMPT = 1500
SLOW_STEPS = 2
SLOW_S = 1.0  # what each of the first long chunks is made to take
SHORT_EVERY = 4  # steps between short arrivals
PRICED_CHUNK = 256


def test_a_long_prefill_finishes_within_its_stated_steps_after_slow_first_chunks(default_model):
    engine = Engine(Config(), loaded=default_model)
    assert engine.scheduler.cost.ready, "the engine times a few steps at start-up"
    rng = random.Random(7)
    long = engine.new_request(
        [rng.randrange(300, 20000) for _ in range(PROMPT)], SamplingParams(max_tokens=2, ignore_eos=True)
    )
    long.admission = AdmissionRecord(size_class=SizeClass.LONG)
    slow = []
    price = engine.scheduler.cost.chunk_seconds(PRICED_CHUNK, 0)

    def slow_first_long_chunks(out) -> None:
        carries_chunk = any(r is long and n > 1 for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True))
        if carries_chunk and len(slow) < SLOW_STEPS:
            slow.append(out)
            time.sleep(SLOW_S)

    with before_each_step(engine, slow_first_long_chunks):
        engine.submit(long, lambda _: None)
        shorts = []
        # Each step either starts a short request (a step that does carries no long chunk
        # before the long one has waited long_ttft_target_s), or gives the long request a chunk
        # of at least MIN_LONG_CHUNK tokens, or is one of at most long_prefill_max_skip in a
        # row it sits out. So its prompt is in within this many steps:
        turn = 1 + engine.config.scheduler.long_prefill_max_skip
        steps = 0
        while long.num_computed_tokens < PROMPT:
            bound = turn * math.ceil(PROMPT / MIN_LONG_CHUNK) + len(shorts)
            assert steps <= bound, (
                f"{long.num_computed_tokens} of {PROMPT} prompt tokens after {steps} steps (bound {bound}); "
                f"step cost {engine.scheduler.cost.cost()}"
            )
            if steps % SHORT_EVERY == 0:
                short = engine.new_request(
                    [rng.randrange(300, 20000) for _ in range(20)], SamplingParams(max_tokens=8, ignore_eos=True)
                )
                short.admission = AdmissionRecord(size_class=SizeClass.SHORT)
                engine.submit(short, lambda _: None)
                shorts.append(short)
            engine.step()
            steps += 1
        assert len(slow) == SLOW_STEPS
        # The slow steps' price is forgotten: a chunk costs again about what it cost before them.
        after = engine.scheduler.cost.chunk_seconds(PRICED_CHUNK, 0)
        assert after < 2 * price, f"a {PRICED_CHUNK}-token chunk priced {price:.3f} s before, {after:.3f} s after"
        assert all(s.first_scheduled_time is not None for s in shorts)  # the shorts were not held back either
        while engine.scheduler.has_work():
            engine.step()
        assert long.num_output_tokens == 2 and all(s.num_output_tokens == 8 for s in shorts)
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
