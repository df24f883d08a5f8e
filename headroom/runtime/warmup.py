"""What a step costs on this machine, timed before serving: a few real forward passes on
a scratch sequence seed the long lane's step-cost model (step_cost.py), so that the first
long prompt is sized from warm costs. Timed steps run after one untimed run of their shape,
which also warms what a first step pays once (kernel selection, first touches of memory)."""

from __future__ import annotations

import logging
import time

import torch

from headroom.contracts.request import Request, SamplingParams
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.model_runner import ModelRunner
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.step_cost import StepSample, attention_pairs

log = logging.getLogger(__name__)

SCRATCH_ID = "headroom-step-cost-scratch"
CHUNK = 64  # tokens in a timed prefill chunk
DEEP = 960  # the context a second chunk is timed at, where the cache has room for it
TIMED_RUNS = 1  # after one untimed run; the fastest counts


def time_step(runner: ModelRunner, block_manager: BlockManager, tokens: int, context: int) -> StepSample | None:
    """Time one step that gives a scratch request `tokens` tokens on top of `context`
    computed ones (their keys are whatever the cache holds: only the time matters).
    None where the cache has no room for it."""
    request = Request(SCRATCH_ID, [0] * (context + tokens), SamplingParams(max_tokens=1))
    if block_manager.allocate_slots(request, context + tokens) is None:
        return None
    try:
        request.num_computed_tokens = context
        pairs = attention_pairs(tokens, context)
        decode_pairs = pairs if tokens == 1 else 0
        out = SchedulerOutput(
            requests=[request],
            num_scheduled_tokens=[tokens],
            num_decodes=int(tokens == 1),
            attention_pairs=pairs,
            decode_pairs=decode_pairs,
        )
        times = []
        for _ in range(1 + TIMED_RUNS):
            started = time.perf_counter()
            runner.execute(out, block_manager, keep_hidden=False)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - started)
        return StepSample(tokens, pairs, min(times[1:]), decode_pairs)
    finally:
        block_manager.free_request(SCRATCH_ID)


def measure_step_cost(runner: ModelRunner, block_manager: BlockManager) -> list[StepSample]:
    """A decode, a chunk at the start of a context and (room allowing) one deep in it:
    three shapes that pin the step-cost model's three terms."""
    room = block_manager.num_free_blocks * block_manager.block_size // 2
    shapes = [(CHUNK, 0), (1, CHUNK)]
    if room >= 2 * CHUNK:
        shapes.append((CHUNK, min(DEEP, room - CHUNK)))
    samples = [time_step(runner, block_manager, tokens, context) for tokens, context in shapes]
    samples = [s for s in samples if s is not None]
    log.info(
        "step cost at start: %s",
        ", ".join(f"{s.num_tokens} tokens/{s.pairs} pairs {s.seconds * 1e3:.1f} ms" for s in samples),
    )
    return samples
