"""The aiohttp application: create_app(config, engine), and serve() with a graceful
SIGTERM drain (stop admitting with 503, let streams finish, abort the rest, exit 0)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import aiohttp
from aiohttp import web

from headroom.admin import policies
from headroom.admin.api import admin_token, create_admin_app
from headroom.app import keys
from headroom.app.admission_gate import AdmissionGate
from headroom.app.auth import guard
from headroom.app.engine_client import AsyncEngine
from headroom.app.errors import error_body, error_middleware
from headroom.app.lora_api import load_lora_adapter, unload_lora_adapter
from headroom.app.observe import metrics, observe_middleware
from headroom.app.openai_api import chat_completions, completions, list_models
from headroom.app.openapi import build_openapi
from headroom.app.responses import responses
from headroom.app.runner import Runner
from headroom.config import Config
from headroom.observability.observer import Observability, package_version
from headroom.openmp import in_passing_thread
from headroom.runtime.engine import Engine

log = logging.getLogger("headroom.server")


async def health(request: web.Request) -> web.Response:
    if request.app[keys.LIFECYCLE].draining:
        return web.json_response(error_body("draining", "service_unavailable", code="draining"), status=503)
    body = {"status": "ok", **request.app[keys.ENGINE].health()}
    store = request.app[keys.GATE].store
    if store is not None:
        # Still ready without Redis (it admits on its share), so still 200, but degraded.
        stats = store.stats()
        body["admission_store"] = {"kind": stats.kind, "available": stats.available, "reason": stats.reason}
        if not stats.available:
            body["status"] = "degraded"
    return web.json_response(body)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[keys.OPENAPI])


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/openapi.json", openapi)
    if app[keys.CONFIG].observability.metrics:
        app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


def create_app(config: Config, engine: Engine) -> web.Application:
    """The app runs `engine`'s step thread for as long as the app is up."""
    # observe_middleware is outermost, so it sees the status error_middleware chose.
    # guard is inside error_middleware, so that its refusals are OpenAI's error JSON.
    app = web.Application(
        middlewares=[observe_middleware, error_middleware, guard(config, admin_token(config))],
        client_max_size=config.server.max_body_bytes,
    )
    app[keys.CONFIG] = config
    max_submitted = config.scheduler.max_num_seqs + config.server.max_queue_len
    app[keys.ENGINE] = AsyncEngine(engine, max_submitted)
    # Admission holds back what the engine cannot seat soon, so that fairness across
    # tenants decides who goes next rather than arrival order in the engine's queue.
    admission_seats = config.admission.global_max_in_flight_seqs or config.scheduler.max_num_seqs + 8
    app[keys.GATE] = AdmissionGate(
        config, admission_seats, engine.block_manager.num_blocks * engine.block_manager.block_size
    )
    if config.admission.enabled and config.admission.probe and engine.refiner is None:
        _use_probe(config, engine)
    app[keys.LIFECYCLE] = keys.Lifecycle()
    app[keys.OBSERVABILITY] = Observability(config.observability, engine, app[keys.GATE].admission)
    app[keys.ENGINE].on_closed = app[keys.OBSERVABILITY].charge
    app[keys.OPENAPI] = build_openapi(
        package_version(), admin=admin_token(config) is not None, unknown_fields=config.server.unknown_fields
    )
    app.cleanup_ctx.append(_observability)  # first in, last out: flushes the final spans
    if app[keys.GATE].store is not None:
        app.cleanup_ctx.append(_admission_store)  # out after the engine: its last settles reach Redis
    app.cleanup_ctx.append(_engine_thread)
    app.cleanup_ctx.append(_admission_timer)
    if config.pools.long.url:
        app.cleanup_ctx.append(_http_client)
    setup_routes(app)
    token = admin_token(config)
    if token is not None:
        app.add_subapp("/admin/", create_admin_app(token))
    else:
        log.info("admin API off: set [admin] token or HEADROOM_ADMIN_TOKEN to enable /admin/")
    if policies.enabled(config.admin, config.admission.tenants):
        app.cleanup_ctx.append(_policies)
    return app


