"""Typed errors at the API boundary and the one middleware that turns any exception
into OpenAI's error JSON. A client never sees a stack trace; every error is logged."""

from __future__ import annotations

import json
import logging
import re

from aiohttp import web
from pydantic import ValidationError

log = logging.getLogger("headroom.api")


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"


class Forbidden(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"


class TooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class QueueFull(APIError):
    status = 429
    type = "rate_limit_error"


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(
        error_body(err.message, err.type, err.param, err.code), status=err.status, headers=err.headers
    )


def validation_error(exc: ValidationError) -> BadRequest:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-")) or None
    msg = first["msg"].removeprefix("Value error, ")
    if param is None and (named := re.match(r"(\w+): ", msg)):  # a model-level check names its field
        param = named.group(1)
    if first["type"] == "json_invalid":
        return BadRequest(
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", code="invalid_json"
        )
    return BadRequest(
        f"{param}: {msg}" if param and not msg.startswith(param) else msg,
        param=param,
        code="invalid_value" if first["type"] != "missing" else "missing_field",
    )


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as err:
        log.info("request failed: %s %s -> %d %s", request.method, request.path, err.status, err.message)
        return error_response(err)
    except ValidationError as exc:
        err = validation_error(exc)
        log.info("invalid request: %s %s -> %s", request.method, request.path, err.message)
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        log.info("body too large: %s %s", request.method, request.path)
        # aiohttp's text names the limit: "Maximum request body size N exceeded."
        return error_response(TooLarge(f"request body too large: {exc.text}", code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        log.info("http error: %s %s -> %d", request.method, request.path, exc.status)
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        body = json.dumps(error_body(exc.reason, kind, code=exc.reason.lower().replace(" ", "_")))
        return web.Response(status=exc.status, text=body, content_type="application/json")
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError("internal server error"))
