"""What a step costs and who it is charged to, and the engine's state as the snapshot
dataclasses of outputs.py. The engine calls all of these under its state lock; none of
them takes it."""

from __future__ import annotations

import time
from collections import Counter, deque

from headroom.config import SchedulerConfig
from headroom.contracts.request import Request
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.model_runner import StepTimer
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.outputs import EngineSnapshot, EngineStats, LongLaneState, SequenceSnapshot
from headroom.runtime.probe import ProbeRefiner
from headroom.runtime.scheduler import Scheduler
from headroom.runtime.step_cost import StepCostModel


def step_weights(out: SchedulerOutput) -> list[float]:
    """What each request of a step is charged of it, relatively: its tokens, a row under a
    LoRA adapter weighted by 1 + the adapter's arithmetic beside the base's."""
    return [
        n * (1 + (r.lora.cost if r.lora is not None else 0.0))
        for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
    ]


class StepAccounting:
    """Charges each completed step to the engine's counters, to the step-cost model the
    long lane sizes chunks with, and to the requests that ran in it, by their tokens."""

    def __init__(self, cost: StepCostModel) -> None:
        self.cost = cost
        self._timers: deque[StepTimer] = deque()  # forward passes whose device time is not yet read

    def step_done(
        self,
        stats: EngineStats,
        out: SchedulerOutput,
        held: list[int],
        elapsed: float,
        timer: StepTimer,
        learn: bool = True,
    ) -> None:
        """`held`: the blocks each request of `out` held for the step; learn: whether the
        step-cost model learns from it."""
        total = out.total_tokens
        stats.steps += 1
        stats.step_time_s += elapsed
        if learn:
            self.cost.observe(total, out.attention_pairs, elapsed - out.draft_s, out.decode_pairs)
        # Read without waiting: a step that sampled nothing may still be on the device.
        self._timers.append(timer)
        while self._timers and self._timers[0].ready():
            stats.forward_time_s += self._timers.popleft().elapsed_s()
        weights = step_weights(out)
        total_weight = sum(weights)
        for request, n, weight, blocks in zip(out.requests, out.num_scheduled_tokens, weights, held, strict=True):
            used = request.resources
            if used.num_processed_tokens == 0:
                stats.requests_started += 1
                stats.prefix_cache_queries += request.num_prompt_tokens
                stats.prefix_cache_hits += request.num_cached_tokens
            used.num_blocks_held = blocks
            used.peak_blocks = max(used.peak_blocks, blocks)
            share = elapsed * weight / total_weight
            used.device_time_s += share
            stats.device_time_by_class[request.size_class or "none"] += share
            used.kv_block_seconds += blocks * elapsed
            used.num_processed_tokens += n


def sequence_snapshot(
    request: Request, now: float, busy_s: float, block_manager: BlockManager, in_step_s: float = 0.0
) -> SequenceSnapshot:
    return SequenceSnapshot.of(
        request, now, busy_s, len(block_manager.block_table(request.request_id)), block_manager.num_blocks, in_step_s
    )


def engine_snapshot(
    stats: EngineStats,
    scheduler: Scheduler,
    block_manager: BlockManager,
    running_step: tuple[SchedulerOutput, float] | None,
    now: float,
) -> EngineSnapshot:
    """`running_step`: the step whose model call is under way and its perf_counter start."""
    # The step running now counts as far as it has got, shared by its tokens as
    # it will be when it completes: a sequence's cost shows from its first step.
    in_step: dict[str, float] = {}
    busy = stats.step_time_s
    if running_step is not None:
        out, started = running_step
        elapsed = time.perf_counter() - started
        busy += elapsed
        weights = step_weights(out)
        total = sum(weights)
        for request, weight in zip(out.requests, weights, strict=True):
            in_step[request.request_id] = elapsed * weight / total
    sequences = tuple(
        sequence_snapshot(r, now, busy, block_manager, in_step.get(r.request_id, 0.0))
        for r in scheduler.requests.values()
    )
    return EngineSnapshot(now, busy, stats.steps, block_manager.num_blocks, block_manager.num_used_blocks, sequences)


def engine_counters(stats: EngineStats, scheduler: Scheduler, refiner: ProbeRefiner | None) -> EngineStats:
    """A copy of the counters, with those the scheduler's policy and the refiner keep, and
    the batch's and the pool's gauges."""
    copy = stats.copy()
    copy.num_running, copy.num_waiting = scheduler.num_running, scheduler.num_waiting
    copy.kv_blocks_used = scheduler.block_manager.num_used_blocks
    copy.kv_blocks_total = scheduler.block_manager.num_blocks
    copy.probe_decisions = Counter(scheduler.policy.probe_decisions)
    copy.probe_estimates = refiner.estimates if refiner is not None else 0
    return copy


def long_lane_state(config: SchedulerConfig, scheduler: Scheduler, now: float) -> LongLaneState:
    lane = scheduler.lane
    allowance = lane.allowance(scheduler.running, scheduler.waiting, now)
    # The chunk a long prompt would get under this step's allowance (with no long prompt: with
    # shorter requests running and none waiting); while they decode, a chunk under
    # MIN_LONG_CHUNK takes turns instead, at MIN_LONG_CHUNK or more.
    sized = allowance if allowance is not None else config.short_ttft_target_s / 4 * lane.factor
    return LongLaneState(
        enabled=config.long_lane,
        factor=lane.factor,
        short_ttft_target_s=config.short_ttft_target_s,
        allowance_s=allowance,
        step_cost=lane.cost.cost(),
        steps_observed=lane.cost.num_steps,
        chunk_tokens={
            context: lane.chunk_tokens(context, sized, config.max_num_batched_tokens) for context in (0, 1024, 4096)
        },
    )
