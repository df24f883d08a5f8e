"""OpenAI-compatible handlers: /v1/completions, /v1/chat/completions, /v1/models.
(/v1/responses, in responses.py, is translated into a chat request and served by
prepare_chat and respond here.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from headroom.admission.tenants import Tenant
from headroom.app import keys
from headroom.app.errors import (
    APIError,
    BadRequest,
    Conflict,
    NotFound,
    QueueFull,
    Unavailable,
    error_body,
)
from headroom.app.fields import UNRECOGNIZED, parse_body
from headroom.app.formats import ChatFormat, CompletionFormat, ResponseFormat, Usage
from headroom.app.observe import note
from headroom.app.proxy import proxy
from headroom.app.response_metrics import metrics_of, reports_metrics
from headroom.app.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from headroom.app.sse import DONE, encode_event, open_stream
from headroom.app.structured import constraint_param, grammar_spec, template_messages, tool_use
from headroom.contracts.request import ContextOverflow, Priority, Request, SamplingParams, completion_limit
from headroom.executor.grammar import GrammarError, GrammarSpec
from headroom.executor.sampler import TokenLogprob

log = logging.getLogger("headroom.api")


def request_id(request: web.Request, prefix: str, tenant: Tenant) -> str:
    """As vLLM: the client's X-Request-Id, when given, becomes the response id's base
    (after `prefix`, which ends with its separator: "chatcmpl-", "resp_").
    An id another tenant has in flight is replaced by a fresh one, so that no tenant can
    learn of, or block, another's requests by guessing ids; a tenant's own duplicate is
    a 409 in build_request."""
    given = request.headers.get("X-Request-Id")
    if given:
        rid = f"{prefix}{given}"
        other = request.app[keys.ENGINE].submitted.get(rid)
        if other is None or other.tenant == tenant.name:
            return rid
    return f"{prefix}{uuid.uuid4().hex}"


def caller(request: web.Request) -> Tenant:
    """Who is asking; noted on the trace with the tier the request runs in."""
    gate = request.app[keys.GATE]
    tenant = gate.tenant(request)
    note(request, tenant=tenant.name, tier=gate.tier(request, tenant))
    return tenant


def check_accepting(request: web.Request) -> None:
    if request.app[keys.LIFECYCLE].draining:
        raise Unavailable(
            "the server is shutting down; retry on another instance", code="draining", headers={"Retry-After": "5"}
        )
    if request.app[keys.ENGINE].is_full:
        raise QueueFull("the server's queue is full; retry shortly", code="queue_full", headers={"Retry-After": "1"})


def check_model(request: web.Request, name: str | None, tenant: Tenant) -> tuple[str, str | None]:
    """(the name the response reports, the LoRA adapter to run under): the name the client
    asked by (as vLLM), else the tenant's default adapter, else the model's id. An adapter
    the tenant is not bound to is as unknown as a name never loaded."""
    client = request.app[keys.ENGINE]
    names = client.model.names
    bound = tenant.config.loras
    loras = [n for n in client.loras() if bound is None or n in bound]
    if name is None:
        name = tenant.config.default_lora or names[0]
    if name in names:
        return name, None
    if name not in loras:
        served = ", ".join(f"`{n}`" for n in (*names, *loras))
        raise NotFound(
            f"The model `{name}` does not exist. This server serves: {served}.", param="model", code="model_not_found"
        )
    return name, name


def build_requests(
    request: web.Request,
    rid: str,
    body: SamplingFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    tenant: Tenant,
    lora: str | None = None,
) -> list[Request]:
    """One engine request per choice (n); choice i > 0 is `rid-i`, with seed + i; each runs
    under the adapter `lora` (None: the base model)."""
    # Choice ids get a random part: a client's own X-Request-Id can never name another's choice.
    ids = [rid] + [f"{rid}-{i}-{uuid.uuid4().hex[:8]}" for i in range(1, body.n)]
    seeds = [None if body.seed is None else _wrap_seed(body.seed + i) for i in range(body.n)]
    built = [
        build_request(request, ids[i], body, prompt_ids, max_tokens, logprobs, tenant, seeds[i], lora)
        for i in range(body.n)
    ]
    trace = request.get(keys.TRACE)
    if trace is not None:  # one arrival for the span, the ledger and /admin alike: the handler's
        for engine_request in built:
            engine_request.arrival_time = trace.arrival
    return built


def request_priority(asked: int, tenant: Tenant) -> int:
    """The request's own priority under its tenant's priority_range: as asked, clamped, or a 400."""
    bounds = tenant.config.priority_range
    if bounds is None or bounds[0] <= asked <= bounds[1]:
        return asked
    if tenant.config.priority_clamp:
        return min(max(asked, bounds[0]), bounds[1])
    raise BadRequest(
        f"priority must be in [{bounds[0]}, {bounds[1]}] for this tenant, got {asked}",
        param="priority",
        code="priority_out_of_range",
    )


def _wrap_seed(seed: int) -> int:
    return seed - 2**64 if seed >= 2**64 else seed


def build_request(
    request: web.Request,
    rid: str,
    body: SamplingFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    tenant: Tenant,
    seed: int | None,
    lora: str | None,
) -> Request:
    client = request.app[keys.ENGINE]
    if client.is_submitted(rid):
        raise Conflict(f"request id {rid!r} is already in flight", param="X-Request-Id", code="duplicate_request_id")
    # The tenant's own limits, where set, are hard caps below the server's: a request that
    # asks for more is refused, as OpenAI refuses more than a model's output limit; one
    # that names no max_tokens gets the cap.
    cap = tenant.config.max_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise BadRequest(
            f"max_tokens is too large: {max_tokens}. This API key may ask for at most {cap} completion tokens.",
            param="max_tokens",
            code="exceeds_tenant_limit",
        )
    max_len = min(client.model.max_model_len, tenant.config.max_model_len or client.model.max_model_len)
    try:
        limit = completion_limit(len(prompt_ids), max_tokens, max_len)
    except ContextOverflow as exc:
        raise BadRequest(str(exc), param=exc.param, code="context_length_exceeded") from None
    max_tokens = limit if max_tokens is not None or cap is None else min(limit, cap)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k if 0 < body.top_k < client.model.vocab_size else 0,  # as many as the vocabulary: off
            seed=seed,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            min_tokens=min(body.min_tokens, max_tokens),
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.token_bias,
            repetition_detection=body.repetition_detection and body.repetition_detection.detection,
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    try:
        # vLLM's convention: a lower `priority` value is served earlier.
        priority = Priority(value=-request_priority(body.priority, tenant))
        built = client.new_request(prompt_ids, sampling, request_id=rid, priority=priority, lora=lora)
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_value") from None
    return built


async def completions(request: web.Request) -> web.StreamResponse:
    tenant = caller(request)
    check_accepting(request)
    body = await parse_body(request, CompletionRequest, UNRECOGNIZED)
    model, lora = check_model(request, body.model, tenant)
    tokenizer = request.app[keys.ENGINE].tokenizer
    prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    rid = request_id(request, "cmpl-", tenant)
    note(request, request_id=rid)
    engine_requests = build_requests(request, rid, body, prompt_ids, body.max_tokens, body.logprobs, tenant, lora)
    await constrain(request, engine_requests, grammar_spec(body), constraint_param(body))
    fmt = CompletionFormat(
        rid,
        int(time.time()),
        model,
        _token_text(tokenizer),
        body.include_usage,
        report_metrics=reports_metrics(request.app[keys.CONFIG].server, tenant),
    )
    text = body.prompt if isinstance(body.prompt, str) else ""
    return await respond(request, engine_requests, fmt, body.stream, tenant, [{"role": "user", "content": text}])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    tenant = caller(request)
    check_accepting(request)
    body = await parse_body(request, ChatCompletionRequest, UNRECOGNIZED)
    engine_requests, fmt, messages = await prepare_chat(request, body, tenant, "chatcmpl-")
    return await respond(request, engine_requests, fmt, body.stream, tenant, messages)


async def prepare_chat(
    request: web.Request, body: ChatCompletionRequest, tenant: Tenant, id_prefix: str
) -> tuple[list[Request], ChatFormat, list[dict]]:
    """A chat request up to admission: its engine requests (tokenised through the chat
    template, constrained by its grammar), its format and its messages."""
    model, lora = check_model(request, body.model, tenant)
    tokenizer = request.app[keys.ENGINE].tokenizer
    messages = [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
            **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
            **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
        }
        for m in body.messages
    ]
    tools, tool_grammar = tool_use(body, tokenizer.hf.chat_template)
    takes_tools = tokenizer.template_takes_tools
    try:
        prompt_ids = tokenizer.apply_chat_template(
            template_messages(messages, tools, takes_tools),
            tools=tools.tools if tools is not None and takes_tools else None,
        )
    except ValueError as exc:
        raise BadRequest(f"messages: {exc}", param="messages") from None
    rid = request_id(request, id_prefix, tenant)
    note(request, request_id=rid)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    engine_requests = build_requests(request, rid, body, prompt_ids, body.requested_max_tokens, logprobs, tenant, lora)
    spec = tool_grammar or grammar_spec(body)
    await constrain(request, engine_requests, spec, "tool_choice" if tool_grammar else constraint_param(body))
    report = reports_metrics(request.app[keys.CONFIG].server, tenant)
    fmt = ChatFormat(
        rid, int(time.time()), model, _token_text(tokenizer), body.include_usage, tools=tools, report_metrics=report
    )
    return engine_requests, fmt, messages


async def constrain(request: web.Request, engine_requests: list[Request], spec: GrammarSpec | None, param: str) -> None:
    """Give each of `engine_requests` a matcher for `spec`. Compiling runs in a worker thread, so
    neither the event loop nor the engine's steps wait on it; a spec compiled before
    comes from xgrammar's cache."""
    if spec is None:
        return
    grammars = await request.app[keys.ENGINE].grammars()
    loop = asyncio.get_running_loop()
    try:
        compiled = await loop.run_in_executor(None, grammars.compile, spec)
    except GrammarError as exc:
        raise BadRequest(f"{param}: unsupported or invalid: {exc}", param=param, code="invalid_grammar") from None
    for engine_request in engine_requests:
        engine_request.grammar = grammars.constraint(compiled, spec)


