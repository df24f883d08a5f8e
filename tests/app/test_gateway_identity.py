"""The gateway's identity on the real server: two fairness ids (the Gateway API Inference
Extension's x-gateway-inference-fairness-id) are two tenants, each charged for its own
requests, and admission serves them fairly, not in arrival order; the objective
(x-gateway-inference-objective) puts a request in the tier the config maps it to."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headroom.app.admission_gate import FAIRNESS_HEADER, OBJECTIVE_HEADER, TTFT_OBJECTIVE_HEADER
from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, AdmissionConfig, CacheConfig, Config, SchedulerConfig, TenantConfig
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
# One seat: what is admitted runs alone, so the order requests finish in is the order
# they were admitted in. No tenants configured: each fairness id is a tenant made on
# first sight. Charged by tokens, so a tenant's counter is exactly its tokens' weight.
CONFIG = Config(
    cache=CacheConfig(num_blocks=256),
    scheduler=SchedulerConfig(max_num_seqs=4),
    admission=AdmissionConfig(
        global_max_in_flight_seqs=1,
        fair_share="tokens",
        objectives={"interactive": "premium"},
        # Tenants made on first sight take the default tenant's limits. b3 waits behind
        # b1's 128 tokens, a1 and b2; on a loaded 2-core machine that passed the default
        # 30 s and it was refused. Waits are not what this test checks.
        tenants=(TenantConfig("default", max_wait_s=600),),
    ),
    admin=AdminConfig(token=ADMIN_TOKEN),
)
HOLD = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 128, "ignore_eos": True}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SHORT = {"prompt": "Say hi.", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


def test_two_fairness_ids_are_two_tenants_served_fairly(server):
    """team-b holds the seat and queues two more; team-a then queues one. Arrival order
    would serve b, b, b, a. VTC lifts team-a to team-b's counter when it arrives, and by
    the time the seat frees team-b's has grown by what its running request really used:
    team-a goes next (at a tie too, by name), then team-b's two."""

    async def run() -> tuple[list[str], dict[str, dict], dict[str, dict]]:
        finished: list[str] = []
        usage: dict[str, dict] = {}
        async with aiohttp.ClientSession(base_url=server.url) as session:

            async def tenants() -> dict[str, dict]:
                async with session.get("/admin/tenants", headers=ADMIN) as r:
                    return {t["name"]: t for t in (await r.json())["data"]}

            async def until(condition) -> None:
                for _ in range(1200):
                    if condition(await tenants()):
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("admission never got there")

            async def one(tag: str, team: str, body: dict, **headers: str) -> None:
                headers = {FAIRNESS_HEADER: team, **headers}
                async with session.post("/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    usage[tag] = (await r.json())["usage"]
                finished.append(tag)

            tasks = [asyncio.create_task(one("b1", "team-b", HOLD))]
            await until(lambda t: t.get("team-b", {}).get("in_flight_tokens", 0) > 0)
            tasks.append(asyncio.create_task(one("b2", "team-b", SHORT)))
            await until(lambda t: t["team-b"]["waiting"] == 1)
            tasks.append(asyncio.create_task(one("b3", "team-b", SHORT)))
            await until(lambda t: t["team-b"]["waiting"] == 2)
            objective = {OBJECTIVE_HEADER: "interactive"}
            tasks.append(asyncio.create_task(one("a1", "team-a", SHORT, **objective)))
            await until(lambda t: t.get("team-a", {}).get("waiting") == 1)
            assert finished == [], "the held seat came free before the queue was set up"
            await asyncio.gather(*tasks)
            await until(lambda t: t["team-a"]["in_flight_tokens"] == t["team-b"]["in_flight_tokens"] == 0)
            return finished, usage, await tenants()

    finished, usage, tenants = asyncio.run(run())
    assert finished == ["b1", "a1", "b2", "b3"]
    assert set(tenants) == {"default", "team-a", "team-b"}

    def weighted(tag: str) -> int:  # prompt_weight 1, output_weight 2
        return usage[tag]["prompt_tokens"] + 2 * usage[tag]["completion_tokens"]

    # Each team is charged its own requests' tokens ...
    b_tokens = weighted("b1") + weighted("b2") + weighted("b3")
    assert tenants["team-b"]["virtual_tokens"] == b_tokens
    # ... and team-a, lifted to team-b's counter on arrival, its own on top of that.
    assert b_tokens > tenants["team-a"]["virtual_tokens"] - weighted("a1") > 0
    text = httpx.get(server.url + "/metrics").text
    metrics = {f.name: f.samples for f in text_string_to_metric_families(text)}
    assert by_label(metrics["headroom:tenant_requests"], "tenant") == {"team-a": 1, "team-b": 3}
    device = by_label(metrics["headroom:tenant_device_seconds"], "tenant")
    assert set(device) == {"team-a", "team-b"}
    # The objective named a tier: team-a's request ran as premium, team-b's as their tenant's.
    latency = metrics["headroom:e2e_request_latency_seconds"]
    latency = [s for s in latency if s.name.endswith("_count")]
    assert by_label(latency, "tier") == {"premium": 1, "standard": 3}


def by_label(samples, label: str) -> dict[str, float]:
    """The non-zero sample values summed by one label."""
    totals: dict[str, float] = {}
    for sample in samples:
        if sample.value and not sample.name.endswith("_created"):
            totals[sample.labels[label]] = totals.get(sample.labels[label], 0) + sample.value
    return totals


def test_a_ttft_objective_that_is_not_a_number_of_milliseconds_is_a_400(server):
    """llm-d's x-llm-d-slo-ttft-ms orders a request within its tier (tests/runtime/
    test_policy.py); one that is not a positive number of milliseconds is refused."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        bad = client.post("/v1/completions", json=SHORT, headers={TTFT_OBJECTIVE_HEADER: "-3"})
        good = client.post("/v1/completions", json=SHORT, headers={TTFT_OBJECTIVE_HEADER: "1500"})
    assert bad.status_code == 400
    assert bad.json() == {
        "error": {
            "message": "x-llm-d-slo-ttft-ms must be a positive number of milliseconds, got '-3'",
            "type": "invalid_request_error",
            "param": "x-llm-d-slo-ttft-ms",
            "code": "invalid_ttft_objective",
        }
    }
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
