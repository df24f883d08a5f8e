"""What per-tenant cost accounting costs, and how well its device-seconds add up.

1. The charge of one finished request (the tenant counters and a SQLite ledger row), timed
   in process over --charges requests, against the mean engine time of a request in
   the load below: the share of serving it adds.
2. A real `headroom serve` on 127.0.0.1 with the ledger on, the way a user turns it on
   (`[observability] usage_ledger_path`), driven by --requests completions from two
   tenants at concurrency --concurrency (128-token prompts, 128 output tokens,
   ignore_eos); then the tenants' device-seconds from /metrics against the engine's busy
   time, and /admin/usage against the counters.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from headroom.observability.ledger import Usage, UsageLedger
from headroom.observability.metrics import Metrics
from headroom.runtime.outputs import EngineStats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line, free_port, start_server, stop_server

ADMIN_TOKEN = "bench-usage-admin-token-0123456789"
CONFIG = """
[admission]
default_tenant = "alpha"

[[admission.tenants]]
name = "alpha"

[[admission.tenants]]
name = "beta"

[observability]
usage_ledger_path = "{path}"
"""


def idle_engine() -> SimpleNamespace:
    """What Metrics reads of an engine at scrape time (and once at start): an idle one."""
    return SimpleNamespace(
        counters=EngineStats,
        scheduler=SimpleNamespace(num_running=0, num_waiting=0),
        block_manager=SimpleNamespace(num_used_blocks=0, num_blocks=1),
    )


def charge_cost(n: int, directory: str) -> list[float]:
    ledger = UsageLedger(Path(directory) / "charge.sqlite", retention_days=90)
    metrics = Metrics(idle_engine(), None, lambda: 0)  # type: ignore[arg-type]
    times = []
    for i in range(n):
        usage = Usage(f"r{i}", ("alpha", "beta")[i % 2], "length", 128, 0, 128, 0.3, 2.5, 0.001)
        start = time.perf_counter()
        metrics.charge(usage)
        ledger.record(usage)
        times.append(time.perf_counter() - start)
    ledger.close()
    return times


async def load(url: str, requests: int, concurrency: int) -> None:
    body = {"prompt": "Tell me about the sea. " * 20, "max_tokens": 128, "ignore_eos": True, "temperature": 0}
    queue = list(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            async with session.post(
                url + "/v1/completions", json=body, headers={"X-Tenant": ("alpha", "beta")[i % 2]}
            ) as r:
                await r.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


async def scrape(url: str) -> tuple[dict, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        async with session.get(url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            usage = await r.json()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, s.labels.get("tenant"))] = s.value
    return values, usage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--charges", type=int, default=20000)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as directory:
        times = sorted(charge_cost(args.charges, directory))
        p50, p99 = statistics.median(times), times[int(0.99 * len(times))]
        path = Path(directory) / "usage.sqlite"
        config = Path(directory) / "headroom.toml"
        config.write_text(CONFIG.format(path=path), encoding="utf-8")
        os.environ["HEADROOM_ADMIN_TOKEN"] = ADMIN_TOKEN
        port = free_port()
        proc = start_server(port, "auto", str(config), admission=True)
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.perf_counter()
            asyncio.run(load(url, args.requests, args.concurrency))
            elapsed = time.perf_counter() - started
            time.sleep(0.5)
            values, usage = asyncio.run(scrape(url))
        finally:
            stop_server(proc)
    busy = values[("headroom:engine_busy_seconds_total", None)]
    device = {t: values.get(("headroom:tenant_device_seconds_total", t), 0.0) for t in ("alpha", "beta")}
    per_request = busy / args.requests
    print(
        f"charge per finished request (counters + ledger row, {args.charges}): "
        f"p50 {1e6 * p50:.0f} us, p99 {1e6 * p99:.0f} us"
    )
    print(
        f"engine time per request in the load: {1e3 * per_request:.0f} ms -> accounting adds "
        f"{100 * p50 / per_request:.3f}% (p99 {100 * p99 / per_request:.3f}%)"
    )
    print(
        f"load: {args.requests} requests, concurrency {args.concurrency}, {elapsed:.1f} s, "
        f"{args.requests * 128 / elapsed:.0f} output tok/s"
    )
    total = sum(device.values())
    print(
        f"device-seconds: alpha {device['alpha']:.3f} + beta {device['beta']:.3f} = {total:.3f}; "
        f"engine busy {busy:.3f}; error {100 * (total - busy) / busy:+.4f}%"
    )
    for t in usage["tenants"]:
        counted = values.get(("headroom:tenant_device_seconds_total", t["tenant"]), 0.0)
        print(
            f"ledger {t['tenant']}: {sum(t['requests'].values())} requests, {t['output_tokens']} output tokens, "
            f"{t['device_seconds']:.3f} device-s (counter {counted:.3f})"
        )


if __name__ == "__main__":
    main()
