"""Iteration-level scheduling with a per-step token budget.

There are no prefill and decode phases: every step gives each scheduled request tokens
so that its num_computed_tokens catches up with num_tokens. A request one token behind
is a decode; one further behind is (chunked) prefill, including a preempted request
recomputing what it lost. Running decodes go first, then prefill chunks fill the rest of
the budget. Who goes first, who is preempted and how much room long work gets is the
SchedulingPolicy's call (policy.py); when blocks run out the policy's victim is
preempted by recompute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.config import SchedulerConfig
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.policy import LONG, SchedulingPolicy
from headroom.runtime.request import Request, RequestStatus
from headroom.runtime.step_cost import attention_pairs


@dataclass
class SchedulerOutput:
    # Batch order: decodes first. num_scheduled_tokens[i] belongs to requests[i].
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)
    attention_pairs: int = 0  # (query, key) pairs the step computes, for the step-cost model

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.block_manager = block_manager
        self.policy = SchedulingPolicy(config)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by the policy at each schedule()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._order = 0
        self._sat_out: dict[str, int] = {}  # long decodes left out of the last steps: how many in a row

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.submit_order = self._order
        self._order += 1
        self.policy.note_arrival(request, self.clock())
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def long_prefill_allowance(self, now: float) -> float | None:
        """What long prefill chunks may add to the next step, in seconds (None: no limit)."""
        # Most steps have no long prompt to chunk: skip the cost-model fit they would not use.
        if not any(r.size_class == LONG for r in (*self.running, *self.waiting)):
            return None
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        base_s = self.policy.cost.predict(len(decodes), sum(attention_pairs(1, r.num_computed_tokens) for r in decodes))
        return self.policy.long_prefill_allowance(self.running, self.waiting, now, base_s)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        now = self.clock()
        long_left = self.long_prefill_allowance(now)
        decode_left = self.policy.long_decode_allowance(self.running, self.waiting, self.block_manager, now)
        sat_out: dict[str, int] = {}

        def chunk(request: Request, remaining: int, context: int) -> int:
            nonlocal long_left
            n = min(remaining, budget)
            if long_left is not None and request.size_class == LONG and remaining > 1:
                n = self.policy.long_chunk(context, long_left, n)
                long_left -= self.policy.cost.chunk_seconds(n, context)
            return n

        def make_room(request: Request, num_tokens: int, computed: list[int] | None, victims: list[Request]) -> bool:
            nonlocal budget
            while self.block_manager.allocate_slots(request, num_tokens, computed) is None:
                if not victims:
                    return False
                victim = self.policy.choose_victim(victims)
                if victim is request:
                    return False
                victims.remove(victim)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
            return True

        # Running requests: decodes first, each in policy order, except that long decodes
        # that sat out most go first, so that they take turns.
        running = sorted(self.running, key=lambda r: self.policy.order_key(r, now))
        running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, -self._sat_out.get(r.request_id, 0)))
        for request in running:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            if (decode_left is not None and request.size_class == LONG
                    and request.num_tokens - request.num_computed_tokens == 1):
                row_s = self.policy.cost.chunk_seconds(1, request.num_computed_tokens)
                skipped = self._sat_out.get(request.request_id, 0)
                if (decode_left <= 0 or row_s > decode_left) and skipped < self.config.long_decode_max_skip:
                    sat_out[request.request_id] = skipped + 1
                    continue
                decode_left -= row_s
            num_tokens = chunk(request, request.num_tokens - request.num_computed_tokens, request.num_computed_tokens)
            if num_tokens == 0:
                continue
            if not make_room(request, num_tokens, None, list(self.running)):
                self._preempt(request)
                preempted.append(request)
                continue
            scheduled[request.request_id] = num_tokens
            budget -= num_tokens

        self._sat_out = sat_out

        # Then waiting requests in policy order, while budget and seats last. Not in a step
        # that had to preempt: the cache is full, and admitting now would thrash.
        self.waiting.sort(key=lambda r: self.policy.order_key(r, now))
        candidates = list(self.waiting)
        for request in candidates:
            if preempted or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self.policy.lane_admits(request, self.running, self.block_manager):
                continue
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            if not self.config.enable_chunked_prefill:
                if remaining > budget and scheduled:
                    break
                num_tokens = remaining
            else:
                num_tokens = chunk(request, remaining, request.num_computed_tokens + num_cached)
                if num_tokens == 0:
                    continue
            # A waiting request may only displace running ones of strictly lower priority.
            victims = [r for r in self.running if r.priority < request.priority]
            if not make_room(request, num_tokens, computed, victims):
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if len(self.waiting) + 1 == len(candidates):
                self.policy.note_admitted(candidates, request, now)
            self.running.append(request)
            scheduled[request.request_id] = num_tokens
            budget -= num_tokens

        out = SchedulerOutput(preempted=preempted)
        by_id = self.requests
        for rid, n in scheduled.items():
            out.requests.append(by_id[rid])
            out.num_scheduled_tokens.append(n)
            out.attention_pairs += attention_pairs(n, by_id[rid].num_computed_tokens)
        # Decodes first, as the attention metadata expects.
        order = sorted(range(len(out.requests)), key=lambda i: out.num_scheduled_tokens[i] > 1)
        out.requests = [out.requests[i] for i in order]
        out.num_scheduled_tokens = [out.num_scheduled_tokens[i] for i in order]
        out.num_decodes = sum(1 for n in out.num_scheduled_tokens if n == 1)
        return out

    def _preempt(self, request: Request) -> None:
        self.block_manager.free_request(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Advance counters after a model step. sampled[i] is the token sampled for
        out.requests[i], or None when its prefill is not complete yet. Returns the
        requests that got a new token (finished ones included, already freed)."""
        got_token = []
        for request, num_tokens, token in zip(out.requests, out.num_scheduled_tokens, sampled, strict=True):
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(request)
            if token is None:
                continue
            request.append_output(token)
            if request.loop is not None:
                request.loop.push(request.output_token_ids)
            status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request.request_id, status)
            got_token.append(request)
        return got_token

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if stop_token and request.num_output_tokens >= params.min_tokens:
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        detection = params.repetition_detection
        if (detection is not None and request.num_output_tokens >= params.min_tokens
                and request.loop.period(detection) is not None):
            request.stop_reason = "repetition_detected"
            return RequestStatus.FINISHED_REPETITION
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length, abort) a request wherever it is; frees its blocks.
        Returns None for an unknown or already finished id."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free_request(request_id)
        request.status = status
        request.finished_time = time.monotonic()
        return request
