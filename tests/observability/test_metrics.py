"""/metrics on the real server: exact counter deltas and per-class histogram counts for a
known workload."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

CONFIG = Config(cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=8))


@pytest.fixture(scope="module")
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


def scrape(server) -> dict[tuple, float]:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def observations(before: dict, after: dict, histogram: str, size_class: str) -> float:
    return delta(before, after, histogram + "_count", size_class=size_class, tier="standard")


def completion(server, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def wait_for(server, before, name, labels, expected, timeout=10.0) -> dict:
    # The span/metrics hook runs just after the last byte is written; give it that moment.
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(server)
        if delta(before, after, name, **labels) >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def test_known_workload_moves_counters_and_histograms_exactly(server):
    wait_idle(server.engine)
    before = scrape(server)
    # Three short requests (small prompts, few tokens) and one long one (a 1,600-token
    # prompt is long by prompt length alone), each running to max_tokens.
    shorts = [([1, 2, 3, 4, 5], 3), (list(range(10, 30)), 5), (list(range(100, 140)), 1)]
    long_prompt = [(7 * i) % 40000 + 20 for i in range(1600)]
    for prompt, max_tokens in shorts:
        r = completion(server, prompt, max_tokens)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
    r = completion(server, long_prompt, 2)
    assert r.status_code == 200
    # A bad request never reaches the engine and moves no request metric.
    assert completion(server, [], 3).status_code == 400

    after = wait_for(
        server, before, "headroom:e2e_request_latency_seconds_count", {"size_class": "long", "tier": "standard"}, 1
    )
    assert delta(before, after, "headroom:prompt_tokens_total") == 5 + 20 + 40 + 1600
    assert delta(before, after, "headroom:generation_tokens_total") == 3 + 5 + 1 + 2
    assert delta(before, after, "headroom:request_success_total", finished_reason="length") == 4
    assert delta(before, after, "headroom:request_success_total", finished_reason="stop") == 0
    assert delta(before, after, "headroom:admission_decisions_total", decision="admit") == 4
    assert delta(before, after, "headroom:num_preemptions_total") == 0
    # n-gram speculation is on by default: whether these rows guessed is the price's call, but
    # a guess is one token of one row, each kept one is a guessed one, and every request's
    # own tokens (one a step, its first included) are never guesses.
    spec = {c: f"headroom:spec_decode_{c}_total" for c in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert all((name, ()) in after for name in spec.values())
    drafts, guessed, kept = (delta(before, after, name) for name in spec.values())
    assert drafts <= guessed <= 4 * drafts and kept <= guessed and kept <= (3 + 5 + 1 + 2) - 4
    for name in (
        "headroom:time_to_first_token_seconds",
        "headroom:request_queue_time_seconds",
        "headroom:e2e_request_latency_seconds",
        "headroom:request_device_time_seconds",
    ):
        assert observations(before, after, name, "short") == 3, name
        assert observations(before, after, name, "long") == 1, name
    # Time per output token needs two tokens: the 1-token short request has none.
    tpot = "headroom:time_per_output_token_seconds"
    assert observations(before, after, tpot, "short") == 2
    assert observations(before, after, tpot, "long") == 1
    # Engine time by class: the long prefill costs more than the three short requests.
    long_s = delta(before, after, "headroom:device_time_seconds_total", size_class="long")
    short_s = delta(before, after, "headroom:device_time_seconds_total", size_class="short")
    assert long_s > short_s > 0
    # Idle again: nothing running, nothing held, nothing reserved.
    assert after[("headroom:num_requests_running", ())] == 0
    assert after[("headroom:kv_cache_blocks_used", ())] == 0
    assert after[("headroom:kv_cache_blocks_total", ())] == 256
    assert after[("headroom:tenant_tokens_in_flight", (("tenant", "default"),))] == 0


def test_a_client_that_leaves_is_counted_as_an_abort(server):
    wait_idle(server.engine)
    before = scrape(server)
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                break  # a first token arrived; hang up
    wait_idle(server.engine)
    after = wait_for(server, before, "headroom:request_aborts_total", {"cause": "client_disconnect"}, 1)
    assert delta(before, after, "headroom:request_aborts_total", cause="client_disconnect") == 1
    assert delta(before, after, "headroom:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "headroom:generation_tokens_total") < 400
    assert after[("headroom:tenant_tokens_in_flight", (("tenant", "default"),))] == 0
