"""A request body's fields that no schema names: a typo (max_token) or another server's
extension. OpenAI refuses them and vLLM ignores them with a warning; [server]
unknown_fields picks which (reject, the default, or accept). The request models keep
such fields aside (pydantic's extra="allow") rather than deciding themselves, so every
field a model declares, vendor extensions included, is known by being declared.

Nested objects whose every field headroom knows (tools, tool_choice, response_format,
text) refuse an unknown key whatever the setting, in the same words. Messages and input
items ignore theirs: clients send back the assistant messages and output items they were
given, with fields (refusal, annotations, status ...) that carry nothing for a prompt."""

from __future__ import annotations

import logging
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from headroom.app import keys
from headroom.app.errors import BadRequest, validation_error

log = logging.getLogger("headroom.api")

# OpenAI's own words, on its chat and completions endpoints and on its Responses API.
UNRECOGNIZED = "Unrecognized request argument supplied: {}"
UNKNOWN_PARAMETER = "Unknown parameter: '{}'."
LOGGED_NAMES = 8  # a body may hold thousands of keys; a log line names these many

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: web.Request, model: type[Body], message: str) -> Body:
    """The request's body as `model`; a field `model` does not declare is a 400 whose
    `message` (a format string) and param name it, or with unknown_fields = "accept" a
    warning in the log."""
    try:
        body = model.model_validate_json(await request.read())
    except ValidationError as exc:
        if exc.errors()[0]["type"] != "extra_forbidden":
            raise
        param = validation_error(exc).param  # the nested key's path, as for any field
        raise BadRequest(message.format(param), param=param, code="unknown_parameter") from None
    unknown = list(body.model_extra or ())
    if not unknown:
        return body
    if request.app[keys.CONFIG].server.unknown_fields == "reject":
        raise BadRequest(message.format(unknown[0]), param=unknown[0], code="unknown_parameter")
    more = f" and {len(unknown) - LOGGED_NAMES} more" if len(unknown) > LOGGED_NAMES else ""
    names = ", ".join(unknown[:LOGGED_NAMES])
    log.warning("ignored request fields no schema knows: %s%s", names, more)
    return body
