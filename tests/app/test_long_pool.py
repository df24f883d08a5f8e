"""Long-class requests proxied to another headroom instance (pools.long.url)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headroom.app.admission_gate import FAIRNESS_HEADER, OBJECTIVE_HEADER
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdmissionConfig,
    CacheConfig,
    Config,
    PoolConfig,
    PoolsConfig,
    SchedulerConfig,
)
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

BASE = Config(
    cache=CacheConfig(num_blocks=256),
    scheduler=SchedulerConfig(max_num_seqs=4),
    admission=AdmissionConfig(objectives={"interactive": "premium"}),
)
LONG_PROMPT = "lorem ipsum " * 350  # ~1,750 tokens: over long_min_prompt_tokens (1,536)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pools(default_model):
    long_pool = BackgroundServer(BASE, Engine(BASE, loaded=default_model)).start()
    front_config = Config(
        cache=BASE.cache,
        scheduler=BASE.scheduler,
        admission=BASE.admission,
        pools=PoolsConfig(long=PoolConfig(url=long_pool.url)),
    )
    front = BackgroundServer(front_config, Engine(front_config, loaded=default_model)).start()
    yield front, long_pool
    front.stop()
    long_pool.stop()


def test_long_request_is_served_by_the_long_pool(pools):
    front, long_pool = pools
    front_started, pool_started = front.engine.stats.requests_started, long_pool.engine.stats.requests_started
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(front.url + "/v1/completions", json=body, headers={"X-Request-Id": "long-1"}, timeout=120)
    assert r.status_code == 200 and r.headers["X-Headroom-Pool"] == "long"
    assert r.json()["id"] == "cmpl-long-1" and r.json()["usage"]["completion_tokens"] == 4
    assert long_pool.engine.stats.requests_started == pool_started + 1
    assert front.engine.stats.requests_started == front_started
    direct = httpx.post(long_pool.url + "/v1/completions", json=body, timeout=120).json()
    assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]


def test_the_gateways_identity_goes_with_a_proxied_request(pools):
    """The long pool admits a proxied request as the tenant and tier the gateway named."""
    front, long_pool = pools
    headers = {FAIRNESS_HEADER: "team-long", OBJECTIVE_HEADER: "interactive"}
    body = {"prompt": LONG_PROMPT, "max_tokens": 2}
    r = httpx.post(front.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["X-Headroom-Pool"] == "long"
    text = httpx.get(long_pool.url + "/metrics").text
    samples = {f.name: f.samples for f in text_string_to_metric_families(text)}
    charged = [
        (s.labels["tenant"], s.labels["outcome"], s.value)
        for s in samples["headroom:tenant_requests"]
        if s.labels["tenant"] == "team-long"
    ]
    assert charged == [("team-long", "length", 1.0)]
    tiers = {
        s.labels["tier"]: s.value
        for s in samples["headroom:e2e_request_latency_seconds"]
        if s.name.endswith("_count") and s.value
    }
    assert tiers.get("premium") == 1.0


def test_streamed_long_request_passes_through_intact(pools):
    front, _ = pools
    body = {"prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_short_request_stays_local(pools):
    front, long_pool = pools
    pool_started = long_pool.engine.stats.requests_started
    r = httpx.post(front.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and "X-Headroom-Pool" not in r.headers
    assert long_pool.engine.stats.requests_started == pool_started


def test_unreachable_long_pool_is_502(default_model):
    config = Config(
        cache=BASE.cache,
        scheduler=BASE.scheduler,
        pools=PoolsConfig(long=PoolConfig(url=f"http://127.0.0.1:{_unused_port()}")),
    )
    front = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        r = httpx.post(front.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert r.json()["error"]["type"] == "server_error"
    finally:
        front.stop()
