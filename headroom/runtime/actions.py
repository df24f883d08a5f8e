"""Actions on a live sequence, by an operator (the admin API), an automatic policy or the
loop detector: what each changes on the request, and the line it adds to the request's
record (`admin_actions`, shown in /admin/sequences and on its span). The engine applies
them on its thread and finishes the sequence where one says so."""

from __future__ import annotations

from headroom.runtime.loops import Finding
from headroom.runtime.request import Request, RequestStatus

DEPRIORITIZED = -(2**31)  # below every tier: runs last, preempted first


def abort(request: Request, by: str, reason: str | None) -> None:
    """Record an abort; the engine then aborts the request."""
    reason = reason or "no reason given"
    request.admin_actions.append(f"abort by {by}: {reason}")
    request.stop_reason = f"aborted by {by}: {reason}"


def deprioritize(request: Request, by: str, reason: str | None = None, long_lane: bool = False) -> None:
    request.priority = DEPRIORITIZED
    request.deprioritized = True
    if long_lane:
        request.size_class = "long"
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
    request.admin_actions.append(f"flag by loop detector: {finding.what}")
    return None
