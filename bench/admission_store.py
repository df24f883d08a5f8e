"""What sharing tenant budgets through Redis costs admission.

1. One replica, one request at a time: the admission decision (Admission.acquire until
   the ticket is granted) and the settle round trip, with the embedded store and with
   the Redis store, p50/p99 over --requests requests, and the ratio.
2. Three replica processes on one Redis, each running --concurrency admit/settle loops
   for --seconds over four tenants: the admission decisions per second one Redis
   sustains, and its CPU share meanwhile. These two cores hold Redis, the three
   replicas and nothing else; there is no model here (tok/s across replicas cannot be
   shown on two cores).

Starts its own redis-server (Debian's package) on a free port on 127.0.0.1.

    python bench/admission_store.py [--requests 5000] [--seconds 10] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from headroom.admission.admission import Admission
from headroom.admission.redis_store import RedisStore
from headroom.admission.tenants import TenantRegistry
from headroom.config import AdmissionConfig, TenantConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from hol import cpu_line

from tests.fleet.redis_server import RedisServer, free_port

TENANTS = ("a", "b", "c", "d")


def config() -> AdmissionConfig:
    # Limits that never bind: what is timed is the decision, not a wait for tokens.
    return AdmissionConfig(
        tenants=tuple(
            TenantConfig(t, rate_tokens_per_s=1e9, burst_tokens=10**9, max_in_flight_tokens=10**9, max_queue=10_000)
            for t in TENANTS
        ),
        default_tenant="a",
        fleet_size=3,
    )


async def admission(url: str | None, replica: str) -> Admission:
    cfg = config()
    registry = TenantRegistry(cfg)
    store = None
    if url is not None:
        store = RedisStore(url, registry, replica_id=replica, fleet_size=cfg.fleet_size)
        await store.start()
        assert store.available, store.reason
    adm = Admission(cfg, registry, max_in_flight_seqs=10_000, store=store)
    adm.start()
    return adm


async def one_at_a_time(url: str | None, n: int) -> tuple[list[float], list[float]]:
    adm = await admission(url, "solo")
    decide, settle = [], []
    tenant = adm.registry.get("a")
    for i in range(n + 200):
        t0 = time.perf_counter()
        ticket = await adm.acquire(tenant, 300, prompt_tokens=100)
        t1 = time.perf_counter()
        adm.settle(ticket, 100, 150)
        await adm.flush()  # the settle's round trip, if there is one
        t2 = time.perf_counter()
        if i >= 200:  # warm-up: connections, script load
            decide.append(t1 - t0)
            settle.append(t2 - t1)
    await adm.close()
    if adm.store is not None:
        await adm.store.close()
    return decide, settle


def replica_worker(url: str, name: str, seconds: float, concurrency: int, start_at: float, out) -> None:
    async def run() -> int:
        adm = await admission(url, name)
        done = 0
        stop_at = start_at + seconds
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def loop(k: int) -> None:
            nonlocal done
            tenant = adm.registry.get(TENANTS[k % len(TENANTS)])
            while time.time() < stop_at:
                ticket = await adm.acquire(tenant, 300, prompt_tokens=100)
                adm.settle(ticket, 100, 150)
                done += 1

        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        await adm.flush()
        await adm.close()
        await adm.store.close()
        return done

    out.put((name, asyncio.run(run())))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


def pct(seconds: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(seconds, [50, 99]) * 1e6
    return p50, p99


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16, help="admit/settle loops per replica")
    ns = p.parse_args()
    print(cpu_line())
    redis = RedisServer(free_port()).start()
    try:
        print(f"\n1. one replica, one request at a time ({ns.requests} requests), microseconds")
        print(f"{'store':<10}{'decide p50':>12}{'p99':>10}{'settle p50':>12}{'p99':>10}")
        rows = {}
        for label, url in (("embedded", None), ("redis", redis.url)):
            decide, settle = asyncio.run(one_at_a_time(url, ns.requests))
            rows[label] = (*pct(decide), *pct(settle))
            print(f"{label:<10}" + "".join(f"{v:>{w}.0f}" for v, w in zip(rows[label], (12, 10, 12, 10))))
        e, r = rows["embedded"], rows["redis"]
        print(
            f"redis - embedded: decide +{r[0] - e[0]:.0f} us p50, +{r[1] - e[1]:.0f} us p99; "
            f"settle +{r[2] - e[2]:.0f} us p50, +{r[3] - e[3]:.0f} us p99"
        )

        print(f"\n2. three replicas x {ns.concurrency} loops on one Redis, {ns.seconds:g} s")
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 3.0  # all three connected before the clock starts
        procs = [
            ctx.Process(target=replica_worker, args=(redis.url, f"r{i}", ns.seconds, ns.concurrency, start_at, out))
            for i in range(3)
        ]
        for proc in procs:
            proc.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = cpu_seconds(redis.proc.pid)
        results = dict(out.get(timeout=ns.seconds + 60) for _ in procs)
        redis_cpu = (cpu_seconds(redis.proc.pid) - cpu0) / ns.seconds
        for proc in procs:
            proc.join()
        total = sum(results.values())
        per = ", ".join(f"{k} {v / ns.seconds:,.0f}/s" for k, v in sorted(results.items()))
        print(
            f"decisions/s: {total / ns.seconds:,.0f} ({per}); each is a reserve and a settle script, "
            f"so Redis ran {2 * total / ns.seconds:,.0f} scripts/s at {redis_cpu:.0%} of one core"
        )
    finally:
        redis.stop()


if __name__ == "__main__":
    main()
