"""LoRA adapters end to end through a real server and the official openai client: loaded
and unloaded at run time behind the admin token, selected by `model`, streamed, and bound
to tenants."""

from __future__ import annotations

import dataclasses
import time

import httpx
import openai
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, AdmissionConfig, CacheConfig, Config, ObservabilityConfig, TenantConfig
from headroom.contracts.request import AdapterRef, Request, SamplingParams
from headroom.observability.finished import FinishedRequest
from headroom.observability.ledger import Usage
from headroom.observability.observer import span_attributes
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import SequenceSnapshot
from tests.lora.conftest import peft_model
from tests.reference import greedy, reference_model

pytestmark = pytest.mark.slow

ADMIN = "admin-secret-token-0123456789"
BASE = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"
MAX_TOKENS = 12


def config(ledger: str) -> Config:
    return Config(
        cache=CacheConfig(num_blocks=256),
        observability=ObservabilityConfig(usage_ledger_path=ledger),
        admission=AdmissionConfig(
            auth=True,
            tenants=(
                TenantConfig("bound", api_keys=("key-bound",), loras=("mlp-r16",), default_lora="mlp-r16"),
                TenantConfig("free", api_keys=("key-free",)),
                TenantConfig("default"),
            ),
        ),
        admin=AdminConfig(token=ADMIN),
    )


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    served = config(str(tmp_path_factory.mktemp("ledger") / "usage.sqlite"))
    srv = BackgroundServer(served, Engine(served, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(default_model, adapter_dirs):
    """adapter -> the text transformers + peft give PROMPT greedily, and the base's."""
    ids = default_model.tokenizer.encode(PROMPT)
    texts = {
        name: default_model.tokenizer.decode(greedy(peft_model(adapter_dirs[name]), ids, MAX_TOKENS))
        for name in ("attn-r8", "mlp-r16")
    }
    texts[None] = default_model.tokenizer.decode(greedy(reference_model(), ids, MAX_TOKENS))
    return texts


def post(server, path, body, token=ADMIN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def completion(server, key, model=None, **extra):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return post(server, "/v1/completions", body, token=key)


def test_load_select_stream_bind_and_unload(server, adapter_dirs, expected):
    # Loading needs the admin token; a tenant's key is no admin token.
    body = {"lora_name": "attn-r8", "lora_path": adapter_dirs["attn-r8"]}
    for token in (None, "key-free"):
        r = post(server, "/v1/load_lora_adapter", body, token=token)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    r = post(server, "/v1/load_lora_adapter", body)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'attn-r8' added successfully.")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "mlp-r16", "lora_path": adapter_dirs["mlp-r16"]})
    assert r.status_code == 200
    # The engine writes each into a free slot before any request runs under it.
    loras = server.engine.executor.loras
    loaded = {loras.ref("attn-r8").uid, loras.ref("mlp-r16").uid}
    deadline = time.monotonic() + 10
    while not loaded <= set(loras.slots.uids):
        assert time.monotonic() < deadline, f"never written into the slots: {loras.slots.uids}"
        time.sleep(0.01)
    again = post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"] == {
        "message": "the name 'attn-r8' is already taken by a loaded model or adapter",
        "type": "invalid_request_error",
        "param": "lora_path",
        "code": "invalid_lora_adapter",
    }

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-free", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["attn-r8"].model_extra["parent"] == BASE and cards["attn-r8"].model_extra["root"].endswith("attn-r8")

    # Selected by `model`, streamed: the adapter's own tokens, not the base's.
    stream = client.completions.create(
        model="attn-r8", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"attn-r8"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["attn-r8"]
    assert expected["attn-r8"] != expected[None]
    assert completion(server, "key-free", BASE).json()["choices"][0]["text"] == expected[None]

    # A tenant bound to mlp-r16 runs under it by default and cannot name another adapter.
    r = completion(server, "key-bound")
    assert r.status_code == 200 and r.json()["model"] == "mlp-r16"
    assert r.json()["choices"][0]["text"] == expected["mlp-r16"]
    bound = openai.OpenAI(base_url=server.url + "/v1", api_key="key-bound", max_retries=0)
    assert [m.id for m in bound.models.list().data] == [BASE, f"{BASE}.Q4_1", "mlp-r16"]
    r = post(server, "/v1/load_lora_adapter", {**body, "lora_name": "x", "load_inplace": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    r = completion(server, "key-bound", "attn-r8")
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        f"The model `attn-r8` does not exist. This server serves: `{BASE}`, `{BASE}.Q4_1`, `mlp-r16`."
    )

    # An unload is refused while a sequence runs under the adapter, and done once it ends.
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"model": "attn-r8", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True},
        headers={"Authorization": "Bearer key-free"},
        timeout=60,
    ) as running:
        lines = running.iter_lines()
        while not next(lines).startswith("data: {"):  # its first token: it runs
            pass
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "attn-r8"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "lora_adapter_in_use"
        seqs = httpx.get(server.url + "/admin/sequences", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert [(s["tenant"], s["lora"]) for s in seqs.json()["data"]] == [("free", "attn-r8")]
    deadline = time.monotonic() + 30
    while (r := post(server, "/v1/unload_lora_adapter", {"lora_name": "attn-r8"})).status_code == 409:
        assert time.monotonic() < deadline, "the aborted stream never released its adapter"
        time.sleep(0.1)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'attn-r8' removed successfully.")
    assert completion(server, "key-free", "attn-r8").status_code == 404
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "attn-r8"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    assert "attn-r8" not in {m.id for m in client.models.list().data}

    # The ledger charges each tenant per adapter: free ran attn-r8 twice (the stream above and
    # the aborted one) and the base once, bound ran mlp-r16 once.
    usage = httpx.get(server.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    loras = {t["tenant"]: {name: u["requests"] for name, u in t["loras"].items()} for t in usage["tenants"]}
    assert loras == {"free": {"attn-r8": 2}, "bound": {"mlp-r16": 1}}
    by_tenant = {t["tenant"]: t for t in usage["tenants"]}
    assert by_tenant["bound"]["loras"]["mlp-r16"]["output_tokens"] == by_tenant["bound"]["output_tokens"]
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    assert 'headroom:lora_requests_total{lora="attn-r8"} 2.0' in metrics
    assert 'headroom:lora_requests_total{lora="mlp-r16"} 1.0' in metrics
    assert f'headroom:lora_output_tokens_total{{lora="mlp-r16"}} {float(MAX_TOKENS)}' in metrics


def test_the_span_and_the_sequence_name_the_adapter():
    request = Request("r", [1, 2, 3], SamplingParams(), lora=AdapterRef("attn-r8", 7))
    done = FinishedRequest.build(
        request_id="r",
        endpoint="/v1/completions",
        model="attn-r8",
        http_status=200,
        arrival=0.0,
        end=1.0,
        request=request,
        tenant="free",
        tier="standard",
    )
    attributes = span_attributes(done)
    assert (attributes["gen_ai.request.model"], attributes["headroom.lora"]) == ("attn-r8", "attn-r8")
    assert span_attributes(dataclasses.replace(done, lora=None))["headroom.lora"] is None
    assert SequenceSnapshot.of(request, now=1.0, busy_s=0.0, blocks_held=0, num_blocks=1).lora == "attn-r8"
    assert Usage.of_request(request).lora == "attn-r8"
