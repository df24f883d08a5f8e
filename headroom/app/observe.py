"""The HTTP side of observability: a middleware that opens a request's trace before the
handler runs and closes it (span, metrics, log line) after the last byte is written,
whatever the outcome; and the /metrics handler."""

from __future__ import annotations

import asyncio
import json
import time

import structlog
from aiohttp import web

from headroom.app import keys
from headroom.observability.metrics import CONTENT_TYPE
from headroom.observability.observer import OPERATIONS, RequestTrace

CLIENT_CLOSED = 499  # nginx's code for "the client went away first"


@web.middleware
async def observe_middleware(request: web.Request, handler):
    if request.path not in OPERATIONS or request.method != "POST":
        return await handler(request)
    observability = request.app[keys.OBSERVABILITY]
    structlog.contextvars.clear_contextvars()  # a keep-alive connection reuses its task's context
    trace = observability.start(request.path, request.headers, time.monotonic())
    request[keys.TRACE] = trace
    status, error = 500, None
    try:
        response = await handler(request)
        status, error = response.status, _error_of(response)
        return response
    except asyncio.CancelledError:
        status, error = CLIENT_CLOSED, "client disconnected"
        raise
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        observability.finish(trace, status, error)
        structlog.contextvars.clear_contextvars()


def note(request: web.Request, **fields) -> RequestTrace | None:
    """Record what the handler learned (request id, tenant, engine request) on the trace."""
    trace = request.get(keys.TRACE)
    if trace is not None:
        for name, value in fields.items():
            setattr(trace, name, value)
        if "request_id" in fields:
            structlog.contextvars.bind_contextvars(request_id=fields["request_id"])
    return trace


def _error_of(response: web.StreamResponse) -> str | None:
    if response.status < 400 or not isinstance(response, web.Response) or not response.body:
        return None
    try:
        error = json.loads(response.body)["error"]
        return f"{error.get('code') or error.get('type')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return None


async def metrics(request: web.Request) -> web.Response:
    body = request.app[keys.OBSERVABILITY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
