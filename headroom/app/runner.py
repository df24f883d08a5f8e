"""aiohttp's runner, with one change: requests that aiohttp cannot even parse (oversized
headers, a broken request line, bad chunked framing) are answered by aiohttp itself,
before any middleware, in text/plain. Here they get OpenAI's error JSON like every other
error, so a client's error handling sees one shape."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from headroom.app.errors import error_body


class JsonErrorRequestHandler(RequestHandler):
    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a reply has begun
        if isinstance(exc, LineTooLong):
            status, code = 431, "headers_too_large"
            message = f"request header fields too large: {exc.message}"
        elif status >= 500:
            code, message = "internal_error", "internal server error"
        else:
            detail = str(message or exc).strip().splitlines()[0].rstrip(":")  # aiohttp adds the line and a caret
            code, message = "bad_request", f"malformed HTTP request: {detail}"
        type_ = "server_error" if status >= 500 else "invalid_request_error"
        response = web.json_response(error_body(message, type_, code=code), status=status)
        response.force_close()
        return response


class JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return JsonErrorServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **plain._kwargs,
        )
