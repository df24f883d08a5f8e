"""Soak: --minutes of mixed traffic on the real server (short chats, medium completions,
long prompts, streams the client abandons), with an operator aborting, deprioritising
and capping sequences through the admin API. Prints requests served, errors by kind,
RSS and KV usage over time (and a PNG plot), and asserts nothing leaked at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    SchedulerConfig,
    ServerConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine

TOKEN = "soak-admin-token-0123456789"
KEYS = {"team-a": "key-a-soak", "team-b": "key-b-soak"}
HERE = Path(__file__).parent


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


class Soak:
    def __init__(self, url: str, minutes: float, seed: int = 0):
        self.url = url
        self.deadline = time.monotonic() + 60 * minutes
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.admin_actions: Counter[str] = Counter()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.rng.choice(list(KEYS.values()))}"}

    async def request(self, session: aiohttp.ClientSession) -> None:
        kind = self.rng.choices(["short", "medium", "long", "abandon"], weights=[60, 25, 5, 10])[0]
        if kind == "short":
            path, body = (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": self.rng.randint(4, 24)},
            )
        elif kind == "medium":
            path, body = (
                "/v1/completions",
                {"prompt": "Write about mountains:", "ignore_eos": True, "max_tokens": self.rng.randint(48, 128)},
            )
        else:
            prompt = [self.rng.randrange(100, 40000) for _ in range(800 if kind == "long" else 200)]
            path, body = "/v1/completions", {"prompt": prompt, "max_tokens": 96, "ignore_eos": True}
        body["stream"] = kind in ("abandon", "medium")
        try:
            async with session.post(self.url + path, json=body, headers=self.headers()) as r:
                if r.status != 200:
                    code = (await r.json())["error"]["code"]
                    self.outcomes[f"{r.status} {code}"] += 1
                    return
                if kind == "abandon":
                    keep = self.rng.randint(1, 8)
                    async for line in r.content:
                        if line.startswith(b"data: {") and (keep := keep - 1) == 0:
                            break
                    self.outcomes["abandoned by client"] += 1
                    return
                if body["stream"]:
                    last = b""
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            last = line
                    reason = json.loads(last[6:])["choices"][0]["finish_reason"]
                else:
                    reason = (await r.json())["choices"][0]["finish_reason"]
                self.outcomes[f"200 {reason}"] += 1
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.outcomes[f"client error {type(exc).__name__}"] += 1

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.deadline:
            await self.request(session)
            await asyncio.sleep(self.rng.uniform(0, 0.5))

    async def operator(self, session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        while time.monotonic() < self.deadline:
            await asyncio.sleep(self.rng.uniform(2, 6))
            async with session.get(self.url + "/admin/sequences?sort=cost&limit=5", headers=headers) as r:
                data = (await r.json())["data"]
            if not data:
                continue
            action = self.rng.choice(["abort", "deprioritize", "cap"])
            body = {"max_tokens": self.rng.randint(1, 32)} if action == "cap" else {}
            url = f"{self.url}/admin/sequences/{data[0]['id']}/{action}"
            async with session.post(url, json=body, headers=headers) as r:
                self.admin_actions[f"{action} {r.status}"] += 1

    async def sampler(self, server: BackgroundServer, samples: list[dict]) -> None:
        start = time.monotonic()
        blocks = server.engine.block_manager
        while time.monotonic() < self.deadline:
            samples.append(
                {
                    "t": time.monotonic() - start,
                    "rss_mib": rss_mib(),
                    "kv_used": blocks.num_used_blocks,
                    "kv_total": blocks.num_blocks,
                    "served": sum(n for k, n in self.outcomes.items() if k.startswith("200")),
                }
            )
            await asyncio.sleep(5)

    async def run(self, server: BackgroundServer, workers: int) -> list[dict]:
        samples: list[dict] = []
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await asyncio.gather(
                self.sampler(server, samples), self.operator(session), *(self.worker(session) for _ in range(workers))
            )
        return samples


def leaks(server: BackgroundServer, timeout_s: float = 60) -> dict:
    """What is still held after the traffic stopped (all zero when nothing leaked)."""
    deadline = time.monotonic() + timeout_s
    engine, client, gate = server.engine, server.app[keys.ENGINE], server.app[keys.GATE]
    while time.monotonic() < deadline:
        held = {
            "kv_blocks": engine.block_manager.num_used_blocks,
            "engine_sequences": len(engine.scheduler.requests),
            "submitted": len(client.submitted),
            "tenant_tokens": sum(t.bucket.in_flight for t in gate.registry),
            "admission_seats": gate.admission.in_flight_seqs,
        }
        if not any(held.values()):
            break
        time.sleep(0.2)
    engine.block_manager.check_invariants()
    return held


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [s["rss_mib"] for s in samples])
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_ylim(bottom=0)
    ax2.plot(t, [100 * s["kv_used"] / s["kv_total"] for s in samples], color="tab:orange")
    ax2.set_ylabel("KV blocks used (%)")
    ax2.set_xlabel("minutes")
    fig.suptitle("headroom soak: memory and KV usage under mixed traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--workers", type=int, default=12)
    ns = p.parse_args()
    config = Config(
        cache=CacheConfig(num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=32),
        server=ServerConfig(max_queue_len=32),
        admission=AdmissionConfig(
            auth=True,
            default_tenant="team-a",
            tenants=tuple(
                TenantConfig(name, api_keys=(key,), max_queue=16, max_wait_s=20) for name, key in KEYS.items()
            ),
        ),
        admin=AdminConfig(token=TOKEN),
    )
    server = BackgroundServer(config, Engine(config)).start()
    soak = Soak(server.url, ns.minutes)
    print(f"# soak: {ns.minutes:g} min, {ns.workers} workers, model {server.engine.loaded.name}", flush=True)
    samples = asyncio.run(soak.run(server, ns.workers))
    held = leaks(server)
    server.stop()
    served = sum(n for k, n in soak.outcomes.items() if k.startswith("200"))
    print(f"requests served (200): {served}")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"  {outcome}: {n}")
    print(f"admin actions: {dict(sorted(soak.admin_actions.items()))}")
    rss = [s["rss_mib"] for s in samples]
    warm = [s["rss_mib"] for s in samples if s["t"] >= 60] or rss
    print(f"RSS MiB: start {rss[0]:.0f}, after 1 min {warm[0]:.0f}, end {rss[-1]:.0f}, max {max(rss):.0f}")
    print(
        f"KV used %: mean {100 * sum(s['kv_used'] for s in samples) / sum(s['kv_total'] for s in samples):.1f}, "
        f"max {max(100 * s['kv_used'] / s['kv_total'] for s in samples):.1f}"
    )
    print(f"left after traffic stopped: {held}")
    (HERE / "soak_results.json").write_text(
        json.dumps(
            {
                "minutes": ns.minutes,
                "outcomes": soak.outcomes,
                "admin_actions": soak.admin_actions,
                "held": held,
                "samples": samples,
            },
            indent=1,
        )
        + "\n"
    )
    plot(samples, HERE / "soak.png")
    assert not any(held.values()), f"leaked: {held}"
    assert not any(k.startswith(("5", "client error")) for k in soak.outcomes), soak.outcomes
    print("no leaks, no 5xx")


if __name__ == "__main__":
    main()
