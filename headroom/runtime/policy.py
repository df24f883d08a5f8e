"""Who goes first, who is preempted, and how much room long work gets: the scheduler's
policy, kept apart from its mechanics.

Order: tier priority first, then predicted-short-first with ageing (a request's rank
is its predicted output tokens minus ageing_tokens_per_s for every second it has
waited, so nothing starves). Without predictions every rank is just minus the wait,
which is FCFS. Victims: lowest priority, then the longest predicted remaining, then the
newest. Long-class requests run in a lane with its own concurrency and KV share; their
prefill pauses for a step whenever a shorter request waits to start, and is capped per
step (more tightly the longer its context) while shorter requests run.
"""

from __future__ import annotations

from headroom.config import SchedulerConfig
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.request import Request

LONG = "long"
LONG_CHUNK_REFERENCE_CONTEXT = 512
MIN_LONG_CHUNK = 8


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig):
        self.config = config

    def order_key(self, request: Request, now: float) -> tuple:
        waited = now - request.arrival_time
        rank = (request.predicted_output_tokens or 0.0) - self.config.ageing_tokens_per_s * waited
        return (-request.priority, rank, request.submit_order)

    def victim_key(self, request: Request) -> tuple:
        """min() of this is the preemption victim."""
        newest = (-request.arrival_time, -request.submit_order)
        if self.config.preemption_order == "newest":
            return newest
        predicted = request.predicted_output_tokens
        remaining = predicted - request.num_output_tokens if predicted is not None else 0.0
        return (request.priority, -remaining, *newest)

    def lane_admits(self, request: Request, running: list[Request], block_manager: BlockManager) -> bool:
        """May a waiting request start now, given its lane's limits?"""
        if request.size_class != LONG:
            return True
        longs = [r for r in running if r.size_class == LONG]
        cap = self.config.long_max_running
        if cap is not None and len(longs) >= cap:
            return False
        if self.config.long_kv_share < 1.0:
            held = sum(len(block_manager.block_table(r.request_id)) for r in longs)
            needed = block_manager.blocks_needed(request.num_tokens)
            if held + needed > self.config.long_kv_share * block_manager.num_blocks:
                return False
        return True

    def long_chunk_limit(self, context_tokens: int) -> int:
        """A chunk's attention cost grows with the context it attends to, so past
        LONG_CHUNK_REFERENCE_CONTEXT tokens the per-step cap shrinks in proportion: a step
        with a long chunk then costs about the same at 2,000 tokens of context as at 500."""
        cap = self.config.long_prefill_tokens_per_step or 0
        if context_tokens <= LONG_CHUNK_REFERENCE_CONTEXT:
            return cap
        return max(MIN_LONG_CHUNK, cap * LONG_CHUNK_REFERENCE_CONTEXT // context_tokens)

    def long_prefill_budget(self, running: list[Request], waiting: list[Request]) -> int | None:
        """Tokens long-class prefill chunks may take this step (None: no cap)."""
        cap = self.config.long_prefill_tokens_per_step
        if cap is None:
            return None
        # A shorter request waiting for its first step gets that step without any long
        # chunk in it: its TTFT is then one short step, not a long chunk's.
        if any(r.size_class != LONG for r in waiting):
            return 0
        return cap if any(r.size_class != LONG for r in running) else None
