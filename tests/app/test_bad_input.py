"""Hostile and broken input on the real server: each gets the right 4xx with an OpenAI
error body, and the server is healthy and leak-free afterwards."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(default_model):
    config = Config(cache=CacheConfig(num_blocks=256))
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


def post_raw(server, path: str, content: bytes, **headers) -> httpx.Response:
    return httpx.post(
        server.url + path, content=content, timeout=60, headers={"Content-Type": "application/json", **headers}
    )


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code
    return error


def chat(content, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize(
    "content,code",
    [
        (b'{"prompt": "\xff\xfe broken", "max_tokens": 2}', "invalid_json"),  # not UTF-8
        (b'{"prompt": "abc', "invalid_json"),  # truncated
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # nesting far past any parser's limit
        (b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", "invalid_json"),
    ],
)
def test_unparseable_bodies_are_400(server, content, code):
    assert_openai_error(post_raw(server, COMPLETIONS, content), 400, code)


def test_lone_surrogates_are_refused_not_crashed_on(server):
    # An escaped lone surrogate encodes no text; the JSON parser refuses it up front, so
    # it never reaches the tokenizer.
    for path, content in [
        (COMPLETIONS, b'{"prompt": "hi \\ud800 there", "max_tokens": 2}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ]:
        error = assert_openai_error(post_raw(server, path, content), 400, "invalid_json")
        assert error["message"].startswith("request body is not valid JSON")


def test_ten_megabyte_body_is_413(server):
    body = json.dumps({"prompt": "a" * (10 * 2**20), "max_tokens": 1}).encode()
    assert_openai_error(post_raw(server, COMPLETIONS, body), 413, "request_too_large")


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"stop": [f"s{i}" for i in range(1000)]}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools.0.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"best_of": 2}, "best_of"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_sampling_fields_are_400_naming_the_field(server, fields, param):
    error = assert_openai_error(post_raw(server, CHAT, chat("hi", **fields)), 400)
    assert error["param"] == param


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_temperature_is_400(server, literal):
    content = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + literal + b"}"
    error = assert_openai_error(post_raw(server, COMPLETIONS, content), 400)
    assert error["param"] in ("temperature", None)


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
        ([{"content": "hi"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
    ],
)
def test_bad_messages_are_400(server, messages, param):
    error = assert_openai_error(post_raw(server, CHAT, json.dumps({"messages": messages}).encode()), 400)
    assert error["param"] == param


def test_prompts_of_only_special_tokens_are_served(server):
    tok = server.engine.tokenizer
    specials = "".join(tok.hf.all_special_tokens)
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": specials, "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    eos = min(tok.eos_token_ids)
    r = httpx.post(
        server.url + COMPLETIONS, json={"prompt": [eos] * 8, "max_tokens": 3, "ignore_eos": True}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8


def test_oversized_headers_are_431_in_openai_json(server):
    # aiohttp refuses these before any middleware runs; the runner still answers in JSON.
    r = httpx.post(
        server.url + COMPLETIONS,
        content=chat("hi"),
        timeout=60,
        headers={"Content-Type": "application/json", "X-Padding": "x" * 20_000},
    )
    assert r.headers["Content-Type"].startswith("application/json")
    error = assert_openai_error(r, 431, "headers_too_large")
    assert error["message"].startswith("request header fields too large")


def test_unparseable_http_is_400_in_openai_json(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"Content-Type: application/json" in head
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "bad_request", None)
    assert error["message"] == "malformed HTTP request: Invalid character in Content-Length"


def test_cors_is_off_by_default(server):
    r = httpx.options(
        server.url + CHAT,
        timeout=10,
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}
    r = httpx.post(
        server.url + CHAT,
        content=chat("hi"),
        timeout=60,
        headers={"Content-Type": "application/json", "Origin": "https://evil.example"},
    )
    assert r.status_code == 200 and "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_hostile_input_leaves_the_server_healthy_and_holding_nothing(server):
    # Self-contained (it does not lean on the tests above having run): its own mix of
    # refused requests, streams cut at the first token, then nothing may be held.
    engine = server.engine
    refused = [
        (COMPLETIONS, b'{"prompt": "abc', 400),
        (COMPLETIONS, json.dumps({"prompt": "a" * (10 * 2**20), "max_tokens": 1}).encode(), 413),
        (CHAT, chat("hi", max_tokens=0), 400),
        (CHAT, json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400),
        (COMPLETIONS, json.dumps({"prompt": [10**9], "max_tokens": 2}).encode(), 400),
    ]
    for path, content, status in refused:
        assert_openai_error(post_raw(server, path, content), status)
    started = engine.counters().requests_started
    for _ in range(3):
        with httpx.stream(
            "POST",
            server.url + COMPLETIONS,
            timeout=60,
            json={"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: {") and '"text": ""' not in line)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_idle(engine)
    assert engine.counters().requests_started == started + 3
    assert engine.counters().aborts["client_disconnect"] >= 3
    engine.block_manager.check_invariants()
    gate = server.app[keys.GATE]
    assert all(t.bucket.in_flight == 0 for t in gate.registry)
    assert server.app[keys.ENGINE].submitted == {}


def test_a_top_k_beyond_the_vocabulary_is_no_top_k(server):
    # The fuzzer's find: 2**63 overflowed the sampler's tensor and came back as a 500.
    body = {"prompt": "0", "max_tokens": 3, "temperature": 0}
    plain = httpx.post(server.url + COMPLETIONS, json=body, timeout=60)
    huge = httpx.post(server.url + COMPLETIONS, json={**body, "top_k": 2**63}, timeout=60)
    assert plain.status_code == huge.status_code == 200
    assert huge.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
