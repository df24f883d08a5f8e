"""The real server on 127.0.0.1, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import httpx
import openai
import pytest

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig, ServerConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

CONFIG = Config(
    cache=CacheConfig(num_blocks=512),
    scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
    server=ServerConfig(max_body_bytes=64 * 1024, max_queue_len=64),
)
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(default_model):
    """The runtime itself, stepped on this thread: what the server must reproduce."""
    return Engine(CONFIG, loaded=default_model)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# A leak never clears, so the wait only bounds how long a busy 2-core CI may take to
# finish the steps already under way (5 s was passed under load).
def wait_idle(engine: Engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.block_manager.num_used_blocks == 0 and not engine.scheduler.has_work():
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.block_manager.num_used_blocks} blocks used")


def finished_requests(server: BackgroundServer) -> float:
    """Requests the server has finished with, by any outcome, run or refused."""
    [family] = server.app[keys.OBSERVABILITY].metrics.tenant_requests.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# ---- happy paths through the official client ---------------------------------------------


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == list(server.engine.loaded.names)


def test_chat_greedy_equals_runtime_and_usage_is_exact(client, reference):
    expected = reference.generate([chat_ids(reference, QUESTION)], SamplingParams(max_tokens=20, temperature=0))[0]
    res = client.chat.completions.create(
        model=reference.loaded.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=20, temperature=0
    )
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == reference.tokenizer.decode(
        expected.output_token_ids, skip_special_tokens=True
    )
    assert res.choices[0].finish_reason == expected.status.finish_reason
    assert res.usage.prompt_tokens == expected.num_prompt_tokens
    assert res.usage.completion_tokens == expected.num_output_tokens
    assert res.usage.total_tokens == expected.num_prompt_tokens + expected.num_output_tokens


def test_completion_greedy_equals_runtime(client, reference):
    prompt = "The three primary colours are"
    ids = reference.tokenizer.encode(prompt)
    expected = reference.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    res = client.completions.create(model=reference.loaded.name, prompt=prompt, max_tokens=12, temperature=0)
    assert res.object == "text_completion"
    assert res.choices[0].text == reference.tokenizer.decode(expected.output_token_ids, skip_special_tokens=True)
    assert res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), 12)


def test_penalties_and_logit_bias_equal_the_runtime(client, reference):
    prompt = "Repeat after me: the cat, the cat, the cat,"
    ids = reference.tokenizer.encode(prompt)
    forced = reference.tokenizer.encode(" river")[0]
    cases = [
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {}),
        ({"repetition_penalty": 1.3}, {}),
        ({"logit_bias": ((forced, 100.0),)}, {"logit_bias": {str(forced): 100}}),
    ]
    plain = reference.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0].output_token_ids
    for fields, over_http in cases:
        expected = reference.generate([ids], SamplingParams(max_tokens=12, temperature=0, **fields))[0]
        assert expected.output_token_ids != plain, fields  # each one changes this greedy output
        extra = over_http or {k: v for k, v in fields.items() if k in ("frequency_penalty", "presence_penalty")}
        body = {"repetition_penalty": fields["repetition_penalty"]} if "repetition_penalty" in fields else None
        res = client.completions.create(
            model=reference.loaded.name, prompt=prompt, max_tokens=12, temperature=0, extra_body=body, **extra
        )
        text = reference.tokenizer.decode(expected.output_token_ids, skip_special_tokens=True)
        assert res.choices[0].text == text, fields
    assert expected.output_token_ids == [forced] * 12


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias.5"),
    ],
)
def test_bad_penalties_and_bias_are_400_naming_the_field(server, field, value, param):
    body = {"prompt": "Hi", "max_tokens": 1, field: value}
    err = _error(httpx.post(server.url + "/v1/completions", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_logit_bias_outside_the_vocabulary_is_400(server):
    body = {"prompt": "Hi", "max_tokens": 1, "logit_bias": {str(10**7): 5}}
    err = _error(httpx.post(server.url + "/v1/completions", json=body), 400)
    assert err["code"] == "invalid_value" and err["message"].startswith("logit_bias: token ids must be in [0, ")


def test_streamed_chat_equals_non_streamed_and_ends_with_usage(client):
    kwargs = {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_text_and_stop_string(client):
    name = client.models.list().data[0].id
    stream = client.completions.create(
        model=name, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert " 6" not in text and text.startswith(" 4, 5,")


def test_logprobs_in_chat_and_completions(client):
    name = client.models.list().data[0].id
    res = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert "".join(e.token for e in content) == res.choices[0].message.content
    comp = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text


def test_x_request_id_is_the_response_id_base(server):
    r = httpx.post(
        server.url + "/v1/completions", headers={"X-Request-Id": "abc-123"}, json={"prompt": "Hi", "max_tokens": 2}
    )
    assert r.status_code == 200
    assert r.json()["id"] == "cmpl-abc-123" and r.headers["X-Request-Id"] == "cmpl-abc-123"


# ---- raw SSE framing -------------------------------------------------------------------


async def _raw_stream(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        return await resp.read()


def test_sse_framing_and_usage_chunk_last(server):
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    raw = asyncio.run(_raw_stream(server.url + "/v1/chat/completions", body))
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    usage = payloads[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert payloads[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(p["usage"] is None for p in payloads[:-1])


# ---- concurrency -----------------------------------------------------------------------


def test_64_concurrent_seeded_streams_are_correct_and_distinct(server, reference):
    n, max_tokens = 64, 12
    prompt = "Write a one-line poem about the ocean."
    ids = chat_ids(reference, prompt)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i) for i in range(n)]
    expected = [
        reference.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        for r in reference.generate([ids] * n, params)
    ]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=reference.loaded.name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=1000 + i,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_clients() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    got = asyncio.run(all_clients())
    assert got == expected
    assert len(set(got)) > n // 2  # seeds differ, so outputs do
    wait_idle(server.engine)


# ---- errors: exact status and OpenAI error body ----------------------------------------


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_malformed_json_is_400(server):
    err = _error(httpx.post(server.url + "/v1/chat/completions", content=b"{not json"), 400)
    assert err["code"] == "invalid_json" and "not valid JSON" in err["message"]


def test_missing_field_is_400_naming_it(server):
    err = _error(httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 3}), 400)
    assert err["param"] == "messages" and err["code"] == "missing_field"
    assert err["message"] == "messages: Field required"


def test_mistyped_field_is_400_naming_it(server):
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
    err = _error(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"


def test_context_overflow_is_400_with_token_counts(server):
    engine = server.engine
    prompt = "hello " * 100
    n_prompt = len(engine.tokenizer.encode(prompt))
    max_tokens = engine.max_model_len - n_prompt + 1
    err = _error(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"maximum context length is {engine.max_model_len} tokens" in err["message"]
    assert f"{n_prompt} in the prompt, {max_tokens} for the completion" in err["message"]


def test_unknown_model_is_404(server):
    err = _error(httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err == {
        "message": "The model `gpt-9` does not exist. This server serves: `SmolLM2-135M-Instruct`, "
        "`SmolLM2-135M-Instruct.Q4_1`.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_body_over_limit_is_413(server):
    body = json.dumps({"prompt": "a" * (CONFIG.server.max_body_bytes + 10)})
    err = _error(httpx.post(server.url + "/v1/completions", content=body), 413)
    assert err["code"] == "request_too_large"


def test_duplicate_in_flight_request_id_is_409(server):
    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True, "stream": True}
            headers = {"X-Request-Id": "dup-1"}
            async with session.post(server.url + "/v1/completions", json=body, headers=headers) as first:
                await first.content.readline()  # the first is streaming now
                async with session.post(server.url + "/v1/completions", json=body, headers=headers) as second:
                    return second.status, await second.json()

    status, body = asyncio.run(run())
    assert status == 409 and body["error"]["code"] == "duplicate_request_id"
    wait_idle(server.engine)


def test_draining_server_answers_503(server):
    lifecycle = server.app[keys.LIFECYCLE]
    lifecycle.draining = True
    try:
        err = _error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "draining"
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        lifecycle.draining = False
    health = httpx.get(server.url + "/health").json()
    # The thread count is measured and may change with the machine's load (runtime/threads.py).
    threads = health.pop("threads")
    most = server.engine.threads.most
    assert threads["configured"] == most and threads["tuned"] == (most > 1)
    assert threads["current"] in (1, most) and threads["switches"] >= 0 and len(threads) == 4
    assert health == {
        "status": "ok",
        "attention_backend": {
            "name": "cpu_paged",
            "reason": "auto on cpu: cpu_paged is the best available",
            "block_size": 16,
            "arithmetic": {
                "dtype": "float32",
                "reason": "auto: float32 beside a float32 cache (the reference path stays exact)",
            },
        },
        "cuda_graphs": "off (no CUDA graphs on cpu)",
        "weights": {
            "dtype": "float32",
            "quantization": "none",
            "reason": "as the caller loaded it",
            "kv_cache": {"dtype": "float32", "reason": "auto: the model's dtype"},
        },
        "speculative": {"method": "ngram", "num_speculative_tokens": 4},
    }


def test_health_and_openapi(server):
    assert httpx.get(server.url + "/health").status_code == 200
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
    # vLLM's adapter routes are served with or without the admin API, always behind its token.
    for path, body in (("/v1/load_lora_adapter", "LoadLoraBody"), ("/v1/unload_lora_adapter", "UnloadLoraBody")):
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"adminToken": []}]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
    assert doc["components"]["schemas"]["LoadLoraBody"]["required"] == ["lora_name", "lora_path"]
    assert doc["components"]["securitySchemes"] == {"adminToken": {"type": "http", "scheme": "bearer"}}


# ---- disconnects -----------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server):
    engine = server.engine
    wait_idle(engine)
    idle = engine.block_manager.num_used_blocks
    aborted = engine.counters().aborts["client_disconnect"]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            body = {
                "prompt": "Write a long essay about rivers.",
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            resp = await session.post(server.url + "/v1/completions", json=body)
            for _ in range(3):
                await resp.content.readline()
            assert engine.block_manager.num_used_blocks > idle
            resp.close()  # drop the connection mid-stream

    asyncio.run(run())
    # The disconnect aborts the sequence, which would otherwise run on to 2000 tokens and
    # finish as length. The deadline is a safety net only.
    deadline = time.monotonic() + 60
    while engine.counters().aborts["client_disconnect"] == aborted:
        assert time.monotonic() < deadline, "the disconnect did not abort the sequence"
        time.sleep(0.02)
    assert engine.counters().aborts["client_disconnect"] == aborted + 1
    wait_idle(engine, timeout=60)
    assert engine.block_manager.num_used_blocks == idle
    engine.block_manager.check_invariants()


def test_client_gone_mid_body_never_runs(server):
    engine = server.engine
    wait_idle(engine)
    started = engine.stats.requests_started
    finished = finished_requests(server)
    body = json.dumps({"prompt": "never run me", "max_tokens": 50}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # Send only the headers and half the body, then vanish: the handler is waiting for
    # the body, so the request never reaches the engine. (A client that sent it all and left
    # while queued in admission: tests/app/test_admission_e2e.py.)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body[: len(body) // 2])
    # Wait until the server is done with the request, whatever the outcome: from then on
    # it can no longer reach the engine. The deadline is a safety net only.
    deadline = time.monotonic() + 60
    while finished_requests(server) == finished:
        assert time.monotonic() < deadline, "the server never finished the abandoned request"
        time.sleep(0.02)
    wait_idle(engine)
    assert engine.stats.requests_started == started
    assert finished_requests(server) == finished + 1
