"""Iteration-level scheduling with a per-step token budget.

There are no prefill and decode phases: every step gives each scheduled request tokens
so that its num_computed_tokens catches up with num_tokens. A request one token behind
is a decode; one further behind is (chunked) prefill, including a preempted request
recomputing what it lost. Running decodes go first, then prefill chunks fill the rest of
the budget. Who goes first, who is preempted and how much room long work gets is the
SchedulingPolicy's call (policy.py), how much of a step long work gets is the long
lane's (lane.py); when blocks run out the policy's victim is preempted by recompute.

LoRA adapters take slots: the running requests hold at most max_loras distinct adapters
(base rows hold none), so no step holds more. A waiting request whose adapter finds no
free slot is passed over, never blocking those behind it. Once such a request has waited
LORA_PATIENCE_S, it reserves the next slot: only base requests and its own adapter's are
admitted until it runs, so the running adapters' sequences finish and one frees a slot.
Its wait is so bounded by LORA_PATIENCE_S plus the time the running sequences of one
adapter take to finish (each at most its max_tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.config import SchedulerConfig, SpeculativeConfig
from headroom.contracts.request import Request, RequestStatus
from headroom.contracts.schedule import SchedulerOutput
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.lane import LongLane, Turn, behind, is_long
from headroom.runtime.policy import SchedulingPolicy
from headroom.runtime.speculation import Row, Speculator, step_pairs
from headroom.runtime.step_cost import StepCostModel, attention_pairs

LORA_PATIENCE_S = 2.0  # how long a request may be passed over for an adapter slot


@dataclass
class Update:
    """What update_from_output did with a step's samples."""

    # The requests that got tokens (finished ones included, already freed), with how many each.
    tokens: list[tuple[Request, int]] = field(default_factory=list)
    accepted: int = 0  # guesses kept and appended: none after a stop or a loop found amid them


