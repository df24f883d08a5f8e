"""Actions on a live sequence, by an operator (the admin API), an automatic policy or the
loop detector: what each changes on the request, and the line it adds to the request's
record (`admin_actions`, shown in /admin/sequences and on its span). The engine applies
them on its thread (apply, check_loops, enforce_deadlines, under its state lock) and
finishes the sequence where one says so."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from headroom.config import ACTIONS
from headroom.contracts.request import Request, RequestStatus, SizeClass
from headroom.runtime.loops import Finding, LoopWatch
from headroom.runtime.output_processor import OutputProcessor
from headroom.runtime.outputs import (
    EngineStats,
    SequenceFinished,
    SequenceSnapshot,
    UnknownSequence,
)
from headroom.runtime.scheduler import Scheduler
from headroom.runtime.stats import sequence_snapshot

log = logging.getLogger(__name__)


def abort(request: Request, by: str, reason: str | None) -> None:
    """Record an abort; the engine then aborts the request."""
    reason = reason or "no reason given"
    request.admin_actions.append(f"abort by {by}: {reason}")
    request.stop_reason = f"aborted by {by}: {reason}"


def deprioritize(request: Request, by: str, reason: str | None = None, long_lane: bool = False) -> None:
    request.priority = request.priority._replace(kept=0)  # below every tier: runs last, preempted first
    if long_lane:
        request.moved_to = SizeClass.LONG
    lane = " to the long lane" if long_lane else ""
    request.admin_actions.append(f"deprioritize by {by}{lane}{f': {reason}' if reason else ''}")


def cap(request: Request, max_tokens: int, record: str) -> bool:
    """Lower the request's max_tokens (never raise it); True when it has reached it already."""
    request.max_tokens_cap = max_tokens if request.max_tokens_cap is None else min(max_tokens, request.max_tokens_cap)
    request.admin_actions.append(record)
    return request.num_output_tokens >= request.max_tokens


def on_loop(request: Request, finding: Finding, cap_tokens: int) -> RequestStatus | None:
    """What the loop policy's finding does; the status to finish the request with, if any."""
    if finding.action == "stop":
        request.admin_actions.append(f"stop by loop detector: {finding.what}")
        request.stop_reason = "loop_detected"
        return RequestStatus.FINISHED_REPETITION
    if finding.action == "cap":
        limit = request.num_output_tokens + cap_tokens
        request.stop_reason = "loop_detected"  # what a finish at the cap reports; a stop replaces it
        if cap(request, limit, f"cap by loop detector at {limit} tokens: {finding.what}"):
            return RequestStatus.FINISHED_LENGTH
        return None
    if finding.action == "close":
        request.admin_actions.append(f"close the value by loop detector: {finding.what}")
        return None
    request.admin_actions.append(f"flag by loop detector: {finding.what}")
    return None


def apply(
    request_id: str,
    action: str,
    args: dict[str, Any],
    scheduler: Scheduler,
    outputs: OutputProcessor,
    stats: EngineStats,
) -> SequenceSnapshot:
    """An operator's or a policy's action on a live sequence; its snapshot as the action
    took effect. Raises SequenceFinished or UnknownSequence where there is none."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    request = scheduler.requests.get(request_id)
    if request is None:
        if request_id in outputs.finished:
            raise SequenceFinished(request_id, outputs.finished[request_id])
        raise UnknownSequence(request_id)
    by = args.get("by", "admin")
    if args.get("probe"):
        scheduler.policy.probe_decisions["policy"] += 1
    if by == "policy":
        stats.policy_actions[action] += 1
    if action == "abort":
        abort(request, by, args.get("reason"))
        snapshot = sequence_snapshot(request, time.monotonic(), stats.step_time_s, scheduler.block_manager)
        outputs.abort(request_id, by, stats)
    elif action == "deprioritize":
        deprioritize(request, by, args.get("reason"), bool(args.get("long_lane")))
        snapshot = sequence_snapshot(request, time.monotonic(), stats.step_time_s, scheduler.block_manager)
    elif action == "cap":
        limit = int(args["max_tokens"])
        reached = cap(request, limit, f"cap by {by} at {limit} tokens")
        snapshot = sequence_snapshot(request, time.monotonic(), stats.step_time_s, scheduler.block_manager)
        if reached:
            request.stop_reason = f"capped by {by} at {limit} tokens"
            outputs.close(request_id, RequestStatus.FINISHED_LENGTH, stats)
    log.info("%s on %s: %s", action, request_id, request.admin_actions[-1])
    return snapshot


def loop_check(loops: LoopWatch, found: list[tuple[Request, Finding]]) -> Callable[[Request], bool]:
    """The loop detector, for the scheduler to run after each token it appends to a live
    sequence: True where it finds a loop (the step's later tokens for that sequence are
    dropped, so a finding comes at the token it would one token a step); the findings
    collect in `found`, for act_on_loops."""

    def check(request: Request) -> bool:
        finding = loops.check(request)
        if finding is not None:
            found.append((request, finding))
        return finding is not None

    return check


def act_on_loops(
    found: list[tuple[Request, Finding]], loops: LoopWatch, scheduler: Scheduler, stats: EngineStats
) -> None:
    """Apply the loop detector's findings of a step; one that stops a sequence finishes it
    in the scheduler before its tokens go out."""
    for request, finding in found:
        stats.loops[finding.action] += 1
        status = on_loop(request, finding, loops.cap_tokens)
        if status is not None:
            scheduler.finish_request(request.request_id, status)
        log.warning(
            "loop %s on %s: %s",
            finding.action,
            request.request_id,
            finding.what,
            extra={"sequence": request.request_id, "action": finding.action},
        )


def enforce_deadlines(scheduler: Scheduler, outputs: OutputProcessor, stats: EngineStats) -> None:
    """Finish, as length, every request past its wall-clock budget."""
    now = time.monotonic()
    late = [r for r in scheduler.requests.values() if r.deadline is not None and now > r.deadline]
    for request in late:
        log.warning(
            "request %s exceeded its wall-clock budget after %.1fs (%d output tokens); finishing it as length",
            request.request_id,
            now - request.arrival_time,
            request.num_output_tokens,
        )
        request.stop_reason = request.abort_cause = "wall_clock_budget"
        stats.aborts["wall_clock_budget"] += 1
        outputs.close(request.request_id, RequestStatus.FINISHED_LENGTH, stats)
