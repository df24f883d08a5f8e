"""The operator's API, a sub-app under /admin/ with its own bearer token.

A sequence is named by the id its client saw in the response's `id` field. Actions go
to the engine as commands applied at the start of its next step, and each handler
answers once the action has taken effect, so an abort's blocks are already free when
the 200 arrives. Every action is logged and recorded on the sequence (its span carries
them in `headroom.admin_actions`).
"""

from __future__ import annotations

import asyncio
import base64
import csv
import dataclasses
import datetime
import functools
import hashlib
import hmac
import io
import logging
import os
import time
from importlib import resources

from aiohttp import web

from headroom.admin.schemas import SORTS, AbortBody, CapBody, DeprioritizeBody, parse, sequence_json
from headroom.admin.tenants_api import list_tenants, patch_tenant, reload_predictor
from headroom.app import keys
from headroom.app.auth import bearer, digest
from headroom.app.errors import BadRequest, Conflict, Forbidden, NotFound, Unauthorized
from headroom.config import Config
from headroom.observability.ledger import OUTCOMES, SUMS
from headroom.runtime.outputs import SequenceFinished, UnknownSequence

log = logging.getLogger("headroom.admin")

TOKEN_ENV = "HEADROOM_ADMIN_TOKEN"
TOKEN_DIGEST = web.AppKey("admin_token_digest", bytes)
SORT_KEYS = {
    "cost": lambda s: s.device_time_s,  # engine seconds used so far
    "kv_blocks": lambda s: s.blocks_held,
    "kv_block_seconds": lambda s: s.kv_block_seconds,
    "age": lambda s: s.age_s,
    "output_tokens": lambda s: s.output_tokens,
    "progress": lambda s: s.progress or 0.0,
}
assert tuple(SORT_KEYS) == SORTS


def admin_token(config: Config) -> str | None:
    return config.admin.token or os.environ.get(TOKEN_ENV) or None


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if request.path == "/admin/ui" and request.method == "GET":
        return await handler(request)  # the static page; everything it shows needs the token
    given = bearer(request)
    # Digests of equal length, so the comparison's time says nothing about the token.
    if given and hmac.compare_digest(digest(given), request.app[TOKEN_DIGEST]):
        return await handler(request)
    if given and request.config_dict[keys.GATE].registry.by_api_key(given) is not None:
        raise Forbidden("tenant API keys cannot use the admin API", code="admin_forbidden")
    raise Unauthorized("the admin API needs its bearer token", code="invalid_admin_token")


def create_admin_app(token: str) -> web.Application:
    admin = web.Application(middlewares=[auth_middleware])
    admin[TOKEN_DIGEST] = digest(token)
    admin.router.add_get("/sequences", list_sequences)
    admin.router.add_get("/sequences/{id}", get_sequence)
    admin.router.add_post("/sequences/{id}/abort", abort)
    admin.router.add_post("/sequences/{id}/deprioritize", deprioritize)
    admin.router.add_post("/sequences/{id}/cap", cap)
    admin.router.add_get("/tenants", list_tenants)
    admin.router.add_patch("/tenants/{name}", patch_tenant)
    admin.router.add_post("/predictor/reload", reload_predictor)
    admin.router.add_get("/stats", stats)
    admin.router.add_get("/usage", usage)
    admin.router.add_get("/ui", ui)
    return admin


async def list_sequences(request: web.Request) -> web.Response:
    sort = request.query.get("sort", "cost")
    if sort not in SORT_KEYS:
        raise BadRequest(f"sort must be one of {', '.join(SORT_KEYS)}", param="sort", code="invalid_value")
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 10_000:
        raise BadRequest("limit must be an integer in [1, 10000]", param="limit", code="invalid_value")
    snapshot = request.config_dict[keys.ENGINE].snapshot()
    ordered = sorted(snapshot.sequences, key=SORT_KEYS[sort], reverse=True)[:limit]
    return web.json_response(
        {
            "object": "list",
            "sort": sort,
            "taken_at": time.time(),
            "kv_blocks_total": snapshot.num_blocks,
            "kv_blocks_used": snapshot.used_blocks,
            "running": snapshot.running,
            "waiting": snapshot.waiting,
            "data": [sequence_json(s) for s in ordered],
        }
    )


