"""Three headroom processes on 127.0.0.1 sharing one real redis-server: a tenant that
floods all three never has more tokens in flight, summed over the fleet, than its cap;
another tenant still gets served; Redis stopped and restarted mid-load costs no 5xx and
ends with Redis counting exactly what the replicas hold; a replica killed with -9
mid-stream gives its reservations back within the lease TTL."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.load]

FLOOD_CAP = 120  # a short request costs ~30 tokens: about four in flight, fleet-wide
TTL_S = 2.0
CONFIG = """
[admission]
store = "{url}"
fleet_size = 3
lease_ttl_s = {ttl}
default_tenant = "steady"

# The flood's requests queue for ~4 places fleet-wide, each held 4-5 s with three engines
# on two cores: one queue across the fleet serves them in order, within the default wait.
[[admission.tenants]]
name = "flood"
max_in_flight_tokens = {cap}

[[admission.tenants]]
name = "other"
max_in_flight_tokens = {cap}

# Three streams of up to 7,000 tokens, one a replica, held open until the test ends them.
[[admission.tenants]]
name = "steady"
max_in_flight_tokens = 24000
"""
ADMIN = "fleet-test-admin-token-0123456789"
SHORT = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}


class Replica:
    def __init__(self, config: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "headroom.app.cli",
                "serve",
                "--port",
                str(self.port),
                "--config",
                str(config),
                "--num-kv-blocks",
                "512",
                "--max-num-seqs",
                "16",
            ],
            # Three engines share two cores: one thread each, or they thrash.
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HEADROOM_ADMIN_TOKEN": ADMIN},
        )

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"replica exited: see {self.log.name}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail(f"replica on {self.port} did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    store = RedisServer(free_port()).start()
    config = tmp / "fleet.toml"
    config.write_text(CONFIG.format(url=store.url, ttl=TTL_S, cap=FLOOD_CAP))
    replicas = [Replica(config, tmp / f"replica{i}.log") for i in range(3)]
    try:
        for r in replicas:
            r.wait_ready()
        yield store, replicas
    finally:
        for r in replicas:
            r.stop()
        store.stop()


async def redis_in_flight(client: aioredis.Redis, tenant: str) -> tuple[int, int]:
    """(in_flight counter, sum of lease costs) of `tenant`, read in one transaction."""
    async with client.pipeline(transaction=True) as pipe:
        bucket, costs = (
            await pipe.hget(f"headroom:tenant:{tenant}:bucket", "in_flight")
            .hvals(f"headroom:tenant:{tenant}:lease_cost")
            .execute()
        )
    return int(bucket or 0), sum(int(c) for c in costs)


async def lease_expiries(client: aioredis.Redis, tenant: str) -> tuple[int, dict[str, int]]:
    """Redis's clock and when each lease of `tenant` lapses on it, in ms, read in one transaction."""
    async with client.pipeline(transaction=True) as pipe:
        (seconds, micros), leases = (
            await pipe.time().zrange(f"headroom:tenant:{tenant}:lease_expiry", 0, -1, withscores=True).execute()
        )
    return seconds * 1000 + micros // 1000, {lease.decode(): int(expiry) for lease, expiry in leases}


async def metric(session: aiohttp.ClientSession, replica: Replica, name: str, **labels: str) -> float:
    async with session.get(replica.url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} missing from /metrics")


async def queue_depth(session: aiohttp.ClientSession, replica: Replica) -> tuple[float, float, float]:
    """(queue depth reported, waiting in admission, waiting in the engine), from one scrape."""
    async with session.get(replica.url + "/metrics") as r:
        samples = [s for f in text_string_to_metric_families(await r.text()) for s in f.samples]
    backlog = sum(s.value for s in samples if s.name == "headroom:tenant_requests_waiting")
    scalars = {s.name: s.value for s in samples if not s.labels}
    return scalars["headroom:num_requests_queued"], backlog, scalars["headroom:num_requests_waiting"]


async def local_in_flight(session: aiohttp.ClientSession, replica: Replica, tenant: str) -> int:
    return int(await metric(session, replica, "headroom:tenant_tokens_in_flight", tenant=tenant))


