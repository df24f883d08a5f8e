"""Who goes first, who is preempted, and how much room long work gets: the scheduler's
policy, kept apart from its mechanics.

Order: tier priority first, then predicted-shortest-remaining first with ageing (the
estimated remaining output tokens, the length probe's once it has seen a sequence
run, minus ageing_tokens_per_s per second waited, so nothing starves; without
predictions that is FCFS). Victims: lowest priority, then the longest estimated
remaining, then the newest. Long-class requests run in a lane with its own concurrency
and KV share, their prefill chunks and decode rows sized in seconds by the engine's
measured step cost (long_prefill_allowance, short_tpot_budget). HolFeedback scales
the prefill allowance by the head-of-line signal (observability/hol.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from headroom.config import SchedulerConfig
from headroom.contracts.request import Request
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.step_cost import MIN_PREFILL_TOKENS, StepCostModel

LONG = "long"
# Before the step-cost model has seen any prefill: a chunk big enough to teach it.
UNTRAINED_LONG_CHUNK = 2 * MIN_PREFILL_TOKENS
MIN_LONG_CHUNK = MIN_PREFILL_TOKENS  # the fewest tokens a long chunk takes when it takes any
LONG_STEP_STRETCH = 0.25  # a long chunk may make a step this much longer than it is without
TIGHTEST = 1 / 16  # the head-of-line loop's lowest scale on the long lane's allowance

log = logging.getLogger("headroom.hol")


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.cost = StepCostModel()  # fed by the engine after every step
        # In (0, 1]: the head-of-line loop lowers it while the short class suffers.
        self.long_lane_factor = 1.0
        # Decisions the length probe's estimate changed: order, victim, long_lane.
        self.probe_decisions: Counter[str] = Counter()
        self.last_short_arrival = float("-inf")  # when a request not of the long class last arrived

    def note_arrival(self, request: Request, now: float) -> None:
        if request.size_class != LONG:
            self.last_short_arrival = now

    def order_key(self, request: Request, now: float, probed: bool = True) -> tuple:
        waited = now - request.arrival_time
        rank = (request.estimated_remaining_tokens(probed) or 0.0) - self.config.ageing_tokens_per_s * waited
        return (*request.priority.first(), rank, request.submit_order)

    def victim_key(self, request: Request, probed: bool = True) -> tuple:
        """min() of this is the preemption victim."""
        newest = (-request.arrival_time, -request.submit_order)
        if self.config.preemption_order == "newest":
            return newest
        return (request.priority, -(request.estimated_remaining_tokens(probed) or 0.0), *newest)

    def choose_victim(self, victims: list[Request]) -> Request:
        """The victim; counts the choices the probe's estimate changed."""
        victim = min(victims, key=self.victim_key)
        if (
            any(r.predicted_remaining_tokens is not None for r in victims)
            and min(victims, key=lambda r: self.victim_key(r, probed=False)) is not victim
        ):
            self.probe_decisions["victim"] += 1
        return victim

    def note_admitted(self, waiting: list[Request], first: Request, now: float) -> None:
        """Counts admissions whose first pick the probe's estimate changed (waiting as
        it was sorted before the step admitted `first`): the head by the estimate went,
        and the head without it was another. A head the lane held back counts nothing."""
        if (
            first is waiting[0]
            and any(r.predicted_remaining_tokens is not None for r in waiting)
            and min(waiting, key=lambda r: self.order_key(r, now, probed=False)) is not first
        ):
            self.probe_decisions["order"] += 1

    def lane_admits(self, request: Request, running: list[Request], block_manager: BlockManager) -> bool:
        """May a waiting request start now, given its lane's limits?"""
        if request.size_class != LONG or not self.config.long_lane:
            return True
        longs = [r for r in running if r.size_class == LONG]
        cap = self.config.long_max_running
        if cap is not None and len(longs) >= cap:
            return False
        if self.config.long_kv_share < 1.0:
            # What running longs will hold once their prompts are in, not what they hold
            # part-way through a chunked prefill.
            held = sum(block_manager.blocks_needed(r.num_tokens) for r in longs)
            needed = block_manager.blocks_needed(request.num_tokens)
            if held + needed > self.config.long_kv_share * block_manager.num_blocks:
                return False
        return True

    def long_prefill_allowance(
        self, running: list[Request], waiting: list[Request], now: float, base_s: float = 0.0
    ) -> float | None:
        """Seconds that long-class prefill chunks may add to this step (None: no limit).

        A short request meets at most two steps before its first token: the one running
        when it arrives and its own. Its own step carries no long chunk, unless the long
        request has waited long_ttft_target_s. The one it arrives during may carry a
        quarter of the short class's TTFT target, or a quarter of what the step costs
        without it (base_s) where a step is already slower than the target, whichever is
        more. The head-of-line loop scales that down while the short class still suffers; the
        floor keeps the long class moving even then: it grows with the oldest prefilling
        long request's wait and is the whole allowance at long_ttft_target_s.

        With no shorter request present the chunk is bounded all the same (by the full
        allowance, without the loop's scaling): one arriving during the step waits for all
        of it, and one unbounded chunk alone can set the short class's p99 TTFT
        (bench/RESULTS.md). Only where no shorter request has arrived for
        long_lane_quiet_s is nothing protected: long work alone then runs at full speed."""
        config = self.config
        if not config.long_lane:
            return None
        full = max(config.short_ttft_target_s / 4, LONG_STEP_STRETCH * base_s)
        if not any(r.size_class != LONG for r in (*running, *waiting)):
            # Nobody to protect now; one may arrive during the step, unless none has for
            # long_lane_quiet_s: then long work runs at the step's full token budget.
            return None if now - self.last_short_arrival >= config.long_lane_quiet_s else full
        waited = max(
            (
                now - r.arrival_time
                for r in (*running, *waiting)
                if r.size_class == LONG and r.num_tokens - r.num_computed_tokens > 1
            ),
            default=0.0,
        )
        floor = min(1.0, waited / config.long_ttft_target_s)
        if any(r.size_class != LONG for r in waiting):
            # A shorter request starts in this step: its first token comes at the step's
            # end, so a long chunk here would be paid in full by its TTFT. None, until the
            # long request has waited long_ttft_target_s: a chunk deep in a long context
            # pays attention's gather of the whole context however few its tokens.
            return full if floor >= 1.0 else 0.0
        return full * max(floor, self.long_lane_factor)

    def short_tpot_budget(self, running: list[Request], waiting: list[Request]) -> float | None:
        """Seconds that long work (decode rows and prefill chunks together) may add to this
        step while shorter requests decode (None: no such objective now, or no step cost
        learned yet).

        short_tpot_stretch of what the step is predicted to cost without the long work:
        attention over long contexts would otherwise set every shorter request's time per
        output token. The scheduler spends it on long decodes first, which take turns
        within it (longest sat out first, one of those that sat out runs each step, none
        sits out more than long_decode_max_skip steps in a row), then on a long chunk,
        which sits out what it cannot cover and carries the unspent seconds over (none
        more than long_prefill_max_skip steps in a row)."""
        if not self.config.long_lane or not any(r.size_class == LONG for r in (*running, *waiting)):
            return None
        shorts = [
            r.num_computed_tokens for r in running if r.size_class != LONG and r.num_tokens - r.num_computed_tokens == 1
        ]
        if not shorts or not self.cost.ready:
            return None
        return self.config.short_tpot_stretch * self.cost.decodes_seconds(shorts)

    def long_decodes_sit_out(
        self, running: list[Request], waiting: list[Request], block_manager: BlockManager, now: float
    ) -> bool:
        """Do long-class decodes sit out this step (up to long_decode_max_skip in a row)?

        They do where the step starts a shorter request: its first token comes at the
        step's end, and each long decode adds its attention over a long context to the
        step, which a short request's own prefill may be a small part of
        (bench/runaways.py). The scheduler holds none out more than long_decode_max_skip
        steps in a row, so each long decode keeps about 1 / (1 + that) of its pace.

        Only where the request admission takes first is the shorter one and it has a seat
        and room in the cache, with a block kept for each long decode, which may need one
        in the next step: else it would not start, or would start only to have the long
        decode it displaced preempted next step, and the long decodes would slow for
        nothing (the blocks the queue waits for are theirs to free)."""
        longs = sum(1 for r in running if r.size_class == LONG)
        if not longs or not self.config.long_lane or len(running) >= self.config.max_num_seqs:
            return False
        admissible = [r for r in waiting if self.lane_admits(r, running, block_manager)]
        if not admissible:
            return False
        head = min(admissible, key=lambda r: self.order_key(r, now))
        return (
            head.size_class != LONG
            and block_manager.blocks_needed(head.num_tokens) + longs <= block_manager.num_free_blocks
        )

    def long_chunk(self, context: int, allowance_s: float, limit: int, floor: bool = True) -> int:
        """Prefill tokens a long request at `context` may take within allowance_s. Where
        that is under MIN_LONG_CHUNK: MIN_LONG_CHUNK with `floor`, else none (the chunk
        sits the step out, and the scheduler carries the allowance over)."""
        if allowance_s <= 0:
            return 0
        if not self.cost.ready:  # nothing learned yet: a small chunk, and learn from it
            return min(limit, UNTRAINED_LONG_CHUNK)
        # Deep in a long context one token may cost more than the whole allowance (or the
        # fit may say so, wrongly, after a few slow steps): a chunk of MIN_LONG_CHUNK all
        # the same. Fewer tokens would pay a chunk's fixed cost (attention's gather of the
        # whole context) for almost nothing, and the prefill then crawled; with the floor it
        # finishes within ceil(prompt / MIN_LONG_CHUNK) steps that allow it anything, times
        # 1 + long_prefill_max_skip while shorter requests decode (the chunk takes turns).
        fits = self.cost.tokens_within(allowance_s, context, limit)
        if fits >= min(limit, MIN_LONG_CHUNK):
            return fits
        return min(limit, MIN_LONG_CHUNK) if floor else 0


