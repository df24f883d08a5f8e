"""The one Server-Sent Events encoder: `data: <json>\\n\\n` per event, after an
`event: <name>` line where the API names its events (the Responses API), and
`data: [DONE]` last where the API ends so (completions, chat)."""

from __future__ import annotations

import json

from aiohttp import web


def encode_event(payload: dict, event: str | None = None) -> bytes:
    data = b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await response.prepare(request)
    return response
