"""What a new user and a new operator meet in their first hour: the README's model name,
structured outputs that finish, and a server under auth that answers nobody without a key."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest

from headroom.admission.tenants import Tenant
from headroom.app.background import BackgroundServer
from headroom.app.errors import BadRequest
from headroom.app.openai_api import request_priority
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ConfigError,
    ObservabilityConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

CONFIG = Config(
    cache=CacheConfig(num_blocks=256),
    admission=AdmissionConfig(tenants=(TenantConfig("default"), TenantConfig("capped", max_tokens=8))),
)
README_NAME = "SmolLM2-135M-Instruct"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", [README_NAME, FILE_NAME])
def test_the_readme_name_and_the_file_name_both_answer(client, name):
    res = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert res.model == name and res.usage.completion_tokens == 2  # the name asked by, as vLLM answers
    assert [m.id for m in client.models.list().data] == [README_NAME, FILE_NAME]


def test_an_unknown_model_is_a_404_that_lists_what_is_served(server):
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/responses", {"input": "Hi"}),
    ):
        r = httpx.post(server.url + path, json={"model": "SmolLM2", **body}, timeout=30)
        assert r.status_code == 404, path
        assert r.json() == {
            "error": {
                "message": f"The model `SmolLM2` does not exist. This server serves: `{README_NAME}`, `{FILE_NAME}`.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }, path


# ---- structured outputs that finish ---------------------------------------------------------


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


class Person(pydantic.BaseModel):
    name: str
    age: int


# At temperature 0 the default model loops inside the first two: Cairo's population in
# digits, Oslo's country in "_Slavic" (before the loop detector steered loops under a
# grammar to close their value, both ran to max_tokens and left invalid JSON).
PARSED = [
    (City, "Give the name, country and population of Cairo."),
    (City, "Give the name, country and population of Oslo."),
    (Person, "Who is Ada Lovelace? Give their name and age."),
]


@pytest.mark.parametrize(("model", "prompt"), PARSED)
def test_parse_succeeds_at_temperature_0_on_chat_and_responses(client, model, prompt):
    chat = client.chat.completions.parse(
        model=README_NAME,
        messages=[{"role": "user", "content": prompt}],
        response_format=model,
        temperature=0,
        max_tokens=200,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), choice.message.content
    response = client.responses.parse(
        model=README_NAME, input=prompt, text_format=model, temperature=0, max_output_tokens=200
    )
    assert response.status == "completed" and response.output_parsed == choice.message.parsed


# ---- with auth on, every route but /health needs a key -------------------------------------

TENANT_KEY = "sk-tenant-first-hour"
ADMIN_TOKEN = "admin-token-first-hour"
METRICS_TOKEN = "metrics-token-first-hour"
AUTH = Config(
    cache=CacheConfig(num_blocks=256),
    admission=AdmissionConfig(
        auth=True, default_tenant="acme", tenants=(TenantConfig("acme", api_keys=(TENANT_KEY,)),)
    ),
    admin=AdminConfig(token=ADMIN_TOKEN),
    observability=ObservabilityConfig(metrics_token=METRICS_TOKEN),
)
# The admin page itself is static and shows nothing until it is given the admin token.
OPEN = {("GET", "/health"), ("GET", "/admin/ui")}


@pytest.fixture(scope="module")
def keyed(default_model):
    srv = BackgroundServer(AUTH, Engine(AUTH, loaded=default_model)).start()
    yield srv
    srv.stop()


def every_route(server) -> list[tuple[str, str]]:
    routes = {(r.method, re.sub(r"\{[^}]*\}", "x", r.resource.canonical)) for r in server.app.router.routes()}
    return sorted((m, p) for m, p in routes if m != "HEAD")


def test_with_auth_on_every_route_but_health_answers_401_without_a_key(keyed):
    routes = every_route(keyed)
    assert {("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/admin/stats")} <= set(
        routes
    )
    for method, path in routes:
        if (method, path) in OPEN:
            continue
        for headers in ({}, {"Authorization": "Bearer not-a-key"}):
            r = httpx.request(method, keyed.url + path, headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error", (method, path)
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200


def test_with_auth_on_each_route_answers_the_caller_it_is_for(keyed):
    def get(path: str, key: str) -> httpx.Response:
        return httpx.get(keyed.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    assert get("/v1/models", TENANT_KEY).status_code == 200
    assert get("/openapi.json", TENANT_KEY).status_code == 200
    # /metrics names every tenant in its labels: a scraper's token or the admin's, never a tenant's.
    assert get("/metrics", METRICS_TOKEN).status_code == 200
    assert get("/metrics", ADMIN_TOKEN).status_code == 200
    refused = get("/metrics", TENANT_KEY)
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "metrics_forbidden")
    assert get("/v1/models", METRICS_TOKEN).status_code == 401
    assert get("/admin/stats", METRICS_TOKEN).status_code == 401


# ---- a request's own priority: bounded, and its tenant's to restrict ------------------------


def test_a_priority_outside_the_apis_bounds_is_a_400(server):
    body = {"prompt": "Hi", "max_tokens": 1, "priority": -5000}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("priority", "invalid_value"), error
    assert "greater than or equal to -1000" in error["message"]


def test_a_tenant_may_forbid_or_clamp_a_requests_priority():
    def tenant(**limits) -> Tenant:
        return SimpleNamespace(config=TenantConfig("t", **limits))

    assert request_priority(-1000, tenant()) == -1000
    assert request_priority(-7, tenant(priority_range=(-10, 10))) == -7
    assert request_priority(-50, tenant(priority_range=(-10, 10), priority_clamp=True)) == -10
    assert request_priority(50, tenant(priority_range=(-10, 10), priority_clamp=True)) == 10
    with pytest.raises(BadRequest) as refused:
        request_priority(-1, tenant(priority_range=(0, 0)))  # [0, 0]: none but the default
    assert (refused.value.param, refused.value.code, refused.value.message) == (
        "priority",
        "priority_out_of_range",
        "priority must be in [0, 0] for this tenant, got -1",
    )
    with pytest.raises(ConfigError, match="priority_range must be"):
        TenantConfig("t", priority_range=(5, -5))


# ---- the smaller ones -----------------------------------------------------------------------


def test_a_tenants_max_tokens_cap_refuses_more_and_is_the_default(server):
    capped = {"X-Tenant": "capped"}
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 9}, headers=capped, timeout=60)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "max_tokens is too large: 9. This API key may ask for at most 8 completion tokens.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "exceeds_tenant_limit",
    }
    r = httpx.post(
        server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 9}, headers=capped, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert r.json()["error"]["message"].startswith("max_output_tokens is too large: 9.")
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=capped, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8


def test_the_responses_context_error_names_its_own_field(server):
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 10**6}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == ("max_output_tokens", "context_length_exceeded")
    assert "max_tokens" not in error["message"] and error["message"].endswith(
        "Please reduce the prompt or max_output_tokens."
    )


@pytest.mark.parametrize("field", ["echo", "suffix"])
def test_an_unsupported_completions_field_is_named(server, field):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", field: True if field == "echo" else "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_generate_writes_its_log_after_the_text():
    from headroom.app.cli import logs_after_text

    order: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            order.append(record.getMessage())

    root, recorder = logging.getLogger(), Recorder()
    root.addHandler(recorder)
    try:
        with logs_after_text():
            order.append("text")
            logging.getLogger("headroom.test").warning("a loop")
            order.append("more text")
        assert recorder in root.handlers
    finally:
        root.removeHandler(recorder)
    assert order == ["text", "more text", "a loop"]
