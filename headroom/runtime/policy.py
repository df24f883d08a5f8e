"""Who goes first and who is preempted: the scheduler's policy, kept apart from its
mechanics.

Order: tier priority first; within a tier, the requests whose first token has a due time
(the gateway's TTFT objective) and has not come yet, earliest due first; then the others,
predicted-shortest-remaining first with ageing (the
estimated remaining output tokens, the length probe's once it has seen a sequence
run, minus ageing_tokens_per_s per second waited, so nothing starves; without
predictions that is FCFS). Victims: lowest priority, then the longest estimated
remaining, then the newest. How much of each step long work gets is the long lane's
call (lane.py).
"""

from __future__ import annotations

from collections import Counter

from headroom.config import SchedulerConfig
from headroom.contracts.request import Request


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        # Decisions the length probe's estimate changed: order, victim, long_lane.
        self.probe_decisions: Counter[str] = Counter()

    def order_key(self, request: Request, now: float, probed: bool = True) -> tuple:
        waited = now - request.arrival_time
        rank = (request.estimated_remaining_tokens(probed) or 0.0) - self.config.ageing_tokens_per_s * waited
        due = request.admission.first_token_due if request.first_token_time is None else None
        return (*request.priority.first(), due is None, due or 0.0, rank, request.submit_order)

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
            any(r.estimate.remaining_tokens is not None for r in victims)
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
            and any(r.estimate.remaining_tokens is not None for r in waiting)
            and min(waiting, key=lambda r: self.order_key(r, now, probed=False)) is not first
        ):
            self.probe_decisions["order"] += 1
