"""Small builders for scheduler and block-manager tests (no model involved)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from headroom.config import SchedulerConfig
from headroom.contracts.request import AdmissionRecord, Priority, Request, SamplingParams, SizeClass
from headroom.contracts.schedule import SchedulerOutput
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.scheduler import Scheduler

EOS = 2
_ids = itertools.count()


def create_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    preemption_order: str = "priority",
    clock: Callable[[], float] = time.monotonic,
    **policy,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_order=preemption_order,
        **policy,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching), {EOS}, clock)


def create_request(
    prompt: list[int] | int = 8,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float | None = None,
    predicted: float | None = None,
    size_class: str | None = None,
    **sampling,
) -> Request:
    n = next(_ids)
    # Distinct per request, so prefix-cache hits happen only where a test shares tokens.
    tokens = prompt if isinstance(prompt, list) else [1000 + 97 * n + i for i in range(prompt)]
    return Request(
        f"r{n}",
        tokens,
        SamplingParams(max_tokens=max_tokens, **sampling),
        Priority(value=priority),
        arrival_time=float(n) if arrival is None else arrival,
        admission=AdmissionRecord(
            size_class=None if size_class is None else SizeClass(size_class), predicted_output_tokens=predicted
        ),
    )


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """schedule() plus a fake model that samples `token` for every finished prefill."""
    out = scheduler.schedule()
    sampled = [
        token if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
    ]
    return out, [request for request, _ in scheduler.update_from_output(out, sampled).tokens]