async def send(
    session: aiohttp.ClientSession, replica: Replica, tenant: str, n: int, statuses: list[int], body: dict = SHORT
) -> None:
    for _ in range(n):
        async with session.post(replica.url + "/v1/completions", json=body, headers={"X-Tenant": tenant}) as r:
            await r.read()
            statuses.append(r.status)


async def hold_stream(
    session: aiohttp.ClientSession, replica: Replica, tenant: str, body: dict, statuses: list[int]
) -> None:
    """A streamed request read until its task is cancelled (the client hangs up) or it ends."""
    async with session.post(replica.url + "/v1/completions", json=body, headers={"X-Tenant": tenant}) as r:
        statuses.append(r.status)
        async for _ in r.content:
            pass


@pytest.mark.asyncio
async def test_flood_on_every_replica_stays_within_the_tenant_cap(fleet):
    store, replicas = fleet
    client = aioredis.Redis(port=store.port)
    flood_statuses: list[int] = []
    other_statuses: list[int] = []
    samples: list[int] = []
    other_seen = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal other_seen
        while not done.is_set():
            in_flight, leased = await redis_in_flight(client, "flood")
            assert in_flight == leased <= FLOOD_CAP
            samples.append(in_flight)
            other_seen = max(other_seen, (await redis_in_flight(client, "other"))[0])
            await asyncio.sleep(0.005)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler = asyncio.create_task(sample())
        flood = asyncio.gather(*(send(session, r, "flood", 4, flood_statuses) for r in replicas for _ in range(4)))
        try:
            # Wait for the flood to reach its cap and queue behind it: 12 flood clients, about
            # 4 admitted fleet-wide. The deadline is a safety net only.
            deadline = time.monotonic() + 60
            while True:
                depths = [await queue_depth(session, r) for r in replicas]
                if sum(backlog for _, backlog, _ in depths) >= 4:
                    break
                assert time.monotonic() < deadline, f"the flood never queued behind its cap: {depths}"
                await asyncio.sleep(0.05)
            # Queue depth for the router and the autoscaler counts admission's backlog too.
            assert all(queued == waiting + backlog for queued, backlog, waiting in depths), depths
            await asyncio.gather(*(send(session, r, "other", 2, other_statuses) for r in replicas))
            assert not flood.done(), "the other tenant was served only after the flood"
            await flood
        finally:
            done.set()  # a failure above must end the sampler and the flood, not leave them running
            flood.cancel()
        await sampler
        per_replica = [await local_in_flight(session, r, "flood") for r in replicas]
    assert flood_statuses == [200] * 48 and other_statuses == [200] * 6
    # The cap held fleet-wide and was what held the flood back (each replica alone allows 120).
    assert FLOOD_CAP - 35 < max(samples) <= FLOOD_CAP
    assert other_seen > 0 and per_replica == [0, 0, 0]
    assert await redis_in_flight(client, "flood") == (0, 0)
    await client.aclose()


