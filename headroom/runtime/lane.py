"""The long lane: what the long class may add to each step, and whose turn it is.

Long-class requests run in a lane with its own concurrency and KV share (admits). The
seconds their prefill chunks and decode rows may add to a step are sized by the engine's
measured step cost: a quarter of the short class's TTFT target for prefill
(prefill_allowance), a stretch of the shorter decodes' step while they decode
(short_tpot_budget). While shorter requests decode, long decodes and long chunks take
turns within those seconds; Turn is one step's share, and the lane carries who sat out
to the next step. HolFeedback scales the prefill allowance by the head-of-line signal.

The scheduler asks four things per step: begin (the step's share), sits_out (a long
decode row), chunk (a long prefill chunk) and end (carry the turn).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.config import SchedulerConfig
from headroom.contracts.request import Request, SizeClass
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.step_cost import MIN_PREFILL_TOKENS, StepCostModel

LONG = SizeClass.LONG
# Before the step-cost model has seen any prefill: a chunk big enough to teach it.
UNTRAINED_LONG_CHUNK = 2 * MIN_PREFILL_TOKENS
MIN_LONG_CHUNK = MIN_PREFILL_TOKENS  # the fewest tokens a long chunk takes when it takes any
LONG_STEP_STRETCH = 0.25  # a long chunk may make a step this much longer than it is without
TIGHTEST = 1 / 16  # the head-of-line loop's lowest scale on the long lane's allowance
# After a quiet spell a long chunk may add what this share of the step's token budget
# costs at its context, where that is more than the TTFT target: on a slow machine the
# target's few tokens a chunk slowed a long prompt's prefill (bench/RESULTS.md).
QUIET_MIN_BUDGET_SHARE = 0.5
# A long prompt's deadline: this many times what its prefill adds to a step alone (or
# long_ttft_target_s, where that is sooner). Beside steady short decodes a prompt's TTFT
# was over twice first come, first served's, however long it had waited (bench/RESULTS.md:
# the noisy neighbour).
LONG_DEADLINE_ALONE = 2.0

log = logging.getLogger("headroom.hol")


def behind(request: Request) -> int:
    """Tokens a request is behind: 1 for a decode, more for a (chunked) prefill."""
    return request.num_tokens - request.num_computed_tokens


def is_long(request: Request) -> bool:
    return request.size_class == LONG


@dataclass
class Turn:
    """The long lane's share of one step, spent as the scheduler goes."""

    long_left: float | None  # seconds long prefill chunks may still add (None: no limit)
    decode_left: float | None  # seconds long decode rows may still add (None: no limit)
    # While shorter requests decode, long chunks spend what the long decode rows left of the
    # short class's time-per-token budget, plus what they saved sitting out: tpot_left,
    # set at the step's first long chunk (rows all come before chunks).
    tpot_bound: bool = False
    tpot_left: float | None = None
    sat_out: dict[str, int] = field(default_factory=dict)  # long decodes left out: how many steps in a row
    row_floor: bool = False  # while shorter requests decode, a long decode that sat out runs each step
    long_rows: int = 0  # long decodes scheduled so far
    chunk_turns: bool = False  # long chunks the allowance cannot cover may sit out (shorter requests decode)
    chunk_skipped: bool = False  # a long chunk sat this step out, and holds the turn
    carry_s: float = 0.0  # what the chunk that sat out left unspent, for the next step's
    # What a long prompt's wait adds to the chunks' share of the time-per-token budget
    # (long_wait_share of it): long decodes do not spend it.
    wait_s: float = 0.0
    chunked: set[str] = field(default_factory=set)  # requests given a long chunk (scheduled, unless preempted)