class HolFeedback:
    """Moves SchedulingPolicy.long_lane_factor (through set_factor) by the head-of-line signal."""

    def __init__(self, set_factor: Callable[[float], None], enabled: bool = True):
        self.set_factor = set_factor
        self.enabled = enabled  # False when the long lane is off: nothing to act on
        self.factor = 1.0
        self.actions: Counter[str] = Counter()  # tighten / relax

    def update(self, coupled: bool, short_ttft_p99_s: float | None, long_device_share: float) -> str | None:
        """Act on one interval's head-of-line signal; returns the action taken, if any."""
        if not self.enabled:
            return None
        if coupled and self.factor > TIGHTEST:
            action, factor = "tighten", max(TIGHTEST, self.factor / 2)
        elif not coupled and self.factor < 1.0:
            action, factor = "relax", min(1.0, self.factor * 2)
        else:
            return None
        self.set_factor(factor)
        self.factor = factor
        self.actions[action] += 1
        log.warning(
            "head-of-line loop: %s the long lane to %.3g of its prefill allowance (short p99 TTFT %s, long "
            "sequences %.0f%% of engine time)",
            "tightened" if action == "tighten" else "relaxed",
            factor,
            "n/a" if short_ttft_p99_s is None else f"{short_ttft_p99_s:.2f}s",
            100 * long_device_share,
            extra={"hol_action": action, "long_lane_factor": factor},
        )
        return action