def _token_text(tokenizer):
    return lambda token_id: tokenizer.decode([token_id])


def usage_of(requests: list[Request]) -> Usage:
    # The prompt is counted once, as OpenAI counts it for n choices.
    return Usage(
        requests[0].num_prompt_tokens,
        sum(r.num_output_tokens for r in requests),
        max(r.num_cached_tokens for r in requests),
    )


# What writes a response once admitted: _run for completions and chat, another for /v1/responses.
Run = Callable[[web.Request, list[Request], Any, bool], Awaitable[web.StreamResponse]]


async def respond(
    request: web.Request,
    engine_requests: list[Request],
    fmt: Any,
    stream: bool,
    tenant: Tenant,
    messages: list[dict],
    run: Run | None = None,
) -> web.StreamResponse:
    gate = request.app[keys.GATE]
    note(
        request,
        engine_request=engine_requests[0],
        prompt=messages if request.app[keys.CONFIG].observability.log_prompts else None,
    )
    # n choices: n sequences, admitted at once
    admitted = await gate.admit(
        tenant, engine_requests, messages, gate.tier(request, tenant), gate.ttft_objective_s(request)
    )
    if admitted.route is not None:
        return await proxy(request, admitted.route, request.app[keys.HTTP_CLIENT])
    done = False
    try:
        if request.transport is None or request.transport.is_closing():
            # Gone before it ran: never runs. Handler cancellation normally gets there first
            # (acquire abandons the wait); this is the backstop when it has not landed yet.
            raise web.HTTPBadRequest(reason="Client Closed Request")
        response = await (run or _run)(request, engine_requests, fmt, stream)
        done = True
        return response
    finally:
        gate.settle(admitted, engine_requests, engine_requests[0].status.finish_reason if done else None)


