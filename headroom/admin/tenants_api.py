"""Admin handlers for tenants (live limits) and the length predictor (live reload)."""

from __future__ import annotations

import asyncio
import logging

import lightgbm as lgb
from aiohttp import web

from headroom.admin.schemas import ReloadBody, TenantPatch, Unprocessable, parse
from headroom.admission.tenants import Tenant
from headroom.app import keys
from headroom.app.errors import Conflict, NotFound
from headroom.config import ConfigError
from headroom.prediction.predictor import FallbackPredictor, load_predictor

log = logging.getLogger("headroom.admin")


def tenant_json(tenant: Tenant) -> dict:
    c, bucket = tenant.config, tenant.bucket
    return {
        "name": c.name,
        "tier": c.tier,
        "priority": tenant.priority,
        "rate_tokens_per_s": bucket.rate,
        "burst_tokens": bucket.burst,
        "max_in_flight_tokens": bucket.max_in_flight_tokens,
        "max_queue": c.max_queue,
        "max_wait_s": c.max_wait_s,
        "max_tokens": c.max_tokens,
        "max_model_len": c.max_model_len,
        "bucket_level": bucket.level,
        "in_flight_tokens": bucket.in_flight,
        "waiting": len(tenant.queue),
        "virtual_tokens": tenant.vtc,
        "engine_seconds": tenant.device_s,
    }


async def list_tenants(request: web.Request) -> web.Response:
    registry = request.config_dict[keys.GATE].registry
    return web.json_response({"object": "list", "data": [tenant_json(t) for t in registry]})


async def patch_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    gate = request.config_dict[keys.GATE]
    if gate.registry.get(name) is None:
        raise NotFound(f"no tenant {name!r}", param="name", code="tenant_not_found")
    body = await parse(request, TenantPatch)
    changes = body.model_dump(exclude_none=True)
    try:
        tenant = gate.registry.update(name, **changes)
    except (ConfigError, ValueError) as exc:
        raise Unprocessable(str(exc), code="invalid_body") from None
    if gate.admission is not None:
        gate.admission.pump()  # raised limits admit waiters now, not at the next tick
    log.info("admin action", extra={"action": "patch_tenant", "tenant": name, "changes": changes})
    return web.json_response(tenant_json(tenant))


async def reload_predictor(request: web.Request) -> web.Response:
    gate = request.config_dict[keys.GATE]
    if gate.admission is None:
        raise Conflict("admission is off: there is no predictor to reload", code="admission_off")
    body = await parse(request, ReloadBody, optional=True)
    path = body.path or gate.config.predictor_path
    try:
        predictor = await asyncio.get_running_loop().run_in_executor(None, load_predictor, path)
    except (OSError, ValueError, KeyError, lgb.basic.LightGBMError) as exc:
        raise Unprocessable(
            f"cannot load a predictor from {path!r}: {exc}", param="path", code="predictor_load_failed"
        ) from None
    gate.predictor = predictor  # one reference swap: requests in flight keep the model they used
    request.config_dict[keys.OBSERVABILITY].predictor_health.clear()  # the old model's predictions
    fallback = isinstance(predictor, FallbackPredictor)
    meta = {} if fallback else predictor.meta
    log.info(
        "admin action", extra={"action": "reload_predictor", "path": path or "packaged default", "fallback": fallback}
    )
    return web.json_response(
        {"path": path, "fallback": fallback, "trained_at": meta.get("trained_at"), "metrics": meta.get("metrics")}
    )
