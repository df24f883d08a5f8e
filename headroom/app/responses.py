"""POST /v1/responses: OpenAI's Responses API, text in and out, without stored state.
A request is translated into the chat request it amounts to (instructions as the first,
system message; function calls and their outputs as assistant tool calls and tool
messages) and served by the chat path: its template, grammar, tool calls, admission,
spans and metrics. Only the way out differs: a Response object, or its stream of events."""

from __future__ import annotations

import contextlib
import logging
import re

from aiohttp import web
from pydantic import ValidationError

from headroom.app import keys
from headroom.app.errors import APIError, BadRequest, validation_error
from headroom.app.fields import UNKNOWN_PARAMETER, parse_body
from headroom.app.openai_api import (
    caller,
    check_accepting,
    outputs_of,
    prepare_chat,
    respond,
    usage_of,
)
from headroom.app.response_metrics import metrics_of
from headroom.app.responses_format import ResponseEvents, ResponsesFormat
from headroom.app.responses_schemas import ResponsesRequest
from headroom.app.schemas import ChatCompletionRequest
from headroom.app.sse import encode_event, open_stream
from headroom.contracts.request import Request

log = logging.getLogger("headroom.api")

# Where the chat path names a field of its own, the client sent this one.
CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


async def responses(request: web.Request) -> web.StreamResponse:
    tenant = caller(request)
    check_accepting(request)
    body = await parse_body(request, ResponsesRequest, UNKNOWN_PARAMETER)
    chat_body = chat_request(body)
    try:
        engine_requests, chat, messages = await prepare_chat(request, chat_body, tenant, "resp_")
    except BadRequest as exc:
        raise renamed(exc) from None
    fmt = ResponsesFormat(chat, echo(body, chat_body))
    return await respond(request, engine_requests, fmt, body.stream, tenant, messages, run=_run)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    fields: dict = {
        "model": body.model,
        "messages": chat_messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    for name in ("temperature", "top_p"):  # null: the default
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        fields["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            fields["response_format"]["json_schema"] = fmt.model_dump(
                by_alias=True, exclude={"type"}, exclude_none=True
            )
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(exc)) from None


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The input items as chat messages: a function call joins its turn's assistant message."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    for item in body.input:
        if item.type == "message":
            messages.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":  # calls of one turn are one assistant message
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def renamed(err: BadRequest) -> BadRequest:
    """`err` naming the Responses field where it names the chat field it became."""
    chat_param = (err.param or "").split(".")[0]
    if chat_param not in CHAT_PARAMS:
        return err
    param = CHAT_PARAMS[chat_param]
    # Every mention, not only a leading "field:": "... Please reduce the prompt or max_tokens."
    message = re.sub(rf"\b{re.escape(chat_param)}\b", param, err.message)
    return BadRequest(message, param=err.param.replace(chat_param, param, 1), code=err.code, headers=err.headers)


def echo(body: ResponsesRequest, chat_body: ChatCompletionRequest) -> dict:
    """The settings a Response reports, as they were applied."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": chat_body.temperature,
        "top_p": chat_body.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
        "tools": [t.model_dump() for t in body.tools or ()],
        "truncation": "disabled",
        "user": body.user,
    }


async def _run(
    request: web.Request, engine_requests: list[Request], fmt: ResponsesFormat, stream: bool
) -> web.StreamResponse:
    headers = {"X-Request-Id": engine_requests[0].request_id}
    outputs = outputs_of(request.app[keys.ENGINE], engine_requests)
    text: list[str] = []
    last = None

    def metrics() -> dict | None:
        return metrics_of(engine_requests) if fmt.chat.report_metrics else None

    if not stream:
        async with contextlib.aclosing(outputs):
            async for _, out in outputs:
                text.append(out.text)
                last = out
        if last.error:
            raise APIError(last.error, code="engine_error")
        status, items = fmt.finished("".join(text), last.finish_reason, last.stop_reason)
        body = fmt.response(status, items, usage_of(engine_requests), metrics=metrics())
        return web.json_response(body, headers=headers)

    response = await open_stream(request, headers)
    events = ResponseEvents(fmt)

    async def send(batch: list[dict]) -> None:
        await response.write(b"".join(encode_event(e, event=e["type"]) for e in batch))

    try:
        async with contextlib.aclosing(outputs):
            await send(events.start())
            async for _, out in outputs:
                if out.error:  # headers are sent: the error travels as events
                    await send(events.failed(out.error))
                    break
                text.append(out.text)
                last = out
                if out.text and not fmt.holds_text:
                    await send([events.delta(out.text)])
            else:
                await send(
                    events.finish(
                        "".join(text), last.finish_reason, last.stop_reason, usage_of(engine_requests), metrics()
                    )
                )
        await response.write_eof()
    except ConnectionResetError:  # the client left; aclosing has already aborted the sequence
        log.info("client disconnected mid-stream: %s", engine_requests[0].request_id)
    return response