@pytest.mark.asyncio
async def test_redis_restarted_mid_load_no_5xx_and_counters_resync(fleet):
    store, replicas = fleet
    client = aioredis.Redis(port=store.port)
    statuses: list[int] = []
    steady_statuses: list[int] = []
    # Streams the test ends itself (by hanging up) once the recovery is checked, rather
    # than ones that must outlast it: 300 and then 1,500 tokens both raced decode speed.
    # 7,000 tokens is what a replica's 8,192-token cache holds beside the flood.
    long_body = {
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 7000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        # Long streams that run through the outage and past the recovery.
        steady = asyncio.gather(*(hold_stream(session, r, "steady", long_body, steady_statuses) for r in replicas))
        flood = asyncio.gather(*(send(session, r, "flood", 3, statuses) for r in replicas for _ in range(3)))
        try:
            await asyncio.sleep(1.0)
            store.stop()
            outage_samples = []
            degraded = set()
            # At least 2.5 s of outage, and on until what replicas held above their shares at the
            # loss has drained (its requests finish at the machine's pace), within 60 s.
            deadline, drained_by = time.monotonic() + 2.5, time.monotonic() + 60

            def outage_goes_on() -> bool:
                now = time.monotonic()
                return now < deadline or (now < drained_by and sum(outage_samples[-1]) > FLOOD_CAP)

            while outage_goes_on():
                locals_ = [await local_in_flight(session, r, "flood") for r in replicas]
                outage_samples.append(locals_)
                for i, r in enumerate(replicas):
                    async with session.get(r.url + "/health") as h:
                        body = await h.json()
                        assert h.status == 200
                        if body["status"] == "degraded":
                            assert body["admission_store"]["available"] is False
                            degraded.add(i)
                await asyncio.sleep(0.05)
            assert degraded == {0, 1, 2}
            assert [await metric(session, r, "headroom:admission_store_up") for r in replicas] == [0, 0, 0]
            assert [await metric(session, r, "headroom:admission_store_fallbacks") for r in replicas] == [1, 1, 1]
            async with session.get(replicas[0].url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                view = (await r.json())["admission_store"]
            assert view["kind"] == "redis" and view["available"] is False and view["reason"]
            store.start()  # empty: it lost every counter and lease
            # Without Redis each replica admits only within its share (1/3 of the cap): any rise
            # of its in-flight tokens ends within it. What replicas held above their share at
            # the loss drains, and then the shares add up to the cap.
            share = FLOOD_CAP // 3
            for before, after in itertools.pairwise(outage_samples):
                assert all(b <= a or b <= share for a, b in zip(before, after)), (before, after)
            assert sum(outage_samples[-1]) <= FLOOD_CAP
            assert any(0 < sum(sample) for sample in outage_samples)
            # Wait until every replica is back on the shared store.
            deadline = time.monotonic() + 10
            while True:
                healths = [(await (await session.get(r.url + "/health")).json())["status"] for r in replicas]
                if healths == ["ok"] * 3:
                    break
                assert time.monotonic() < deadline, healths
                await asyncio.sleep(0.1)
            assert [await metric(session, r, "headroom:admission_store_up") for r in replicas] == [1, 1, 1]
            assert not steady.done(), "the long streams ended before the recovery could be checked"
            await asyncio.sleep(TTL_S / 3 + 0.2)  # one renewal round on every replica
            redis_view = await redis_in_flight(client, "steady")
            really = sum([await local_in_flight(session, r, "steady") for r in replicas])
            assert not steady.done()
            assert redis_view == (really, really) and really > 0
            await flood
        finally:
            # Hang up the streams (and the flood, on a failure): each replica aborts them and
            # returns their reservations, which the checks below wait for.
            flood.cancel()
            steady.cancel()
            await asyncio.gather(flood, steady, return_exceptions=True)
    assert statuses == [200] * 27 and steady_statuses == [200] * 3
    deadline = time.monotonic() + 5
    while await redis_in_flight(client, "steady") != (0, 0) or await redis_in_flight(client, "flood") != (0, 0):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await client.aclose()


@pytest.mark.asyncio
async def test_kill_9_mid_stream_returns_reservations_within_the_ttl(fleet):
    store, replicas = fleet
    victim = replicas[2]
    client = aioredis.Redis(port=store.port)
    body = {**SHORT, "max_tokens": 300, "ignore_eos": True, "stream": True, "prompt": "Tell me a story."}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        streams = []
        for _ in range(2):
            r = await session.post(victim.url + "/v1/completions", json=body, headers={"X-Tenant": "steady"})
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: {")  # streaming: admitted and running
            streams.append(r)
        held, leased = await redis_in_flight(client, "steady")
        assert held == leased > 0
        victim.proc.kill()
        killed, expiries = await lease_expiries(client, "steady")
        for r in streams:
            r.close()
    # Timed on Redis's clock, which also decides expiry, so a slow test cannot skew it:
    # each lease lapses one TTL after its last renewal, which came before the kill.
    assert expiries and all(lease.startswith(f"{socket.gethostname()}:{victim.port}|") for lease in expiries)
    assert max(expiries.values()) <= killed + 1000 * TTL_S
    # The survivors' scripts reclaim them (they renew every TTL/3); the deadline is a
    # safety net only.
    deadline = time.monotonic() + 60
    while True:
        now, left = await lease_expiries(client, "steady")
        assert {lease for lease, expiry in expiries.items() if expiry > now} <= left.keys(), (
            "a lease was given back before it lapsed"
        )
        if await redis_in_flight(client, "steady") == (0, 0):
            break
        assert time.monotonic() < deadline, f"leases never reclaimed: {left}"
        await asyncio.sleep(0.05)
    await client.aclose()
