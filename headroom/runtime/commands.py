"""What other threads ask of the engine thread: each a small typed message queued in the
engine's inbox and applied, in order, at the start of the next step."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from headroom.contracts.request import Request
from headroom.runtime.outputs import OutputSink, SequenceSnapshot


@dataclass(frozen=True)
class Add:
    request: Request
    sink: OutputSink


@dataclass(frozen=True)
class Abort:
    request_id: str
    cause: str


@dataclass(frozen=True)
class Control:
    """An operator's (or a policy's) action on a live sequence; the future gets its
    snapshot as the action took effect, or UnknownSequence / SequenceFinished."""

    request_id: str
    action: str  # abort | deprioritize | cap
    args: dict[str, Any] = field(default_factory=dict)
    future: Future[SequenceSnapshot] = field(default_factory=Future)


@dataclass(frozen=True)
class SetLongLaneFactor:
    factor: float


@dataclass(frozen=True)
class UnloadLora:
    """Drop a LoRA adapter between two steps; refused (LoraInUse) while a sequence the
    engine holds runs under it, so no step ever lacks an adapter it was given."""

    name: str
    future: Future[None] = field(default_factory=Future)


@dataclass(frozen=True)
class WarmLora:
    """Write a LoRA adapter loaded at run time into the slots between two steps, so that
    the first step under it allocates nothing."""

    uid: int


Command = Add | Abort | Control | SetLongLaneFactor | UnloadLora | WarmLora
