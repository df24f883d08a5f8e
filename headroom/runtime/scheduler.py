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
from headroom.contracts.request import Request, RequestStatus
from headroom.contracts.schedule import SchedulerOutput
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.policy import LONG, MIN_LONG_CHUNK, SchedulingPolicy
from headroom.runtime.step_cost import attention_pairs


@dataclass
class _Step:
    """One schedule() call: what it may still hand out, and what it decided so far."""

    now: float
    budget: int  # tokens left in this step
    long_left: float | None  # seconds long prefill chunks may still add (None: no limit)
    decode_left: float | None  # seconds long decode rows may still add (None: no limit)
    # While shorter requests decode, long chunks spend what the long decode rows left of the
    # short class's time-per-token budget, plus what they saved sitting out: tpot_left,
    # set at the step's first long chunk (rows all come before chunks).
    tpot_bound: bool = False
    tpot_left: float | None = None
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens, in scheduling order
    preempted: list[Request] = field(default_factory=list)
    sat_out: dict[str, int] = field(default_factory=dict)  # long decodes left out: how many steps in a row
    row_floor: bool = False  # while shorter requests decode, a long decode that sat out runs each step
    long_rows: int = 0  # long decodes scheduled so far
    chunk_turns: bool = False  # long chunks the allowance cannot cover may sit out (shorter requests decode)
    chunk_skipped: bool = False  # a long chunk sat this step out, and holds the turn
    carry_s: float = 0.0  # what the chunk that sat out left unspent, for the next step's
    chunked: set[str] = field(default_factory=set)  # requests given a long chunk (scheduled, unless preempted)
    admitted: int = 0  # waiting requests started


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int],
        clock: Callable[[], float] = time.monotonic,
    ):
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
        # Long chunks that sat out the last steps: how many in a row, and the prefill
        # allowance they left unused, which the next step's long chunk may spend.
        self._chunk_skips = 0
        self._chunk_saved_s = 0.0

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
        decodes = [r.num_computed_tokens for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        base_s = self.policy.cost.decodes_seconds(decodes)
        return self.policy.long_prefill_allowance(self.running, self.waiting, now, base_s)

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        allowance = self.long_prefill_allowance(now)
        # Long chunks take turns only while shorter requests decode: their time per token
        # pays for each chunk. Else a chunk takes what the allowance covers, and at least
        # MIN_LONG_CHUNK, in every step that allows it any.
        turns = bool(allowance) and any(
            r.size_class != LONG and r.num_tokens - r.num_computed_tokens == 1 for r in self.running
        )
        # A step that starts a shorter request leaves long decodes out (its prefill
        # allowance already decided the chunk); else, while shorter requests decode, long
        # decodes and then long chunks share the short class's time-per-token budget.
        sit_out = self.policy.long_decodes_sit_out(self.running, self.waiting, self.block_manager, now)
        tpot_s = None if sit_out else self.policy.short_tpot_budget(self.running, self.waiting)
        step = _Step(
            now,
            self.config.max_num_batched_tokens,
            allowance + self._chunk_saved_s if turns else allowance,
            0.0 if sit_out else tpot_s,
            tpot_bound=turns and tpot_s is not None,
            row_floor=tpot_s is not None,
            chunk_turns=turns,
        )
        self._schedule_running(step)
        self._schedule_waiting(step)
        self._pass_turn(step)
        return self._output(step)

    def _pass_turn(self, step: _Step) -> None:
        """Carries the long chunks' turn to the next step: how many steps in a row they sat
        out, and the allowance they left. A chunk that ran, or no long prefill left, ends it."""
        if not step.chunk_skipped and not self._chunk_skips:
            return  # no turn under way (most steps): nothing to carry or end
        if any(rid in step.scheduled for rid in step.chunked) or not any(
            r.size_class == LONG and r.num_tokens - r.num_computed_tokens > 1 for r in (*self.running, *self.waiting)
        ):
            self._chunk_skips, self._chunk_saved_s = 0, 0.0
        elif step.chunk_skipped:
            self._chunk_skips, self._chunk_saved_s = self._chunk_skips + 1, step.carry_s
        # Else no long chunk was tried (the step starts a shorter request, or the budget
        # ran out before one): the turn waits as it was.

    def _schedule_running(self, step: _Step) -> None:
        """Running requests: decodes first, each in policy order, except that long decodes
        that sat out most go first, so that they take turns. A request that finds no room
        is preempted."""
        running = sorted(self.running, key=lambda r: self.policy.order_key(r, step.now))
        running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, -self._sat_out.get(r.request_id, 0)))
        for request in running:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if step.budget == 0:
                break
            if self._sits_out(step, request):
                continue
            num_tokens = self._chunk(
                step, request, request.num_tokens - request.num_computed_tokens, request.num_computed_tokens
            )
            if num_tokens == 0:
                continue
            if not self._make_room(step, request, num_tokens, None, list(self.running)):
                self._preempt(request)
                step.preempted.append(request)
                continue
            step.scheduled[request.request_id] = num_tokens
            step.budget -= num_tokens
            if request.size_class == LONG and num_tokens == 1:
                step.long_rows += 1
        self._sat_out = step.sat_out  # the turn order of the next step's long decodes

    def _sits_out(self, step: _Step, request: Request) -> bool:
        """Does a long decode sit this step out? Only when its row does not fit what long
        decodes may still add, it has not sat out long_decode_max_skip steps in a row
        already, and, while shorter requests decode, either it did not sit out the last
        step or another long decode runs in this one: the long class keeps a row a step
        for the decodes that wait, the one that sat out longest first, so that they take
        turns. A long decode that goes uses its row's seconds up."""
        if (
            step.decode_left is None
            or request.size_class != LONG
            or request.num_tokens - request.num_computed_tokens != 1
        ):
            return False
        row_s = self.policy.cost.chunk_seconds(1, request.num_computed_tokens)
        skipped = self._sat_out.get(request.request_id, 0)
        over = step.decode_left <= 0 or row_s > step.decode_left
        floor = step.row_floor and skipped > 0 and not step.long_rows
        if over and skipped < self.config.long_decode_max_skip and not floor:
            step.sat_out[request.request_id] = skipped + 1
            return True
        step.decode_left -= row_s
        return False

    def _chunk(self, step: _Step, request: Request, remaining: int, context: int) -> int:
        """Tokens for a request `remaining` behind: what the budget allows, and for a long
        prefill what the long lane's allowance still covers (which the chunk uses up).
        While shorter requests decode, the allowance is also bounded by what the long
        decode rows left of the short class's time-per-token budget (plus what chunks
        saved), and a long chunk it cannot cover at MIN_LONG_CHUNK sits out (up to
        long_prefill_max_skip steps in a row), carrying it over to the next step. The
        first long chunk in policy order to sit out holds the turn: none after it runs in
        that step, or a shallower prompt's chunks could keep a deep one's turn from ever
        coming."""
        n = min(remaining, step.budget)
        if step.long_left is not None and request.size_class == LONG and remaining > 1:
            if step.chunk_skipped:
                return 0
            limit = n
            floor = not step.chunk_turns or self._chunk_skips >= self.config.long_prefill_max_skip
            allowance = step.long_left
            if step.tpot_bound:
                if step.tpot_left is None:
                    # Forced rows may have overspent the budget: the chunk then has only
                    # its savings, and takes its turn by the floor.
                    step.tpot_left = max(0.0, step.decode_left) + self._chunk_saved_s
                allowance = min(allowance, step.tpot_left)
            if allowance > 0:
                n = self.policy.long_chunk(context, allowance, limit, floor)
            else:  # the budget is spent, the prefill allowance is not: the floor, or sit out
                n = min(limit, MIN_LONG_CHUNK) if floor and step.long_left > 0 else 0
            step.chunk_skipped = n == 0 and limit > 0 and step.long_left > 0
            if step.chunk_skipped:
                step.carry_s = max(0.0, allowance)
            if n > 0:
                step.chunked.add(request.request_id)
            spent = self.policy.cost.chunk_seconds(n, context)
            step.long_left -= spent
            if step.tpot_left is not None:
                step.tpot_left -= spent
        return n

    def _make_room(
        self, step: _Step, request: Request, num_tokens: int, computed: list[int] | None, victims: list[Request]
    ) -> bool:
        """Allocates the request's slots, preempting the policy's victims until they fit.
        False when no victim is left or the policy picks the request itself. A victim
        already scheduled in this step gives its tokens back to the budget."""
        while self.block_manager.allocate_slots(request, num_tokens, computed) is None:
            if not victims:
                return False
            victim = self.policy.choose_victim(victims)
            if victim is request:
                return False
            victims.remove(victim)
            step.budget += step.scheduled.pop(victim.request_id, 0)
            self._preempt(victim)
            step.preempted.append(victim)
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests in policy order, while budget and seats last. Not in a step that
        had to preempt: the cache is full, and admitting now would thrash."""
        self.waiting.sort(key=lambda r: self.policy.order_key(r, step.now))
        candidates = list(self.waiting)
        for request in candidates:
            if step.preempted or step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self.policy.lane_admits(request, self.running, self.block_manager):
                continue
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            if not self.config.enable_chunked_prefill:
                if remaining > step.budget and step.scheduled:
                    break
                num_tokens = remaining
            else:
                num_tokens = self._chunk(step, request, remaining, request.num_computed_tokens + num_cached)
                if num_tokens == 0:
                    continue
            # A waiting request may only displace running ones of strictly lower priority.
            victims = [r for r in self.running if r.priority < request.priority]
            if not self._make_room(step, request, num_tokens, computed, victims):
                break
            self._admit(step, request, num_cached, num_tokens, candidates)

    def _admit(
        self, step: _Step, request: Request, num_cached: int, num_tokens: int, candidates: list[Request]
    ) -> None:
        """Moves a waiting request whose slots are allocated to running, with num_cached
        prompt tokens found in the prefix cache and num_tokens scheduled in this step."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens += num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
        if not step.admitted:
            self.policy.note_admitted(candidates, request, step.now)
        step.admitted += 1
        self.running.append(request)
        step.scheduled[request.request_id] = num_tokens
        step.budget -= num_tokens

    def _output(self, step: _Step) -> SchedulerOutput:
        out = SchedulerOutput(preempted=step.preempted)
        by_id = self.requests
        for rid, n in step.scheduled.items():
            out.requests.append(by_id[rid])
            out.num_scheduled_tokens.append(n)
            pairs = attention_pairs(n, by_id[rid].num_computed_tokens)
            out.attention_pairs += pairs
            out.decode_pairs += pairs if n == 1 else 0
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
        if (
            detection is not None
            and request.num_output_tokens >= params.min_tokens
            and request.loop.period(detection) is not None
        ):
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
