"""Admission on the real server: tenants by API key, fair share under a flood, caps."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdmissionConfig,
    CacheConfig,
    Config,
    SchedulerConfig,
    ServerConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

A_CAP = 700
CONFIG = Config(
    cache=CacheConfig(num_blocks=256),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    server=ServerConfig(max_queue_len=64),
    admission=AdmissionConfig(
        auth=True,
        global_max_in_flight_seqs=4,
        tenants=(
            TenantConfig("flooder", api_keys=("key-a",), max_in_flight_tokens=A_CAP, max_queue=40,
                         rate_tokens_per_s=1e6, burst_tokens=10**6),
            TenantConfig("light", tier="premium", api_keys=("key-b",), max_queue=2, max_wait_s=60,
                         rate_tokens_per_s=1e6, burst_tokens=10**6, max_tokens=24),
        ),
        default_tenant="flooder",
    ),
)


@pytest.fixture(scope="module")
def server(default_model):
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


def post(server, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_unknown_or_missing_key_is_401(server):
    for key in (None, "nope"):
        r = post(server, key, {"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_tenant_hard_max_tokens_caps_the_request(server):
    r = post(server, "key-b", {"prompt": "Count to a hundred:", "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24


def test_flood_from_one_tenant_does_not_starve_another(server):
    gate = server.app[keys.GATE]
    flooder = gate.registry.get("flooder")
    peak = 0
    finished: list[tuple[str, float]] = []

    async def watch(stop: asyncio.Event) -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, flooder.bucket.in_flight)
            await asyncio.sleep(0.002)

    async def one(session: aiohttp.ClientSession, key: str, tag: str) -> None:
        body = {"prompt": "Tell me about the moon.", "max_tokens": 24, "ignore_eos": True}
        async with session.post(server.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        finished.append((tag, asyncio.get_running_loop().time()))

    async def run() -> None:
        stop = asyncio.Event()
        # The watcher runs on the server's loop, where the bucket lives.
        watcher = asyncio.run_coroutine_threadsafe(watch(stop), server.loop)
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(one(session, "key-a", f"a{i}")) for i in range(16)]
            await asyncio.sleep(1.0)  # the flooder's backlog is queued in admission now
            light = [asyncio.create_task(one(session, "key-b", f"b{i}")) for i in range(2)]
            await asyncio.gather(*flood, *light)
        server.loop.call_soon_threadsafe(stop.set)
        watcher.result(10)

    asyncio.run(run())
    order = [tag for tag, _ in sorted(finished, key=lambda x: x[1])]
    assert len(order) == 18
    # The light tenant's requests finish while most of the flood is still queued.
    last_b = max(order.index("b0"), order.index("b1"))
    assert last_b < 12, order
    assert 0 < peak <= A_CAP
    wait_idle(server.engine)
    assert flooder.bucket.in_flight == 0 and gate.registry.get("light").bucket.in_flight == 0
    assert gate.admission.in_flight_seqs == 0


def test_tenant_queue_full_is_429_with_retry_after(server):
    async def run() -> list[tuple[int, dict, dict]]:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Write a poem.", "max_tokens": 24, "ignore_eos": True}

            async def one():
                async with session.post(server.url + "/v1/completions", json=body,
                                        headers={"Authorization": "Bearer key-b"}) as r:
                    return r.status, dict(r.headers), await r.json()

            # Hold all four global seats with the flooder (4 x ~160 tokens fit its cap of 700)
            # so the light tenant must queue.
            hold = {"prompt": "Tell me a long story.", "max_tokens": 150, "ignore_eos": True, "stream": True}
            holders = [await session.post(server.url + "/v1/completions", json=hold,
                                          headers={"Authorization": "Bearer key-a"}) for _ in range(4)]
            results = await asyncio.gather(*(one() for _ in range(3)))
            for h in holders:
                h.close()
            return results

    results = asyncio.run(run())
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(429) >= 1
    rejected = next((h, b) for s, h, b in results if s == 429)
    assert int(rejected[0]["Retry-After"]) >= 1
    assert rejected[1]["error"]["type"] == "rate_limit_error"
    assert rejected[1]["error"]["code"] == "tenant_queue_full"
    wait_idle(server.engine)
