"""Structured outputs and tool calls on the real server, through the official openai
client: output that parses and validates against the schema on every prompt, greedy and
sampled; forced tool calls that parse; auto with a model that has no tool format; a 400
naming what a schema cannot do; and the grammar's mask checked on the logits."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import openai
import pytest
import torch

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.executor.grammar import GrammarSpec, mask
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

CONFIG = Config(cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(max_num_seqs=16))
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person who lives in Paris as JSON.",
    "Give me a JSON record of a retired teacher.",
    "Make up a character for a story. Reply in JSON.",
    "Who is Ada Lovelace? Answer as JSON.",
    "Invent a user profile for a test database.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 40}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


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


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_output_parses_and_validates_on_every_prompt(client, sampling):
    validator = jsonschema_rs.validator_for(PERSON)
    for prompt in PROMPTS:
        res = client.chat.completions.create(
            model=client.model_name,
            messages=[{"role": "user", "content": prompt}],
            response_format=person_format(),
            max_tokens=200,
            **sampling,
        )
        choice = res.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        validator.validate(json.loads(choice.message.content))


def test_json_schema_on_completions_streamed_equals_non_streamed(client):
    kwargs = {
        "model": client.model_name,
        "prompt": "A person, as JSON:",
        "max_tokens": 200,
        "temperature": 0,
        "extra_body": {"response_format": person_format()},
    }
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    jsonschema_rs.validator_for(PERSON).validate(json.loads(full.choices[0].text))


def test_json_object_gives_json_and_guided_choice_and_regex_hold(client):
    res = client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    assert res.choices[0].finish_reason == "stop"
    json.loads(res.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    for text in ("I love this!", "This is awful.", "It is a chair."):
        res = client.chat.completions.create(
            model=client.model_name,
            messages=[{"role": "user", "content": f"Sentiment: {text}"}],
            max_tokens=10,
            temperature=1.0,
            extra_body={"guided_choice": choices},
        )
        assert res.choices[0].message.content in choices
    res = client.completions.create(
        model=client.model_name,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", res.choices[0].text) and res.choices[0].finish_reason == "stop"


def test_forced_tool_calls_parse_named_and_required_streamed_and_not(client):
    messages = [{"role": "user", "content": "What is the weather like in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    res = client.chat.completions.create(
        model=client.model_name,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=100,
        temperature=0,
    )
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).validate(json.loads(call.function.arguments))

    res = client.chat.completions.create(
        model=client.model_name,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=100,
        temperature=0.8,
        seed=3,
    )
    (call,) = res.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema_rs.validator_for(tool["function"]["parameters"]).validate(json.loads(call.function.arguments))

    chunks = list(
        client.chat.completions.create(
            model=client.model_name,
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=named,
            max_tokens=100,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == json.loads(
        client.chat.completions.create(
            model=client.model_name,
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=named,
            max_tokens=100,
            temperature=0,
        )
        .choices[0]
        .message.tool_calls[0]
        .function.arguments
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_results_are_accepted_on_the_next_turn(client):
    first = client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3, "sky": "rain"}'},
    ]
    res = client.chat.completions.create(
        model=client.model_name, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0
    )
    # SmolLM2's template has no tool-call format: with "auto" its answer is plain content.
    assert res.choices[0].message.content and res.choices[0].message.tool_calls is None
    assert res.choices[0].finish_reason in ("stop", "length")


def test_a_schema_xgrammar_cannot_compile_is_400_naming_why(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_grammar"
    assert error["message"] == 'response_format: unsupported or invalid: Unsupported type "strang"'
    body = {"prompt": "hi", "max_tokens": 5, "guided_regex": "(?<=a)b"}
    error = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["error"]
    assert error["param"] == "guided_regex" and "Lookbehind is not supported" in error["message"]


def test_the_mask_leaves_exactly_the_tokens_the_grammar_allows(default_model):
    engine = Engine(CONFIG, loaded=default_model)
    grammars = engine.grammars
    matcher = grammars.constraint(
        grammars.compile(GrammarSpec.choice(["yes", "no"])), GrammarSpec.choice(["yes", "no"])
    )
    vocab = engine.loaded.args.vocab_size
    logits = torch.zeros(2, vocab)
    mask(logits, [(1, matcher)])
    assert torch.count_nonzero(logits[0]) == 0  # an unconstrained row is untouched
    allowed = {engine.tokenizer.decode([t]) for t in torch.nonzero(logits[1] == 0).flatten().tolist()}
    # Every first piece of "yes" or "no" and nothing else.
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    assert {"yes", "no"} <= allowed or {"y", "n"} <= allowed
    assert torch.isinf(logits[1]).sum() == vocab - len(allowed)
    # The numpy unpacking gives exactly what xgrammar's own apply does.
    import xgrammar as xgr

    matchers = [
        (0, grammars.constraint(grammars.compile(GrammarSpec("json")), GrammarSpec("json"))),
        (2, grammars.constraint(grammars.compile(GrammarSpec("regex", r"[a-c]+x")), GrammarSpec("regex", r"[a-c]+x"))),
    ]
    ours = torch.randn(3, vocab)
    theirs = ours.clone()
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    for row, m in matchers:
        m.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 2])
    mask(ours, matchers)
    assert torch.equal(ours, theirs)

    # In the engine: the greedy output is one of the choices, and the sequence ends there.
    request = engine.new_request(
        engine.tokenizer.encode("Is the sky blue? Answer:"), SamplingParams(max_tokens=8, temperature=0)
    )
    request.grammar = grammars.constraint(
        grammars.compile(GrammarSpec.choice(["yes", "no"])), GrammarSpec.choice(["yes", "no"])
    )
    engine.submit(request, lambda _: None)
    while not request.is_finished:
        engine.step()
    assert request.status.finish_reason == "stop" and request.output_token_ids[-1] in engine.tokenizer.eos_token_ids
    assert engine.tokenizer.decode(request.output_token_ids, skip_special_tokens=True) in ("yes", "no")


def counter(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name + "_total":
                return sample.value
    raise AssertionError(f"{name} missing")


def test_n_choices_share_one_prefill_and_come_back_indexed(client, server):
    block = server.engine.block_manager.block_size
    # A prompt no other test sent, of a length that is not a whole number of blocks.
    ids = [1000 + (i * 37) % 5000 for i in range(5 * block + 3)]
    queries, hits = counter(server, "headroom:prefix_cache_queries"), counter(server, "headroom:prefix_cache_hits")
    res = client.completions.create(model=client.model_name, prompt=ids, max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert len({c.text for c in res.choices}) > 1  # seed + i: each choice draws its own tokens
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 36
    # The first prefilled the prompt; the other two found its 5 full blocks in the cache.
    assert counter(server, "headroom:prefix_cache_queries") - queries == 3 * len(ids)
    assert counter(server, "headroom:prefix_cache_hits") - hits == 2 * 5 * block
    assert res.usage.prompt_tokens_details.cached_tokens == 5 * block

    streamed = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in client.completions.create(
        model=client.model_name, prompt=ids, max_tokens=12, temperature=1.0, seed=5, n=3, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.text for c in res.choices} and finishes == {0: "length", 1: "length", 2: "length"}

    # Every choice under the grammar: a schema of enums ends well inside max_tokens, so each
    # choice must stop with a valid object (one left unconstrained would not).
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "likes_tea": {"type": "boolean"}},
        "required": ["city", "likes_tea"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=client.model_name,
        n=2,
        max_tokens=60,
        temperature=0.9,
        seed=1,
        messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    validator = jsonschema_rs.validator_for(schema)
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert validator.is_valid(json.loads(choice.message.content)), choice.message.content