@dataclass
class _Step:
    """One schedule() call: what it may still hand out, and what it decided so far."""

    now: float
    budget: int  # tokens left in this step
    lane: Turn  # the long lane's share of it
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens, in scheduling order
    preempted: list[Request] = field(default_factory=list)
    admitted: int = 0  # waiting requests started
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> guessed tokens
    draft_s: float = 0.0  # the draft model's forwards for them


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int],
        clock: Callable[[], float] = time.monotonic,
        speculative: SpeculativeConfig | None = None,
    ):
        self.config = config
        self.clock = clock
        self.block_manager = block_manager
        self.cost = StepCostModel()  # fed by the engine after every step
        self.policy = SchedulingPolicy(config)
        self.lane = LongLane(config, self.cost, self.policy.order_key, block_manager)
        self.speculator = Speculator(speculative, self.cost) if speculative and speculative.enabled else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by the policy at each schedule()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._order = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.submit_order = self._order
        self._order += 1
        self.lane.note_arrival(request, self.clock())
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        step = _Step(
            now,
            self.config.max_num_batched_tokens,
            self.lane.begin(self.running, self.waiting, now),
        )
        self._schedule_running(step)
        self._schedule_waiting(step)
        self.lane.end(step.lane, step.scheduled, self.running, self.waiting)
        self._speculate(step)
        return self._output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests: decodes first, each in policy order, except that long decodes
        that sat out most go first, so that they take turns. A request that finds no room
        is preempted."""
        running = sorted(self.running, key=lambda r: self.policy.order_key(r, step.now))
        running.sort(key=lambda r: (behind(r) > 1, self.lane.decode_order(r)))
        for request in running:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if step.budget == 0:
                break
            if self.lane.sits_out(step.lane, request):
                continue
            context = request.num_computed_tokens
            num_tokens = self.lane.chunk(step.lane, request, min(behind(request), step.budget), context)
            if num_tokens == 0:
                continue
            if not self._make_room(step, request, num_tokens, None, list(self.running)):
                self._preempt(request)
                step.preempted.append(request)
                continue
            step.scheduled[request.request_id] = num_tokens
            step.budget -= num_tokens
            self.lane.ran(step.lane, request, num_tokens)

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
        slots = AdapterSlots(self.config.max_loras, self.running, candidates, step.now)
        for request in candidates:
            if step.preempted or step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not slots.admits(request) or not self.lane.admits(request, self.running):
                continue
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            if not self.config.enable_chunked_prefill:
                if remaining > step.budget and step.scheduled:
                    break
                num_tokens = remaining
            else:
                context = request.num_computed_tokens + num_cached
                num_tokens = self.lane.chunk(step.lane, request, min(remaining, step.budget), context)
                if num_tokens == 0:
                    continue
            # A waiting request may only displace running ones of strictly lower priority.
            victims = [r for r in self.running if r.priority < request.priority]
            if not self._make_room(step, request, num_tokens, computed, victims):
                break
            self._admit(step, request, num_cached, num_tokens, candidates)
            slots.took(request)

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

    def _speculate(self, step: _Step) -> None:
        """Guesses for decode rows, from what the step leaves of its budget, where their
        price pays (runtime/speculation.py); never by preempting anyone."""
        if self.speculator is None or step.budget <= 0 or step.preempted:
            return
        by_id = self.requests
        rows = [Row(by_id[rid], by_id[rid].num_computed_tokens) for rid, n in step.scheduled.items() if n == 1]
        rows = [row for row in rows if behind(row.request) == 1]
        if not rows:
            return
        rows.sort(key=lambda row: is_long(row.request))  # otherwise in the order they were scheduled
        pairs = [attention_pairs(n, by_id[rid].num_computed_tokens) for rid, n in step.scheduled.items()]
        decode_pairs = sum(p for p, n in zip(pairs, step.scheduled.values(), strict=True) if n == 1)
        plan = self.speculator.plan(rows, sum(step.scheduled.values()), sum(pairs), decode_pairs, step.budget)
        step.draft_s = self.speculator.drafted_s
        for rid, guess in plan.items():
            if self.block_manager.allocate_slots(by_id[rid], 1 + len(guess)) is None:
                continue  # no block for the guesses: the row decodes as it would have
            step.scheduled[rid] = 1 + len(guess)
            step.budget -= len(guess)
            step.drafts[rid] = guess

    def _output(self, step: _Step) -> SchedulerOutput:
        out = SchedulerOutput(preempted=step.preempted, drafts=step.drafts, draft_s=step.draft_s)
        by_id = self.requests
        for rid, n in step.scheduled.items():
            out.requests.append(by_id[rid])
            out.num_scheduled_tokens.append(n)
            pairs = step_pairs(n, by_id[rid].num_computed_tokens, rid in step.drafts)
            out.attention_pairs += pairs
            out.decode_pairs += pairs if n == 1 or rid in step.drafts else 0
        # Decodes first, as the attention metadata expects; then the rows that guessed,
        # which run as one decode row a position.
        order = sorted(
            range(len(out.requests)),
            key=lambda i: (out.num_scheduled_tokens[i] > 1, out.requests[i].request_id not in step.drafts),
        )
        out.requests = [out.requests[i] for i in order]
        out.num_scheduled_tokens = [out.num_scheduled_tokens[i] for i in order]
        out.num_decodes = sum(1 for n in out.num_scheduled_tokens if n == 1)
        return out

    def _preempt(self, request: Request) -> None:
        self.block_manager.free_request(request.request_id)
        if self.speculator is not None:
            self.speculator.preempted(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: list[int | list[int] | None],
        loop_found: Callable[[Request], bool] | None = None,
    ) -> Update:
        """Advance counters after a model step. sampled[i] is the token sampled for
        out.requests[i] (for a row that guessed, its kept guesses and its own token, a list),
        or None when its prefill is not complete yet. loop_found: the server's loop detector,
        asked after each token that did not finish its sequence (a loop found drops the
        row's tokens after it)."""
        update = Update()
        for request, num_tokens, token in zip(out.requests, out.num_scheduled_tokens, sampled, strict=True):
            if request.is_finished:  # aborted while the step ran
                continue
            tokens = [] if token is None else token if isinstance(token, list) else [token]
            before = request.num_output_tokens
            status = None
            for t in tokens:  # a stop among them ends the row there: the rest never existed
                request.append_output(t)
                if request.loop_tracker is not None:
                    request.loop_tracker.push(request.output_token_ids)
                status = self._check_stop(request, t)
                if status is not None or (loop_found is not None and loop_found(request)):
                    break
            unused = len(tokens) - (request.num_output_tokens - before)
            if unused and status is None and request.grammar is not None:
                # A loop found amid kept guesses: the sampler's matcher took the tokens after it.
                request.grammar.matcher.rollback(unused)
            # The cache holds the row's tokens up to its first rejected guess; and never its
            # newest token, whose logits the next step needs (after a loop found amid kept
            # guesses, that one is computed again).
            guessed = len(out.drafts.get(request.request_id, ()))
            dropped = guessed - (len(tokens) - 1) if tokens else 0
            computed = request.num_computed_tokens + num_tokens - dropped
            request.num_computed_tokens = min(computed, request.num_tokens - 1) if tokens else computed
            self.block_manager.cache_full_blocks(request)
            if guessed and tokens and self.speculator is not None:
                kept = min(len(tokens) - 1, request.num_output_tokens - before)
                self.speculator.verified(request, guessed, kept)
                update.accepted += kept
            if status is not None:
                self.finish_request(request.request_id, status)
            if tokens:
                update.tokens.append((request, request.num_output_tokens - before))
        return update

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
            and request.loop_tracker.period(detection) is not None
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
        if self.speculator is not None:
            self.speculator.finished(request)
        return request


class AdapterSlots:
    """One step's view of the LoRA adapter slots: which adapters the running requests
    hold, and which one (if any) a request passed over for LORA_PATIENCE_S has reserved."""

    def __init__(self, max_loras: int, running: list[Request], waiting: list[Request], now: float):
        self.max_loras = max_loras
        self.held = {r.lora.uid for r in running if r.lora is not None}
        # The oldest waiting request whose adapter has no slot and that has waited too long.
        full = len(self.held) >= max_loras
        starved = (
            [
                r
                for r in waiting
                if r.lora is not None and r.lora.uid not in self.held and now - _since(r) >= LORA_PATIENCE_S
            ]
            if full
            else []
        )
        self.reserved = min(starved, key=_since).lora.uid if starved else None

    def admits(self, request: Request) -> bool:
        if request.lora is None:
            return True
        uid = request.lora.uid
        if self.reserved is not None and uid != self.reserved:
            return False  # held back so that a running adapter drains and frees a slot
        return uid in self.held or len(self.held) < self.max_loras

    def took(self, request: Request) -> None:
        if request.lora is not None:
            self.held.add(request.lora.uid)
            if request.lora.uid == self.reserved:
                self.reserved = None


def _since(request: Request) -> float:
    """When the request began to wait for the engine: admission's wait is not the scheduler's."""
    return request.admitted_time if request.admitted_time is not None else request.arrival_time
