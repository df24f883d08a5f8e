"""/v1/responses on the real server, through the official openai client: greedy text equal
to what the chat endpoint gives for the same messages; the stream's events in OpenAI's
order, parsed by the SDK, its deltas adding up to the same text; a JSON schema through
the structured-output path; a forced function call through the chat tool-call path; a
cut-off response incomplete; and the stateful fields refused with a 400 naming them."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema_rs
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseTextDeltaEvent,
)

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, CacheConfig, Config, SchedulerConfig
from headroom.runtime.engine import Engine
from tests.steps import before_each_step

pytestmark = pytest.mark.slow

CONFIG = Config(cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(max_num_seqs=16))
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a terse geography teacher."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "other"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Current time in a timezone",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string", "maxLength": 40}},
        "required": ["tz"],
        "additionalProperties": False,
    },
    "strict": True,
}
TEXT_EVENTS_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_EVENTS_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    c.model_name = server.engine.loaded.name
    return c


# A leak never clears, so the wait only bounds how long a busy 2-core CI may take to
# finish the steps already under way (5 s was passed under load).
def assert_idle(server: BackgroundServer, timeout: float = 60.0) -> None:
    """Nothing held after the responses: no sequence, no block, no reservation."""
    engine = server.engine
    deadline = time.monotonic() + timeout
    while engine.block_manager.num_used_blocks or engine.scheduler.has_work() or server.app[keys.ENGINE].submitted:
        assert time.monotonic() < deadline, "engine not idle"
        time.sleep(0.02)
    engine.block_manager.check_invariants()


def observed_requests(server: BackgroundServer) -> float:
    """Requests the observability middleware has finished a trace for (and that ran)."""
    [family] = server.app[keys.OBSERVABILITY].metrics.e2e.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_count"))


def stream_events(client, **kwargs) -> list:
    return list(client.responses.create(model=client.model_name, stream=True, **kwargs))


# ---- text ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [24, 200])
def test_greedy_text_equals_the_chat_endpoint(client, server, max_tokens):
    chat = client.chat.completions.create(
        model=client.model_name,
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
    )
    observed = observed_requests(server)
    raw = client.responses.with_raw_response.create(
        model=client.model_name,
        instructions=INSTRUCTIONS,
        max_output_tokens=max_tokens,
        temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        metadata={"run": "test"},
        user="someone",
        store=False,
        parallel_tool_calls=False,
    )
    res = raw.parse()
    assert res.id.startswith("resp_") and raw.headers["X-Request-Id"] == res.id
    assert res.object == "response" and res.model == client.model_name
    assert res.output_text == chat.choices[0].message.content
    [item] = res.output
    assert isinstance(item, ResponseOutputMessage) and item.role == "assistant" and item.id.startswith("msg_")
    [part] = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text == res.output_text
    if chat.choices[0].finish_reason == "length":
        assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    else:
        assert res.status == "completed" and res.incomplete_details is None and item.status == "completed"
    usage = res.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens > 0  # the chat request's prompt, from the prefix cache
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (res.metadata, res.user, res.instructions, res.max_output_tokens) == (
        {"run": "test"},
        "someone",
        INSTRUCTIONS,
        max_tokens,
    )
    assert (res.temperature, res.top_p, res.parallel_tool_calls, res.tools, res.tool_choice) == (
        0.0,
        1.0,
        False,
        [],
        "auto",
    )
    assert observed_requests(server) == observed + 1  # traced like any chat request


def test_a_string_input_is_one_user_message(client):
    chat = client.chat.completions.create(
        model=client.model_name, max_tokens=12, temperature=0, messages=[{"role": "user", "content": QUESTION}]
    )
    res = client.responses.create(model=client.model_name, input=QUESTION, max_output_tokens=12, temperature=0)
    assert res.output_text == chat.choices[0].message.content


def test_stream_events_in_order_and_deltas_add_up_to_the_text(client, server):
    kwargs = {"input": QUESTION, "instructions": INSTRUCTIONS, "max_output_tokens": 200, "temperature": 0}
    full = client.responses.create(model=client.model_name, **kwargs)
    assert full.status == "completed"  # it ends on its own: the complete event order
    events = stream_events(client, **kwargs)
    types = [e.type for e in events]
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert types == TEXT_EVENTS_HEAD + ["response.output_text.delta"] * len(deltas) + TEXT_EVENTS_TAIL + [
        "response.completed"
    ]
    assert len(deltas) > 1  # streamed as generated, not at the end
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in deltas)
    assert "".join(e.delta for e in deltas) == full.output_text == events[-4].text
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent) and final.response.output_text == full.output_text
    assert final.response.id == events[0].response.id and final.response.usage.output_tokens == full.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []

    # The SDK's own stream helper rebuilds the response from the events.
    with client.responses.stream(model=client.model_name, **kwargs) as stream:
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == full.output_text

    # On the wire each event is named, as OpenAI names them.
    body = {"model": client.model_name, "stream": True, **kwargs, "max_output_tokens": 4}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [d["type"] for d in data] and names[-1] == "response.incomplete"
    assert_idle(server)


def test_max_output_tokens_cuts_the_response_incomplete(client):
    res = client.responses.create(model=client.model_name, input=QUESTION, max_output_tokens=3, temperature=0)
    assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    assert res.usage.output_tokens == 3 and res.output[0].status == "incomplete" and res.output_text
    events = stream_events(client, input=QUESTION, max_output_tokens=3, temperature=0)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == res.output_text


LOOPING = "create a multiple choice assessment with scoring based upon the answers"  # loops greedily


def test_a_loop_the_server_stops_is_incomplete_for_repetition(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4),
        admin=AdminConfig(loop_policy="stop"),
    )
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        model = srv.engine.loaded.name
        res = client.responses.create(model=model, input=LOOPING, max_output_tokens=512, temperature=0)
        assert res.status == "incomplete" and res.incomplete_details.reason == "repetition"
        assert res.usage.output_tokens < 512 and res.output[0].status == "incomplete"
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": LOOPING}], max_tokens=512, temperature=0
        )
        assert chat.choices[0].finish_reason == "repetition"
        assert chat.choices[0].model_extra["stop_reason"] == "loop_detected"
        assert chat.usage.completion_tokens == res.usage.output_tokens  # the same greedy loop, found alike
    finally:
        srv.stop()


# ---- structured output and function calls ----------------------------------------------


def test_json_schema_text_format_validates(client):
    validator = jsonschema_rs.validator_for(PERSON)
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for prompt in ("Describe a person who lives in Paris as JSON.", "Invent a user profile for a test database."):
        res = client.responses.create(
            model=client.model_name, input=prompt, text=text, max_output_tokens=200, temperature=0
        )
        assert res.status == "completed", res.output_text
        validator.validate(json.loads(res.output_text))
        assert res.text.format.type == "json_schema" and res.text.format.name == "person"


def test_forced_function_call_gives_a_function_call_item(client):
    question = "What is the weather like in Oslo?"
    kwargs = {
        "input": question,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 100,
        "temperature": 0,
    }
    res = client.responses.create(model=client.model_name, **kwargs)
    assert res.status == "completed" and res.output_text == ""
    [call] = res.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    arguments = json.loads(call.arguments)
    jsonschema_rs.validator_for(WEATHER_PARAMETERS).validate(arguments)
    # The chat path's own forced call, greedy on the same messages: the same arguments.
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)
    ]
    chat = client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": question}],
        tools=chat_tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        temperature=0,
    )
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == arguments

    events = stream_events(client, **kwargs)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert json.loads(events[4].arguments) == arguments and events[-1].response.output[0].name == "get_weather"

    # The call and its output go back as input items; the answer is text.
    follow = client.responses.create(
        model=client.model_name,
        tools=[WEATHER],
        max_output_tokens=10,
        temperature=0,
        input=[
            {"role": "user", "content": question},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 3, "sky": "rain"}'},
        ],
    )
    assert follow.output[0].type == "message" and follow.output_text


# ---- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "previous_response_id",
            "resp_123",
            "previous_response_id: not supported: nothing is stored here, and every request stands alone",
        ),
        ("store", True, "store: responses are never stored here; send false or leave it out"),
    ],
)
def test_stateful_fields_are_400_naming_them(client, server, field, value, message):
    body = {"model": client.model_name, "input": QUESTION, field: value}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": field, "code": "invalid_value"}
    }
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=client.model_name, input=QUESTION, **{field: value})
    assert exc.value.status_code == 400 and exc.value.body["param"] == field


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"model": "gpt-4o"}, "model"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": QUESTION, **body}, timeout=30)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


# ---- faults and disconnects --------------------------------------------------------------


def fail_third_step_of(request_id: str):
    steps = 0

    def fault(out) -> None:
        nonlocal steps
        if any(r.request_id == request_id for r in out.requests):
            steps += 1
            if steps == 3:
                raise RuntimeError("injected device fault")

    return fault


def test_an_engine_fault_mid_stream_is_an_error_event_then_failed(client, server):
    with before_each_step(server.engine, fail_third_step_of("resp_victim")):
        events = list(
            client.responses.create(
                model=client.model_name,
                input=QUESTION,
                max_output_tokens=20,
                stream=True,
                extra_headers={"X-Request-Id": "victim"},
            )
        )
    assert [e.type for e in events[:4]] == TEXT_EVENTS_HEAD and events[-2].type == "error"
    assert events[-2].code == "engine_error" and "injected device fault" in events[-2].message
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.id == "resp_victim" and failed.response.error.code == "server_error"
    assert_idle(server)


def test_a_client_gone_mid_stream_frees_its_sequence(server):
    aborted = server.engine.counters().aborts["client_disconnect"]
    body = {"input": "Write a long story about a dragon.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # leaves with the response still generating
    assert_idle(server)
    assert server.engine.counters().aborts["client_disconnect"] == aborted + 1