async def outputs_of(client, requests: list[Request]):
    """(choice index, output) of every request as they come. With n > 1 the others start
    once the first has its first token, so its prompt is in the prefix cache and they
    prefill only the last, partial block: one prefill for all."""
    if len(requests) == 1:
        outputs = client.generate(requests[0])
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    first = asyncio.Event()

    async def feed(index: int, engine_request: Request) -> None:
        try:
            outputs = client.generate(engine_request)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    first.set()
                    queue.put_nowait((index, out))
        finally:
            first.set()
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(feed(0, requests[0]))]
    try:
        await first.wait()
        tasks += [asyncio.create_task(feed(i, r)) for i, r in enumerate(requests[1:], 1)]
        left = len(requests)
        while left:
            index, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield index, out
    finally:  # a client that leaves: every choice's sequence is aborted with its task
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run(
    request: web.Request, engine_requests: list[Request], fmt: ResponseFormat, stream: bool
) -> web.StreamResponse:
    headers = {"X-Request-Id": engine_requests[0].request_id}
    outputs = outputs_of(request.app[keys.ENGINE], engine_requests)
    if stream:
        return await _stream(request, outputs, engine_requests, fmt, headers)
    return await _answer(outputs, engine_requests, fmt, headers)


def _closing(fmt: ResponseFormat, engine_requests: list[Request], payload: dict) -> dict:
    """The response, or the last chunk of its stream, with its metrics where reported."""
    if fmt.report_metrics:
        payload["metrics"] = metrics_of(engine_requests)
    return payload


async def _answer(outputs, engine_requests: list[Request], fmt: ResponseFormat, headers: dict) -> web.Response:
    """The whole response at once, when every choice has finished."""
    n = len(engine_requests)
    text: list[list[str]] = [[] for _ in range(n)]
    wants_logprobs = engine_requests[0].sampling.logprobs is not None
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    last = [None] * n
    async with contextlib.aclosing(outputs):
        async for index, out in outputs:
            text[index].append(out.text)
            if wants_logprobs and out.logprobs:
                logprobs[index].extend(out.logprobs)
            last[index] = out
    for out in last:
        if out.error:
            raise APIError(out.error, code="engine_error")
    choices = [
        fmt.choice(
            "".join(text[i]), logprobs[i] if wants_logprobs else None, last[i].finish_reason, last[i].stop_reason, i
        )
        for i in range(n)
    ]
    body = _closing(fmt, engine_requests, fmt.full(choices, usage_of(engine_requests)))
    return web.json_response(body, headers=headers)


async def _stream(
    request: web.Request, outputs, engine_requests: list[Request], fmt: ResponseFormat, headers: dict
) -> web.StreamResponse:
    """Server-sent events as the choices run; the last choice's final chunk ends the
    stream, or the usage chunk where asked for."""
    response = await open_stream(request, headers)
    n = len(engine_requests)
    held: list[list[str]] = [[] for _ in range(n)]
    running = n
    try:
        async with contextlib.aclosing(outputs):
            for index in range(n):
                for chunk in fmt.start_chunks(index):
                    await response.write(encode_event(chunk))
            async for index, out in outputs:
                if out.error:  # headers are sent: the error travels as an event
                    await response.write(encode_event(error_body(out.error, APIError.type, code="engine_error")))
                    break
                running -= out.finished
                chunks = _chunks(fmt, held[index], out, index)
                if chunks and running == 0 and not fmt.include_usage:
                    chunks = [*chunks[:-1], _closing(fmt, engine_requests, chunks[-1])]
                for chunk in chunks:
                    await response.write(encode_event(chunk))
        if fmt.include_usage:
            await response.write(
                encode_event(_closing(fmt, engine_requests, fmt.usage_chunk(usage_of(engine_requests))))
            )
        await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left; aclosing has already aborted the sequences
        log.info("client disconnected mid-stream: %s", engine_requests[0].request_id)
    return response


def _chunks(fmt: ResponseFormat, held: list[str], out, index: int) -> list[dict]:
    """The stream chunks one output of choice `index` makes: none where the text is held."""
    if fmt.holds_text:  # tool calls are known only once the whole text is
        held.append(out.text)
        if not out.finished:
            return []
        return fmt.tool_chunks("".join(held), out.finish_reason, out.stop_reason, index)
    if not (out.text or out.finished or out.logprobs):
        return []
    end = out.finished
    reason, stop = (out.finish_reason, out.stop_reason) if end else (None, None)
    return [fmt.delta_chunk(out.text, out.logprobs, reason, stop, index)]


async def list_models(request: web.Request) -> web.Response:
    """One card per served name, as vLLM lists them; `root` is the model they all name."""
    model = request.app[keys.ENGINE].model
    cards = [
        {
            "id": name,
            "object": "model",
            "created": request.app[keys.LIFECYCLE].started_at,
            "owned_by": "headroom",
            "root": model.root,
            "max_model_len": model.max_model_len,
        }
        for name in model.names
    ]
    # vLLM's cards for LoRA adapters: `root` the adapter's folder, `parent` the base model;
    # a tenant bound to some adapters sees only those.
    bound = caller(request).config.loras
    cards += [
        {
            "id": name,
            "object": "model",
            "created": request.app[keys.LIFECYCLE].started_at,
            "owned_by": "headroom",
            "root": path,
            "parent": model.names[0],
            "max_model_len": model.max_model_len,
        }
        for name, path in request.app[keys.ENGINE].loras().items()
        if bound is None or name in bound
    ]
    return web.json_response({"object": "list", "data": cards})