def _use_probe(config: Config, engine: Engine) -> None:
    from headroom.prediction.probe_model import load_probe

    c, args = config.admission, engine.loaded.args
    probe = in_passing_thread(
        load_probe, c.probe_path, args.hidden_size, args.num_layers, args.vocab_size
    )  # LightGBM's loading runs OpenMP: see headroom/openmp.py
    if probe is not None:
        engine.use_probe(probe, c.probe_every, c.runaway_threshold, c.long_min_output_tokens)


async def _engine_thread(app: web.Application):
    app[keys.ENGINE].start()
    yield
    # Anything still in flight is aborted here; its stream ends with finish_reason "abort".
    await app[keys.ENGINE].stop()


async def _admission_timer(app: web.Application):
    admission = app[keys.GATE].admission
    if admission is not None:
        admission.start()
    yield
    if admission is not None:
        await admission.close()  # waiters get 503; none is left holding a reservation


async def _admission_store(app: web.Application):
    gate = app[keys.GATE]
    await gate.store.start()
    task = asyncio.create_task(gate.store.run(), name="headroom-admission-store")
    task.add_done_callback(_log_death)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await gate.admission.flush()
    await gate.store.close()


def _log_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("admission store: lease renewal stopped; leases will expire", exc_info=task.exception())


async def hol_control(observability: Observability, client: AsyncEngine) -> None:
    """The head-of-line control loop, every interval until cancelled: observability
    measures the signal, the runtime's long lane acts on it."""
    while True:
        await asyncio.sleep(observability.config.monitor_interval_s)
        try:
            state = observability.refresh()
            action, factor = client.hol_update(state.coupled, state.short_ttft_p99_s, state.long_device_share)
            observability.note_hol(action, factor)
        except Exception:  # a monitor bug must never take the server down
            log.exception("head-of-line monitor failed")


async def _observability(app: web.Application):
    observability = app[keys.OBSERVABILITY]
    control = hol_control(observability, app[keys.ENGINE])
    monitor = asyncio.create_task(control, name="headroom-hol-monitor")
    yield
    monitor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await monitor
    # Flushing may wait on a slow collector; the loop must not.
    await asyncio.get_running_loop().run_in_executor(None, observability.shutdown)


async def _policies(app: web.Application):
    task = asyncio.create_task(policies.enforce(app[keys.CONFIG].admin, app[keys.ENGINE]), name="headroom-policies")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _http_client(app: web.Application):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        app[keys.HTTP_CLIENT] = session
        yield


async def drain(app: web.Application, timeout_s: float) -> None:
    """Refuse new work, wait for in-flight requests up to timeout_s, abort the rest."""
    app[keys.LIFECYCLE].draining = True
    client = app[keys.ENGINE]
    deadline = asyncio.get_running_loop().time() + timeout_s
    log.info("draining: %d requests submitted, timeout %.1fs", len(client.submitted), timeout_s)
    while client.submitted and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if client.submitted:
        log.warning("drain timeout: aborting %d requests", len(client.submitted))
        client.abort_all()
        while client.submitted:  # their streams end with finish_reason "abort"
            await asyncio.sleep(0.02)


def make_runner(app: web.Application, shutdown_timeout_s: float = 60.0) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, whose finally
    # aborts the sequence. shutdown_timeout_s: how long cleanup waits for open handlers.
    return Runner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s)


async def serve(config: Config, engine: Engine) -> None:
    app = create_app(config, engine)
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    log.info("serving %s on http://%s:%d", engine.loaded.name, config.server.host, config.server.port)
    print(f"headroom: serving {engine.loaded.name} on http://{config.server.host}:{config.server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(app, config.server.drain_timeout_s)
    await runner.cleanup()
    log.info("shut down cleanly")