async def get_sequence(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    for s in request.config_dict[keys.ENGINE].snapshot().sequences:
        if s.request_id == rid:
            return web.json_response(sequence_json(s))
    raise NotFound(f"no live sequence {rid!r}", param="id", code="sequence_not_found")


async def act(request: web.Request, action: str, **args) -> web.Response:
    rid = request.match_info["id"]
    try:
        before = await request.config_dict[keys.ENGINE].control(rid, action, by="admin", **args)
    except UnknownSequence:
        raise NotFound(f"no live sequence {rid!r}", param="id", code="sequence_not_found") from None
    except SequenceFinished as exc:
        raise Conflict(str(exc), param="id", code="sequence_finished") from None
    log.info(
        "admin action",
        extra={
            "action": action,
            "sequence": rid,
            "action_args": args,
            "tenant": before.tenant,
            "device_time_s": before.device_time_s,
        },
    )
    return web.json_response({"id": rid, "action": action, "sequence": sequence_json(before)})


async def abort(request: web.Request) -> web.Response:
    body = await parse(request, AbortBody, optional=True)
    return await act(request, "abort", reason=body.reason)


async def deprioritize(request: web.Request) -> web.Response:
    body = await parse(request, DeprioritizeBody, optional=True)
    return await act(request, "deprioritize", long_lane=body.long_lane)


async def cap(request: web.Request) -> web.Response:
    body = await parse(request, CapBody)
    return await act(request, "cap", max_tokens=body.max_tokens)


def _instant(request: web.Request, name: str, default: float) -> float:
    """A query parameter as unix seconds: a number, or an ISO 8601 time (UTC if no zone)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(
            f"{name} must be unix seconds or an ISO 8601 time, got {raw!r}", param=name, code="invalid_value"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


async def usage(request: web.Request) -> web.Response:
    """Per-tenant totals from the usage ledger over [since, until), as JSON or CSV."""
    ledger = request.config_dict[keys.OBSERVABILITY].ledger
    if ledger is None:
        raise Conflict("the usage ledger is off: set [observability] usage_ledger_path", code="ledger_off")
    since, until = _instant(request, "since", 0.0), _instant(request, "until", time.time() + 1)
    if until <= since:
        raise BadRequest("until must be after since", param="until", code="invalid_value")
    form = request.query.get("format", "json")
    if form not in ("json", "csv"):
        raise BadRequest("format must be json or csv", param="format", code="invalid_value")
    tenants = await asyncio.get_running_loop().run_in_executor(None, ledger.usage, since, until)
    if form == "json":
        return web.json_response(
            {"object": "usage", "since": since, "until": until, "tenants": [dataclasses.asdict(t) for t in tenants]}
        )
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["tenant", *(f"requests_{o}" for o in OUTCOMES), *SUMS])
    for t in tenants:
        writer.writerow([t.tenant, *(t.requests.get(o, 0) for o in OUTCOMES), *(getattr(t, s) for s in SUMS)])
    return web.Response(text=out.getvalue(), content_type="text/csv")


async def stats(request: web.Request) -> web.Response:
    observability = request.config_dict[keys.OBSERVABILITY]
    engine = request.config_dict[keys.ENGINE]
    snapshot = engine.snapshot()
    hol = observability.hol.state
    lane = engine.long_lane()
    store = request.config_dict[keys.GATE].store
    return web.json_response(
        {
            "kv_blocks_total": snapshot.num_blocks,
            "kv_blocks_used": snapshot.used_blocks,
            "kv_usage": snapshot.used_blocks / snapshot.num_blocks,
            "running": snapshot.running,
            "waiting": snapshot.waiting,
            "engine_busy_s": snapshot.busy_s,
            "latency": observability.windows.summary(),
            "hol": {
                "coupled": hol.coupled,
                "short_ttft_p99_s": hol.short_ttft_p99_s,
                "long_device_share": hol.long_device_share,
                "long_kv_share": hol.long_kv_share,
                "offenders": [
                    {
                        "id": o.request_id,
                        "tenant": o.tenant,
                        "size_class": o.size_class,
                        "device_share": o.device_share,
                        "kv_share": o.kv_share,
                    }
                    for o in hol.offenders
                ],
            },
            "split": None if observability.split_state is None else dataclasses.asdict(observability.split_state),
            "long_lane": {
                "enabled": lane.enabled,
                "factor": lane.factor,
                "short_ttft_target_s": lane.short_ttft_target_s,
                "allowance_s": lane.allowance_s,
                "step_cost": None if lane.step_cost is None else dataclasses.asdict(lane.step_cost),
                "steps_observed": lane.steps_observed,
                "chunk_tokens": {str(context): n for context, n in lane.chunk_tokens.items()},
                "actions": engine.hol_actions(),
            },
            "admission_store": {"kind": "embedded"} if store is None else dataclasses.asdict(store.stats()),
            "predictor_health": dataclasses.asdict(observability.predictor_health.report()),
        }
    )


async def ui(request: web.Request) -> web.Response:
    page, policy = ui_page()
    return web.Response(
        text=page, content_type="text/html", headers={"Cache-Control": "no-store", "Content-Security-Policy": policy}
    )


@functools.cache
def ui_page() -> tuple[str, str]:
    """The page and its policy, read and hashed once: the file ships with the package."""
    page = resources.files("headroom.admin").joinpath("ui/index.html").read_text(encoding="utf-8")
    return page, page_policy(page)


def page_policy(page: str) -> str:
    """The page's one inline script and one inline style run by their hashes, nothing
    else inline does, and no other site may frame the page (it has abort buttons)."""

    def inline(tag: str) -> str:
        body = page.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
        return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"

    return (
        f"default-src 'self'; script-src {inline('script')}; style-src {inline('style')}; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )
