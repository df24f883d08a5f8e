"""Automatic policies: act on a sequence, as an operator would, when it runs past a
wall-clock budget, holds too much of the KV pool, has produced far more than was
predicted, or is predicted in flight to run to its cap. All are off unless configured
([admin] max_wall_s, max_kv_share, max_predicted_ratio, max_runaway_probability); the
action (abort or deprioritize) goes through the same engine command as the admin API's,
so it is logged and recorded on the sequence's span."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from headroom.config import AdminConfig
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import EngineSnapshot, SequenceFinished, UnknownSequence

log = logging.getLogger("headroom.admin")


@dataclass(frozen=True)
class Violation:
    request_id: str
    rule: str  # what it broke, for the log and the span
    runaway: bool = False  # the in-flight probe's rule: deprioritize moves it to the long lane


def violations(config: AdminConfig, snapshot: EngineSnapshot) -> list[Violation]:
    found = []
    for s in snapshot.sequences:
        if s.deprioritized and config.policy_action == "deprioritize":
            continue  # already acted on
        if config.max_wall_s is not None and s.age_s > config.max_wall_s:
            found.append(Violation(s.request_id, f"ran {s.age_s:.1f}s, over the {config.max_wall_s:g}s budget"))
        elif config.max_kv_share is not None and s.kv_share > config.max_kv_share:
            found.append(Violation(s.request_id, f"holds {s.kv_share:.0%} of the KV pool, over "
                                                 f"{config.max_kv_share:.0%}"))
        elif (config.max_predicted_ratio is not None and s.predicted_output_tokens
              and s.output_tokens > config.max_predicted_ratio * s.predicted_output_tokens):
            found.append(Violation(s.request_id, f"{s.output_tokens} output tokens, over "
                                                 f"{config.max_predicted_ratio:g}x the predicted "
                                                 f"{s.predicted_output_tokens:.0f}"))
        elif (config.max_runaway_probability is not None and s.runaway_probability is not None
              and s.runaway_probability >= config.max_runaway_probability):
            found.append(Violation(s.request_id, f"predicted to run to its {s.max_tokens}-token cap "
                                                 f"(p={s.runaway_probability:.2f} at {s.output_tokens} tokens)",
                                   runaway=True))
    return found


def enabled(config: AdminConfig) -> bool:
    return any(v is not None for v in (config.max_wall_s, config.max_kv_share, config.max_predicted_ratio,
                                       config.max_runaway_probability))


async def enforce(config: AdminConfig, engine: Engine) -> None:
    """Check every policy_interval_s until cancelled."""
    while True:
        await asyncio.sleep(config.policy_interval_s)
        for v in violations(config, engine.snapshot()):
            try:
                extra = {"long_lane": True, "inflight": True} if v.runaway else {}
                await asyncio.wrap_future(engine.control(v.request_id, config.policy_action, by="policy",
                                                         reason=v.rule, **extra))
            except (UnknownSequence, SequenceFinished):
                continue  # it finished on its own meanwhile
            log.warning("policy %s on %s: %s", config.policy_action, v.request_id, v.rule,
                        extra={"sequence": v.request_id, "action": config.policy_action})
