"""Admin request bodies (pydantic, unknown fields refused; a bad body is a 422) and the
JSON of a sequence."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from headroom.app.errors import APIError
from headroom.runtime.outputs import SequenceSnapshot

# GET /admin/sequences?sort=: the orders it takes (and `headroom top --sort`), costliest first.
SORTS = ("cost", "kv_blocks", "kv_block_seconds", "age", "output_tokens", "progress")


class Unprocessable(APIError):
    status = 422
    type = "invalid_request_error"


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AbortBody(Body):
    reason: Annotated[str, Field(max_length=500)] | None = None


class DeprioritizeBody(Body):
    long_lane: bool = False  # also move it to the long lane (its own concurrency and KV share)


class CapBody(Body):
    max_tokens: Annotated[int, Field(ge=1)]


class TenantPatch(Body):
    tier: str | None = None
    rate_tokens_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    burst_tokens: Annotated[int, Field(ge=1)] | None = None
    max_in_flight_tokens: Annotated[int, Field(ge=1)] | None = None


class ReloadBody(Body):
    path: str | None = None  # a predictor directory; None: the configured one (or the packaged default)


def sequence_json(s: SequenceSnapshot) -> dict:
    return {
        "id": s.request_id,
        "tenant": s.tenant,
        "lora": s.lora,
        "tier": s.tier,
        "size_class": s.size_class,
        "state": s.status,
        "priority": -s.priority.value,  # the request's own, as the client sent it (after its tenant's clamp)
        "tier_priority": s.priority.tier,
        "deprioritized": s.deprioritized,
        "prompt_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "max_tokens": s.max_tokens,
        "predicted_output_tokens": s.predicted_output_tokens,
        "progress": s.progress,
        "kv_blocks": s.blocks_held,
        "kv_share": s.kv_share,
        "device_time_s": s.device_time_s,
        "device_share": s.device_share,
        "kv_block_seconds": s.kv_block_seconds,
        "tokens_processed": s.tokens_processed,
        "preemptions": s.preemptions,
        "age_s": s.age_s,
        "ttft_s": s.ttft_s,
        "budget_left_s": s.budget_left_s,
        "admin_actions": list(s.admin_actions),
        "predicted_remaining_tokens": s.predicted_remaining_tokens,
        "runaway_probability": s.runaway_probability,
        "runaway_flagged_at": s.runaway_flagged_at,
        "loop_period": s.loop_period,
        "loop_detected_at": s.loop_detected_at,
    }


async def parse(request: web.Request, model: type[Body], optional: bool = False) -> Body:
    """The request's JSON body as `model`; an empty body is `{}` when `optional`."""
    raw = await request.read()
    if optional and not raw.strip():
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"] if where is None else f"{where}: {first['msg']}"
        raise Unprocessable(message, param=where, code="invalid_body") from None