class LongLane:
    def __init__(
        self,
        config: SchedulerConfig,
        cost: StepCostModel,
        order_key: Callable[[Request, float], tuple],
        block_manager: BlockManager,
    ):
        self.config = config
        self.cost = cost
        self.block_manager = block_manager  # the lane's KV share is of its blocks
        self.order_key = order_key  # the scheduling policy's: which waiting request starts first
        # In (0, 1]: the head-of-line loop lowers it while the short class suffers.
        self.factor = 1.0
        self.last_short_arrival = float("-inf")  # when a request not of the long class last arrived
        self._sat_out: dict[str, int] = {}  # long decodes left out of the last steps: how many in a row
        # Long chunks that sat out the last steps: how many in a row, and the prefill
        # allowance they left unused, which the next step's long chunk may spend.
        self._chunk_skips = 0
        self._chunk_saved_s = 0.0

    def note_arrival(self, request: Request, now: float) -> None:
        if not is_long(request):
            self.last_short_arrival = now

    # ---- one step ----------------------------------------------------------------------

    def begin(self, running: list[Request], waiting: list[Request], now: float) -> Turn:
        """The lane's share of the step about to be scheduled."""
        allowance = self.allowance(running, waiting, now)
        # Long chunks take turns only while shorter requests decode: their time per token
        # pays for each chunk. Else a chunk takes what the allowance covers, and at least
        # MIN_LONG_CHUNK, in every step that allows it any.
        turns = bool(allowance) and any(not is_long(r) and behind(r) == 1 for r in running)
        # A step that starts a shorter request leaves long decodes out (its prefill
        # allowance already decided the chunk); else, while shorter requests decode, long
        # decodes and then long chunks share the short class's time-per-token budget.
        sit_out = self.decodes_sit_out(running, waiting, now)
        tpot_s = None if sit_out else self.short_tpot_budget(running, waiting)
        # The time-per-token budget bounds long chunks less as a long prompt nears its
        # deadline, up to twice the budget from there on: unbound past it, the
        # interactive tenant's tail grew and no long TTFT fell (bench/RESULTS.md). Only
        # where that budget binds: most steps have no long prompt to look for.
        wait_s = self.long_wait_share(running, waiting, now) * tpot_s if tpot_s else 0.0
        return Turn(
            allowance + self._chunk_saved_s if turns else allowance,
            0.0 if sit_out else tpot_s,
            tpot_bound=turns and tpot_s is not None,
            row_floor=tpot_s is not None,
            chunk_turns=turns,
            wait_s=wait_s,
        )

    def decode_order(self, request: Request) -> int:
        """Sort key among decodes: the long decodes that sat out most go first."""
        return -self._sat_out.get(request.request_id, 0)

    def sits_out(self, turn: Turn, request: Request) -> bool:
        """Does a long decode sit this step out? Only when its row does not fit what long
        decodes may still add, it has not sat out long_decode_max_skip steps in a row
        already, and, while shorter requests decode, either it did not sit out the last
        step or another long decode runs in this one: the long class keeps a row a step
        for the decodes that wait, the one that sat out longest first, so that they take
        turns. A long decode that goes uses its row's seconds up."""
        if turn.decode_left is None or not is_long(request) or behind(request) != 1:
            return False
        row_s = self.cost.chunk_seconds(1, request.num_computed_tokens)
        skipped = self._sat_out.get(request.request_id, 0)
        over = turn.decode_left <= 0 or row_s > turn.decode_left
        floor = turn.row_floor and skipped > 0 and not turn.long_rows
        if over and skipped < self.config.long_decode_max_skip and not floor:
            turn.sat_out[request.request_id] = skipped + 1
            return True
        turn.decode_left -= row_s
        return False

    def ran(self, turn: Turn, request: Request, num_tokens: int) -> None:
        """A running request was scheduled num_tokens in this step."""
        if is_long(request) and num_tokens == 1:
            turn.long_rows += 1

    def chunk(self, turn: Turn, request: Request, n: int, context: int) -> int:
        """Tokens for a prefill the budget allows n of, at `context`: n, or for a long
        prefill what the lane's allowance still covers (which the chunk uses up). While
        shorter requests decode, the allowance is also bounded by what the long decode
        rows left of the short class's time-per-token budget (plus what chunks saved),
        and a long chunk it cannot cover at MIN_LONG_CHUNK sits out (up to
        long_prefill_max_skip steps in a row), carrying it over to the next step. The
        first long chunk in policy order to sit out holds the turn: none after it runs in
        that step, or a shallower prompt's chunks could keep a deep one's turn from ever
        coming."""
        if turn.long_left is None or not is_long(request) or request.num_tokens - context <= 1:
            return n
        if turn.chunk_skipped:
            return 0
        limit = n
        floor = not turn.chunk_turns or self._chunk_skips >= self.config.long_prefill_max_skip
        allowance = turn.long_left
        if turn.tpot_bound:
            if turn.tpot_left is None:
                # Forced rows may have overspent the budget: the chunk then has only
                # its savings, and takes its turn by the floor.
                turn.tpot_left = max(0.0, turn.decode_left) + self._chunk_saved_s + turn.wait_s
            allowance = min(allowance, turn.tpot_left)
        if allowance > 0:
            n = self.chunk_tokens(context, allowance, limit, floor)
        else:  # the budget is spent, the prefill allowance is not: the floor, or sit out
            n = min(limit, MIN_LONG_CHUNK) if floor and turn.long_left > 0 else 0
        turn.chunk_skipped = n == 0 and limit > 0 and turn.long_left > 0
        if turn.chunk_skipped:
            turn.carry_s = max(0.0, allowance)
        if n > 0:
            turn.chunked.add(request.request_id)
        spent = self.cost.chunk_seconds(n, context)
        turn.long_left -= spent
        if turn.tpot_left is not None:
            turn.tpot_left -= spent
        return n

    def end(self, turn: Turn, scheduled: dict[str, int], running: list[Request], waiting: list[Request]) -> None:
        """Carries the turn to the next step: which long decodes sat out, how many steps in
        a row long chunks did, and the allowance they left. A chunk that ran, or no long
        prefill left, ends the chunks' turn."""
        self._sat_out = turn.sat_out
        if not turn.chunk_skipped and not self._chunk_skips:
            return  # no turn under way (most steps): nothing to carry or end
        if any(rid in scheduled for rid in turn.chunked) or not any(
            is_long(r) and behind(r) > 1 for r in (*running, *waiting)
        ):
            self._chunk_skips, self._chunk_saved_s = 0, 0.0
        elif turn.chunk_skipped:
            self._chunk_skips, self._chunk_saved_s = self._chunk_skips + 1, turn.carry_s
        # Else no long chunk was tried (the step starts a shorter request, or the budget
        # ran out before one): the turn waits as it was.

    # ---- the lane's limits ---------------------------------------------------------------

    def admits(self, request: Request, running: list[Request]) -> bool:
        """May a waiting request start now, given its lane's limits?"""
        if not is_long(request) or not self.config.long_lane:
            return True
        longs = [r for r in running if is_long(r)]
        cap = self.config.long_max_running
        if cap is not None and len(longs) >= cap:
            return False
        if self.config.long_kv_share < 1.0:
            # What running longs will hold once their prompts are in, not what they hold
            # part-way through a chunked prefill.
            block_manager = self.block_manager
            held = sum(block_manager.blocks_needed(r.num_tokens) for r in longs)
            needed = block_manager.blocks_needed(request.num_tokens)
            if held + needed > self.config.long_kv_share * block_manager.num_blocks:
                return False
        return True

    def allowance(self, running: list[Request], waiting: list[Request], now: float) -> float | None:
        """What long prefill chunks may add to the next step, in seconds (None: no limit)."""
        # Most steps have no long prompt to chunk: skip the cost-model fit they would not use.
        if not any(is_long(r) for r in (*running, *waiting)):
            return None
        decodes = [r.num_computed_tokens for r in running if behind(r) == 1]
        return self.prefill_allowance(running, waiting, now, self.cost.decodes_seconds(decodes))

    def prefill_allowance(
        self, running: list[Request], waiting: list[Request], now: float, base_s: float = 0.0
    ) -> float | None:
        """Seconds that long-class prefill chunks may add to this step (None: no limit).

        A short request meets at most two steps before its first token: the one running
        when it arrives and its own. Its own step carries no long chunk, unless the long
        request has reached its deadline (long_wait_share). The one it arrives during may
        carry a quarter of the short class's TTFT target, or a quarter of what the step
        costs without it (base_s) where a step is already slower than the target,
        whichever is more. The head-of-line loop scales that down while the short class
        still suffers; the floor keeps the long class moving even then: it is the share of
        its deadline that the furthest-gone long prompt the lane admits has waited
        (long_wait_share), the whole allowance at the deadline.

        With no shorter request present the chunk is bounded all the same (by the full
        allowance, without the loop's scaling): one arriving during the step waits for all
        of it, and one unbounded chunk alone can set the short class's p99 TTFT
        (bench/RESULTS.md). Where no shorter request has arrived for long_lane_quiet_s,
        long work alone runs near full speed: a chunk may take the whole TTFT target, or
        what half of the step's token budget costs at the deepest long prompt's context
        where that is more (a slow machine), no more. The first short request after a
        quiet spell arrives during such a chunk, and a whole-budget chunk (512 tokens,
        dearer on an adapter) set the p99 TTFT of a tenant whose first requests met
        another's first prompt."""
        config = self.config
        if not config.long_lane:
            return None
        full = max(config.short_ttft_target_s / 4, LONG_STEP_STRETCH * base_s)
        if not any(not is_long(r) for r in (*running, *waiting)):
            # Nobody to protect now; one may arrive during the step, and wait for all of it.
            if now - self.last_short_arrival < config.long_lane_quiet_s:
                return full
            deepest = max(
                (r.num_computed_tokens for r in (*running, *waiting) if is_long(r) and behind(r) > 1), default=0
            )
            least = self.cost.chunk_seconds(int(QUIET_MIN_BUDGET_SHARE * config.max_num_batched_tokens), deepest)
            return max(full, config.short_ttft_target_s, least)
        floor = self.long_wait_share(running, waiting, now)
        if any(not is_long(r) for r in waiting):
            # A shorter request starts in this step: its first token comes at the step's
            # end, so a long chunk here would be paid in full by its TTFT. None, until the
            # long request reaches its deadline: a chunk deep in a long context
            # pays attention's gather of the whole context however few its tokens.
            return full if floor >= 1.0 else 0.0
        return full * max(floor, self.factor)

    def long_wait_share(self, running: list[Request], waiting: list[Request], now: float) -> float:
        """How far the long prompts still waiting for their first token are into their
        deadlines, the furthest (0 to 1). A prompt's deadline is long_ttft_target_s, or
        sooner LONG_DEADLINE_ALONE times what its prefill (past any cached prefix) is
        predicted to add to a step: a long prompt's TTFT should stay within a small
        multiple of what it would be on its own, not just within a target set for the
        longest prompts. A preempted request recomputing its prompt has had its first
        token, and has no deadline. A waiting prompt counts only where the lane would
        admit it now: one held back by long_max_running or long_kv_share gets no chunk
        whatever its share, and counting it would spend the short class's budget on the
        running prompt's chunks for it (and lift the head-of-line loop's scaling). One
        that waits only for a seat (max_num_seqs) or free blocks still counts: those free
        up as requests finish, the lane's limits do not."""
        target = self.config.long_ttft_target_s
        share = 0.0
        admitted = [r for r in waiting if is_long(r) and self.admits(r, running)]
        for r in (*running, *admitted):
            if is_long(r) and behind(r) > 1 and r.first_token_time is None:
                cached = r.num_cached_tokens
                alone = LONG_DEADLINE_ALONE * self.cost.chunk_seconds(r.num_prompt_tokens - cached, cached)
                deadline = min(target, alone) if alone > 0 else target
                share = max(share, (now - r.arrival_time) / deadline)
        return min(1.0, share)

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
        more than long_prefill_max_skip steps in a row). The chunks get as much again times
        long_wait_share (begin)."""
        if not self.config.long_lane or not any(is_long(r) for r in (*running, *waiting)):
            return None
        shorts = [r.num_computed_tokens for r in running if not is_long(r) and behind(r) == 1]
        if not shorts or not self.cost.ready:
            return None
        return self.config.short_tpot_stretch * self.cost.decodes_seconds(shorts)

    def decodes_sit_out(self, running: list[Request], waiting: list[Request], now: float) -> bool:
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
        longs = sum(1 for r in running if is_long(r))
        if not longs or not self.config.long_lane or len(running) >= self.config.max_num_seqs:
            return False
        admissible = [r for r in waiting if self.admits(r, running)]
        if not admissible:
            return False
        head = min(admissible, key=lambda r: self.order_key(r, now))
        blocks = self.block_manager
        return not is_long(head) and blocks.blocks_needed(head.num_tokens) + longs <= blocks.num_free_blocks

    def chunk_tokens(self, context: int, allowance_s: float, limit: int, floor: bool = True) -> int:
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
    """Moves LongLane.factor (through set_factor) by the head-of-line signal."""

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
