"""Routing a request to another headroom instance (the long pool): the body and the
identity headers go upstream unchanged, and the answer, streamed or not, comes back
byte for byte."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from headroom.app.admission_gate import FAIRNESS_HEADERS, OBJECTIVE_HEADERS, TTFT_OBJECTIVE_HEADER
from headroom.app.errors import APIError

log = logging.getLogger("headroom.proxy")

FORWARDED = (
    "Authorization",
    "Content-Type",
    "X-Request-Id",
    "X-Tenant",
    *FAIRNESS_HEADERS,
    *OBJECTIVE_HEADERS,
    TTFT_OBJECTIVE_HEADER,
    "traceparent",
    "tracestate",
)
RETURNED = ("Content-Type", "Cache-Control", "Retry-After", "X-Request-Id")


class BadGateway(APIError):
    status = 502
    type = "server_error"


async def proxy(request: web.Request, base_url: str, session: aiohttp.ClientSession) -> web.StreamResponse:
    body = await request.read()
    headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
    try:
        async with session.post(base_url.rstrip("/") + request.path, data=body, headers=headers) as upstream:
            returned = {k: upstream.headers[k] for k in RETURNED if k in upstream.headers}
            response = web.StreamResponse(status=upstream.status, headers={**returned, "X-Headroom-Pool": "long"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientError as exc:
        log.warning("long pool %s unreachable: %s", base_url, exc)
        raise BadGateway(f"the long-request pool did not answer: {exc}", code="upstream_unavailable") from None
