"""Per-request metrics on the real server: off unless the server or the tenant turns them
on; then a `metrics` object on the final response or the last event of a stream, holding
the very numbers the request's span (exported over OTLP to a receiver in this process)
and the admin API's views (/admin/usage from the usage ledger, /admin/tenants) report."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from headroom.admission.tenants import TenantRegistry
from headroom.app.background import BackgroundServer
from headroom.app.response_metrics import reports_metrics
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ObservabilityConfig,
    SchedulerConfig,
    ServerConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine
from tests.admin.conftest import wait_until
from tests.observability.test_tracing_otlp import Collected, GrpcReceiver, attributes

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
KEYS = {
    *("size_class", "cached_tokens", "admission_wait_s", "queue_wait_s", "ttft_s", "tpot_s", "device_time_s"),
    *("spec_draft_tokens", "spec_accepted_tokens"),
}
# Long enough that a second request with it is served from the prefix cache (blocks of 16).
QUESTION = "Name three rivers of Europe and the seas they flow into, one line each, nothing more."
METERED = ("m-chat", "m-text", "m-resp", "m-misc")


@pytest.fixture(scope="module")
def traced(default_model, tmp_path_factory):
    """A server exporting its spans to `collected`, with the usage ledger and the admin API
    on, and tenants who ask for metrics (the server does not)."""
    collected = Collected()
    receiver = GrpcReceiver(collected)
    tenants = (TenantConfig("default"), *(TenantConfig(n, request_metrics=True) for n in METERED))
    ledger = tmp_path_factory.mktemp("ledger") / "usage.db"
    config = Config(
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8),
        admission=AdmissionConfig(tenants=tenants),
        observability=ObservabilityConfig(usage_ledger_path=str(ledger)),
        admin=AdminConfig(token=ADMIN_TOKEN),
    )
    with pytest.MonkeyPatch.context() as env:  # read when the server's tracer is built
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    server.collected = collected
    yield server
    server.stop()
    receiver.stop()


def post(server, path: str, body: dict, tenant: str = "default") -> httpx.Response:
    r = httpx.post(server.url + path, json=body, headers={"X-Tenant": tenant}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def admin(server, path: str) -> dict:
    r = httpx.get(server.url + "/admin" + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def span_of(server, request_id: str) -> dict:
    def find() -> dict | None:
        with server.collected.lock:
            for _, span in server.collected.spans:
                attrs = attributes(span.attributes)
                if attrs.get("gen_ai.response.id") == request_id:
                    return attrs
        return None

    found = wait_until(find, timeout=30)
    assert found is not None, f"no span for {request_id}"
    return found


CHAT = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "ignore_eos": True}


@pytest.mark.slow
@pytest.mark.parametrize(
    "tenant, path, body, stream",
    [
        ("m-chat", "/v1/chat/completions", {**CHAT, "stream": True}, True),
        ("m-text", "/v1/completions", {"prompt": QUESTION, "max_tokens": 6, "ignore_eos": True}, False),
        ("m-resp", "/v1/responses", {"input": QUESTION, "max_output_tokens": 6, "stream": True}, True),
    ],
)
def test_the_metrics_object_equals_the_span_and_the_admin_views(traced, tenant, path, body, stream):
    warm = {k: v for k, v in body.items() if k != "stream"}
    post(traced, path, warm)  # the default tenant puts the prompt in the prefix cache
    r = post(traced, path, body, tenant)
    if stream:
        last = events(r)[-1]
        metrics = (last["response"] if path == "/v1/responses" else last)["metrics"]
        request_id = last["response"]["id"] if path == "/v1/responses" else last["id"]
    else:
        metrics, request_id = r.json()["metrics"], r.json()["id"]
    assert set(metrics) == KEYS
    # Not vacuous: every number is one the request really has.
    assert 0 <= metrics["admission_wait_s"] <= metrics["queue_wait_s"] <= metrics["ttft_s"]
    assert metrics["tpot_s"] > 0 and metrics["device_time_s"] > 0 and metrics["cached_tokens"] >= 16
    assert metrics["size_class"] in ("short", "medium", "long")

    span = span_of(traced, request_id)
    assert {key: span[f"headroom.{key}"] for key in KEYS} == metrics
    assert span["headroom.tenant"] == tenant

    # The ledger's row and the tenant's fair-share charge; one request each, so totals are its own.
    assert wait_until(lambda: _tenant(traced, tenant)["in_flight_tokens"] == 0)  # settled
    assert _tenant(traced, tenant)["engine_seconds"] == metrics["device_time_s"]
    [usage] = [u for u in admin(traced, "/usage")["tenants"] if u["tenant"] == tenant]
    assert usage["device_seconds"] == metrics["device_time_s"]
    assert usage["cached_prompt_tokens"] == metrics["cached_tokens"]
    assert usage["admission_wait_seconds"] == metrics["admission_wait_s"]
    assert sum(usage["requests"].values()) == 1


def _tenant(server, name: str) -> dict:
    [found] = [t for t in admin(server, "/tenants")["data"] if t["name"] == name]
    return found


@pytest.mark.slow
def test_off_unless_asked_for(traced):
    chat = post(traced, "/v1/chat/completions", CHAT).json()
    assert "metrics" not in chat and chat["usage"]["completion_tokens"] == 6
    streamed = events(
        post(traced, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert streamed[-1]["usage"]["completion_tokens"] == 6
    assert not [e for e in streamed if "metrics" in e]
    response = post(traced, "/v1/responses", {"input": QUESTION, "max_output_tokens": 6}).json()
    assert "metrics" not in response and response["status"] == "incomplete"


@pytest.mark.slow
def test_where_the_metrics_go(traced):
    """On the last chunk of a stream: the usage chunk when asked for, else the final
    choice's; with n choices null, as vLLM (no one set of timings is the request's)."""
    client = openai.OpenAI(
        base_url=traced.url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Tenant": "m-misc"}
    )
    res = client.chat.completions.create(model=traced.engine.loaded.name, messages=CHAT["messages"], max_tokens=3)
    assert set(res.model_extra["metrics"]) == KEYS
    for options, last_kind in ((None, "finish"), ({"include_usage": True}, "usage")):
        body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
        chunks = events(post(traced, "/v1/chat/completions", body, "m-misc"))
        assert [i for i, c in enumerate(chunks) if "metrics" in c] == [len(chunks) - 1]
        last = chunks[-1]
        if last_kind == "usage":
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        else:
            assert last["choices"][0]["finish_reason"] == "length"
        assert set(last["metrics"]) == KEYS
    two = {"prompt": QUESTION, "max_tokens": 2, "n": 2}
    body = post(traced, "/v1/completions", two, "m-misc").json()
    assert len(body["choices"]) == 2 and body["metrics"] is None
    streamed = events(post(traced, "/v1/completions", {**two, "stream": True}, "m-misc"))
    assert [c["metrics"] for c in streamed if "metrics" in c] == [None]
    assert "metrics" in streamed[-1]


def test_a_tenants_own_setting_wins_over_the_servers():
    registry = TenantRegistry(
        AdmissionConfig(
            tenants=(
                TenantConfig("default"),
                TenantConfig("on", request_metrics=True),
                TenantConfig("off", request_metrics=False),
            )
        )
    )
    for server_on in (False, True):
        server = ServerConfig(request_metrics=server_on)
        reported = [reports_metrics(server, registry.get(n)) for n in ("default", "on", "off")]
        assert reported == [server_on, True, False]
