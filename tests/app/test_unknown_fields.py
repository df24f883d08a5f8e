"""A request field no schema declares, on the real server: refused with a 400 naming it in
OpenAI's words (the default), or ignored with a warning naming it ([server]
unknown_fields = "accept", vLLM's way). The vendor extensions headroom declares, sent as
the official client sends them (extra_body), are fields like any other."""

from __future__ import annotations

import logging
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from headroom.app import cli
from headroom.app.background import BackgroundServer
from headroom.app.responses_schemas import ResponsesRequest
from headroom.app.schemas import ChatCompletionRequest, CompletionRequest
from headroom.config import CacheConfig, Config, SchedulerConfig, ServerConfig
from headroom.runtime.engine import Engine

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
COMPLETION = {"prompt": "Say hi.", "max_tokens": 2}
RESPONSE = {"input": "Say hi.", "max_output_tokens": 2}
SMALL = {"cache": CacheConfig(num_blocks=128), "scheduler": SchedulerConfig(max_num_seqs=4)}


@pytest.fixture(scope="module")
def server(default_model):
    config = Config(**SMALL)  # unknown_fields: reject, the default
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lenient(default_model):
    config = Config(**SMALL, server=ServerConfig(unknown_fields="accept"))
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


def unknown(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "unknown_parameter"}}


def unrecognized(param: str) -> dict:
    """OpenAI's words on its chat and completions endpoints."""
    return unknown(f"Unrecognized request argument supplied: {param}", param)


TYPO_TOOL = {"type": "function", "function": {"name": "f", "parmeters": {}}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, error",
    [
        ("/v1/chat/completions", {**CHAT, "max_token": 5}, unrecognized("max_token")),
        ("/v1/completions", {**COMPLETION, "max_token": 5}, unrecognized("max_token")),
        ("/v1/responses", {**RESPONSE, "max_token": 5}, unknown("Unknown parameter: 'max_token'.", "max_token")),
        # Nested objects whose every field is known refuse theirs in the same words.
        ("/v1/chat/completions", {**CHAT, "tools": [TYPO_TOOL]}, unrecognized("tools.0.function.parmeters")),
        (
            "/v1/completions",
            {**COMPLETION, "response_format": {"type": "json_object", "strict": True}},
            unrecognized("response_format.strict"),
        ),
        (
            "/v1/responses",
            {**RESPONSE, "text": {"format": {"type": "text"}, "verbose": True}},
            unknown("Unknown parameter: 'text.verbose'.", "text.verbose"),
        ),
    ],
)
def test_an_unknown_field_is_400_naming_it(server, path, body, error):
    started = server.engine.counters().requests_started
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert (r.status_code, r.json()) == (400, error)
    assert server.engine.counters().requests_started == started  # refused before anything ran


@pytest.mark.slow
def test_the_vendor_extensions_headroom_declares_pass(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = server.engine.loaded.name
    extras = {"top_k": 1, "min_tokens": 2, "repetition_penalty": 1.1, "ignore_eos": True, "priority": 1}
    chat = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2, extra_body=extras)
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (2, "length")
    guided = {**extras, "guided_choice": ["yes", "no"], "min_tokens": 0, "ignore_eos": False}
    text = client.completions.create(model=model, prompt="Say hi.", max_tokens=2, extra_body=guided)
    assert text.choices[0].text in ("yes", "no")


@pytest.mark.slow
def test_with_accept_an_unknown_field_is_ignored_and_logged(lenient, caplog):
    extras = {"max_token": 5, "skip_special_tokens": True}
    with caplog.at_level(logging.WARNING, logger="headroom.api"):
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", COMPLETION),
            ("/v1/responses", RESPONSE),
        ):
            r = httpx.post(lenient.url + path, json={**body, **extras}, timeout=60)
            assert r.status_code == 200, r.text
    warned = [r.getMessage() for r in caplog.records if r.name == "headroom.api" and r.levelno == logging.WARNING]
    assert warned == ["ignored request fields no schema knows: max_token, skip_special_tokens"] * 3
    # A nested object's unknown key is still refused: vendor extras live at the top.
    body = {**COMPLETION, "response_format": {"type": "text", "x": 1}}
    r = httpx.post(lenient.url + "/v1/completions", json=body, timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "response_format.x")


@pytest.mark.slow
def test_openapi_says_whether_other_fields_are_allowed(server, lenient):
    for srv, allowed in ((server, False), (lenient, True)):
        schemas = httpx.get(srv.url + "/openapi.json").json()["components"]["schemas"]
        for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
            assert schemas[name]["additionalProperties"] is allowed, name


@pytest.mark.parametrize(
    "params, model",
    [
        (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
        (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
        (response_create_params.ResponseCreateParamsBase, ResponsesRequest),
    ],
)
def test_every_field_the_official_client_sends_is_declared(params, model):
    """So that the openai package never meets "Unrecognized request argument": each of its
    fields is implemented, accepted or refused by name (docs/OPENAI_API.md)."""
    assert set(typing.get_type_hints(params)) - set(model.model_fields) == set()


def test_the_flags_map_to_the_config(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda ns: seen.append(cli.build_config(ns).server) or 0)
    assert cli.main(["serve", "--unknown-fields", "accept", "--request-metrics"]) == 0
    assert cli.main(["serve", "--no-request-metrics"]) == 0
    assert [(s.unknown_fields, s.request_metrics) for s in seen] == [("accept", True), ("reject", False)]
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--unknown-fields", "ignore"])
    assert caught.value.code == 2
