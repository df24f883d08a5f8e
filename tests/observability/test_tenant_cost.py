"""Cost per tenant in /metrics and the usage ledger, over a scripted run on the real
server: two tenants, a client that disconnects mid-stream, a 429, a restart. The sums
must add up: requests by outcome and prompt tokens exactly, output tokens to the
engine's own count, device-seconds to the engine's busy time, the ledger to the counters."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ObservabilityConfig,
    SchedulerConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-usage-tests-0123"
CONFIG = Config(
    cache=CacheConfig(num_blocks=256),
    admin=AdminConfig(token=ADMIN),
    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    admission=AdmissionConfig(
        auth=True,
        tenants=(
            TenantConfig("alpha", api_keys=("key-alpha",), rate_tokens_per_s=1e6, burst_tokens=10**6),
            # A bucket that one request empties and that refills too slowly for the next to wait.
            TenantConfig("beta", api_keys=("key-beta",), rate_tokens_per_s=1.0, burst_tokens=100, max_wait_s=0.2),
        ),
        default_tenant="alpha",
    ),
)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 20000 + 500 for i in range(n)]


def complete(server, key: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def usage(server, query: str = "") -> httpx.Response:
    return httpx.get(server.url + "/admin/usage" + query, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)


def test_tenant_costs_add_up_over_a_scripted_run(default_model, tmp_path):
    ledger = tmp_path / "usage.sqlite"
    config = dataclasses.replace(CONFIG, observability=ObservabilityConfig(usage_ledger_path=str(ledger)))
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    # Each request the engine ran, once it is done with it: the facts its cost comes from.
    closed = []
    charge = server.app[keys.ENGINE].on_closed
    server.app[keys.ENGINE].on_closed = lambda request: (closed.append(request), charge(request))
    try:
        fixed = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
        assert complete(server, "key-alpha", {"prompt": prompt(40, 1), **fixed}).status_code == 200
        assert complete(server, "key-alpha", {"prompt": prompt(25, 2), **fixed}).status_code == 200
        # A client that hangs up after a few tokens: the engine aborts it.
        body = {"prompt": prompt(30, 3), "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json=body,
            headers={"Authorization": "Bearer key-alpha"},
            timeout=120,
        ) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    seen += 1
                if seen == 3:
                    break
        # Bigger than beta's burst: it goes on a full bucket and leaves it in debt.
        assert complete(server, "key-beta", {"prompt": prompt(120, 4), **fixed}).status_code == 200
        refused = complete(server, "key-beta", {"prompt": prompt(10, 5), **fixed})
        assert refused.status_code == 429
        wait_idle(server.engine)
        # With auth on, /metrics is the operator's: the admin token reads it.
        metrics = samples(
            httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
        )
        billed = usage(server).json()
        csv_text = usage(server, "?format=csv").text
    finally:
        server.stop()

    def value(name: str, **labels) -> float:
        return metrics.get((name, tuple(sorted(labels.items()))), 0.0)

    requests = {
        (dict(k[1])["tenant"], dict(k[1])["outcome"]): v
        for k, v in metrics.items()
        if k[0] == "headroom:tenant_requests_total"
    }
    assert requests == {("alpha", "length"): 2, ("alpha", "abort"): 1, ("beta", "length"): 1, ("beta", "rejected"): 1}
    assert value("headroom:tenant_prompt_tokens_total", tenant="alpha") == 40 + 25 + 30
    assert value("headroom:tenant_prompt_tokens_total", tenant="beta") == 120  # the refused one never ran
    alpha_out = value("headroom:tenant_output_tokens_total", tenant="alpha")
    assert value("headroom:tenant_output_tokens_total", tenant="beta") == 8
    assert alpha_out >= 16 + 3  # two of 8, and the abandoned stream's tokens up to its abort
    assert alpha_out + 8 == value("headroom:generation_tokens_total")
    busy = value("headroom:engine_busy_seconds_total")
    device = sum(value("headroom:tenant_device_seconds_total", tenant=t) for t in ("alpha", "beta"))
    assert busy > 0 and abs(device - busy) <= 0.02 * busy
    assert sorted(r.tenant for r in closed) == ["alpha"] * 3 + ["beta"]  # the refused one never ran
    for tenant in ("alpha", "beta"):
        assert value("headroom:tenant_kv_block_seconds_total", tenant=tenant) > 0
        # Arrival to admission of each request that ran; the refused one was never admitted.
        waits = [r.admitted_time - r.arrival_time for r in closed if r.tenant == tenant]
        assert min(waits) > 0
        assert value("headroom:tenant_admission_wait_seconds_total", tenant=tenant) == pytest.approx(
            sum(waits), rel=1e-9
        )

    # The ledger's totals are the counters' (and survive a restart).
    assert [t["tenant"] for t in billed["tenants"]] == ["alpha", "beta"]
    for t in billed["tenants"]:
        name = t["tenant"]
        assert {o: n for o, n in t["requests"].items() if n} == {
            o: n for (tenant, o), n in requests.items() if tenant == name
        }
        for field, metric in [
            ("prompt_tokens", "prompt_tokens"),
            ("cached_prompt_tokens", "cached_prompt_tokens"),
            ("output_tokens", "output_tokens"),
            ("device_seconds", "device_seconds"),
            ("kv_block_seconds", "kv_block_seconds"),
            ("admission_wait_seconds", "admission_wait_seconds"),
        ]:
            assert t[field] == pytest.approx(value(f"headroom:tenant_{metric}_total", tenant=name), rel=1e-9), field
    header, *rows = csv_text.strip().splitlines()
    assert header == (
        "tenant,requests_stop,requests_length,requests_repetition,requests_abort,requests_rejected,"
        "requests_invalid,"
        "requests_routed,requests_error,prompt_tokens,cached_prompt_tokens,output_tokens,"
        "device_seconds,kv_block_seconds,admission_wait_seconds"
    )
    assert [r.split(",")[:6] for r in rows] == [["alpha", "0", "2", "0", "1", "0"], ["beta", "0", "1", "0", "0", "1"]]

    again = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        assert usage(again).json()["tenants"] == billed["tenants"]
        assert usage(again, "?since=2000-01-01T00:00:00&until=2000-01-02").json()["tenants"] == []
        bad = usage(again, "?since=yesterday")
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "since must be unix seconds or an ISO 8601 time, got 'yesterday'"
        assert usage(again, "?format=xml").status_code == 400
    finally:
        again.stop()


def test_usage_is_409_without_a_ledger(default_model):
    server = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    try:
        r = usage(server)
        assert r.status_code == 409
        assert r.json()["error"]["message"] == "the usage ledger is off: set [observability] usage_ledger_path"
    finally:
        server.stop()
