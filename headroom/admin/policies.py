"""Automatic policies: act on a sequence, as an operator would, when it runs past a
wall-clock budget, holds too much of the KV pool, has produced far more than was
predicted, is predicted by the length probe to run to its cap, or (where a ladder is set) was found
looping by the engine's detector. All are off unless configured ([admin] max_age_s,
max_kv_share, max_predicted_ratio, max_runaway_probability, ladder). The action
(deprioritize, cap or abort) goes through the same engine command as the admin API's, so
it is logged and recorded on the sequence's span. With a ladder (server-wide, or a
tenant's) a sequence that keeps violating climbs it: deprioritize first, say, then cap,
then abort, each step ladder_step_s after the last; without one it gets policy_action
once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headroom.config import AdminConfig, TenantConfig
from headroom.runtime.outputs import (
    EngineSnapshot,
    SequenceFinished,
    SequenceSnapshot,
    UnknownSequence,
)

if TYPE_CHECKING:
    from headroom.app.engine_client import AsyncEngine

log = logging.getLogger("headroom.admin")


@dataclass(frozen=True)
class Violation:
    request_id: str
    rule: str  # what it broke, for the log and the span
    runaway: bool = False  # the length probe's rule: deprioritize moves it to the long lane


def violations(config: AdminConfig, snapshot: EngineSnapshot) -> list[Violation]:
    found = []
    for s in snapshot.sequences:
        if s.deprioritized and config.policy_action == "deprioritize" and not ladder_of(config, s):
            continue  # already acted on (a ladder keeps its own count)
        if config.max_age_s is not None and s.age_s > config.max_age_s:
            found.append(Violation(s.request_id, f"ran {s.age_s:.1f}s, over the {config.max_age_s:g}s budget"))
        elif config.max_kv_share is not None and s.kv_share > config.max_kv_share:
            found.append(
                Violation(s.request_id, f"holds {s.kv_share:.0%} of the KV pool, over {config.max_kv_share:.0%}")
            )
        elif (
            config.max_predicted_ratio is not None
            and s.predicted_output_tokens
            and s.output_tokens > config.max_predicted_ratio * s.predicted_output_tokens
        ):
            found.append(
                Violation(
                    s.request_id,
                    f"{s.output_tokens} output tokens, over "
                    f"{config.max_predicted_ratio:g}x the predicted "
                    f"{s.predicted_output_tokens:.0f}",
                )
            )
        elif (
            config.max_runaway_probability is not None
            and s.runaway_probability is not None
            and s.runaway_probability >= config.max_runaway_probability
        ):
            found.append(
                Violation(
                    s.request_id,
                    f"predicted to run to its {s.max_tokens}-token cap "
                    f"(p={s.runaway_probability:.2f} at {s.output_tokens} tokens)",
                    runaway=True,
                )
            )
        elif (
            s.loop_detected_at is not None and ladder_of(config, s) and (s.loop_policy or config.loop_policy) == "flag"
        ):
            found.append(
                Violation(
                    s.request_id,
                    f"loops: a {s.loop_period}-token pattern repeating since {s.loop_detected_at} output tokens",
                )
            )
    return found


def ladder_of(config: AdminConfig, s: SequenceSnapshot) -> tuple[str, ...]:
    return config.ladder if s.ladder is None else s.ladder


def enabled(config: AdminConfig, tenants: tuple[TenantConfig, ...] = ()) -> bool:
    return (
        bool(config.ladder)
        or any(t.ladder for t in tenants)
        or any(
            v is not None
            for v in (
                config.max_age_s,
                config.max_kv_share,
                config.max_predicted_ratio,
                config.max_runaway_probability,
            )
        )
    )


@dataclass
class Ladder:
    """Where each live sequence stands: the policy steps it has taken, and when the last."""

    config: AdminConfig
    taken: dict[str, tuple[int, float]] = field(default_factory=dict)

    def next_action(self, v: Violation, s: SequenceSnapshot, now: float) -> str | None:
        """The action v earns now, or None: its sequence was acted on too recently, or has
        taken every step it may."""
        steps = ladder_of(self.config, s) or (self.config.policy_action,)
        done, last = self.taken.get(v.request_id, (0, 0.0))
        if done >= len(steps) or (done and now - last < self.config.ladder_step_s):
            return None
        return steps[done]

    def took(self, request_id: str, now: float) -> None:
        done, _ = self.taken.get(request_id, (0, 0.0))
        self.taken[request_id] = (done + 1, now)

    def forget_all_but(self, live: set[str]) -> None:
        for request_id in self.taken.keys() - live:
            del self.taken[request_id]


async def enforce(config: AdminConfig, engine: AsyncEngine) -> None:
    """Check every policy_interval_s until cancelled."""
    ladder = Ladder(config)
    while True:
        await asyncio.sleep(config.policy_interval_s)
        snapshot = engine.snapshot()
        by_id = {s.request_id: s for s in snapshot.sequences}
        ladder.forget_all_but(set(by_id))
        for v in violations(config, snapshot):
            s = by_id[v.request_id]
            action = ladder.next_action(v, s, snapshot.taken_at)
            if action is None:
                continue
            if action == "deprioritize" and s.deprioritized:
                ladder.took(v.request_id, snapshot.taken_at)  # an operator was there first
                continue
            args: dict = {"by": "policy", "reason": v.rule}
            if action == "deprioritize" and v.runaway:
                args |= {"long_lane": True, "probe": True}
            elif action == "cap":
                args["max_tokens"] = s.output_tokens + config.cap_tokens
            try:
                await engine.control(v.request_id, action, **args)
            except (UnknownSequence, SequenceFinished):
                continue  # it finished on its own meanwhile
            ladder.took(v.request_id, snapshot.taken_at)
            log.warning(
                "policy %s on %s: %s", action, v.request_id, v.rule, extra={"sequence": v.request_id, "action": action}
            )
