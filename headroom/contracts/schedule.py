"""One engine step as the scheduler hands it to the executor: the one contract between the
runtime and what runs the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from headroom.contracts.request import Request


class BlockTables(Protocol):
    """Where a request's KV blocks are: the block manager, as the executor reads it."""

    def block_table(self, request_id: str) -> list[int]: ...


@dataclass
class SchedulerOutput:
    # Batch order: decodes first. num_scheduled_tokens[i] belongs to requests[i].
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)
    attention_pairs: int = 0  # (query, key) pairs the step computes, for the step-cost model
    decode_pairs: int = 0  # those of them its decode rows compute
    # Guessed tokens (runtime/speculation.py), by request id: such a decode row is scheduled
    # 1 + len(guesses) tokens, its last token and the guesses after it.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Seconds a draft model's forwards took to guess them (runtime/drafter.py): part of the
    # step's wall time, not of the target's step cost.
    draft_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests
