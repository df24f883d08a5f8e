"""Tokens/s through HTTP + SSE versus the engine called directly, in one process.

Both paths run the same engine (same weights, same thread) on the same shape: N
concurrent requests, prompt of --prompt-len random token ids, --output-len tokens with
ignore_eos. The HTTP path runs the real aiohttp app on 127.0.0.1 with uvloop and N
streaming aiohttp clients; while it is saturated, a probe times GET /health every 20 ms.
Runs alternate direct/HTTP --repeats times and the median of each is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time

import aiohttp
import torch

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput


def direct_run(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    done = threading.Semaphore(0)
    tokens = 0
    lock = threading.Lock()

    def sink(out: RequestOutput) -> None:
        nonlocal tokens
        with lock:
            tokens += len(out.new_token_ids)
        if out.finished:
            done.release()

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for p in prompts:
        engine.submit(engine.new_request(p, params), sink)
    for _ in prompts:
        done.acquire()
    return tokens / (time.perf_counter() - started)


async def http_run(url: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[float]]:
    health_ms: list[float] = []
    stop = asyncio.Event()

    async def probe(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
                assert r.status == 200
            health_ms.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.02)

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> int:
        body = {
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        last = b""
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    last = line
        return json.loads(last[len(b"data: ") :])["usage"]["completion_tokens"]

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        probe_task = asyncio.create_task(probe(session))
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(session, p) for p in prompts))
        elapsed = time.perf_counter() - started
        stop.set()
        await probe_task
    assert all(c == output_len for c in counts), counts
    return len(prompts) * output_len / elapsed, health_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    ns = p.parse_args()
    config = Config(
        model=ModelConfig(dtype=ns.dtype),
        cache=CacheConfig(kv_cache_memory_gib=1.0, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=ns.concurrency, max_num_batched_tokens=512),
    )
    engine = Engine(config)
    server = BackgroundServer(config, engine).start()  # also starts the engine thread
    url = server.url
    rng = random.Random(0)
    vocab = engine.loaded.args.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.concurrency)]

    print(
        f"# api_overhead: model={engine.loaded.name} dtype={engine.executor.dtype} threads={torch.get_num_threads()} "
        f"concurrency={ns.concurrency} prompt={ns.prompt_len} output={ns.output_len} ignore_eos=True"
    )
    direct_run(engine, prompts()[:4], 4)  # warm-up
    direct, http, health = [], [], []
    for i in range(ns.repeats):
        direct.append(direct_run(engine, prompts(), ns.output_len))
        tok_s, health_ms = asyncio.run(http_run(url, prompts(), ns.output_len))
        http.append(tok_s)
        health.extend(health_ms)
        print(f"run {i}: direct {direct[-1]:.1f} tok/s, http+sse {http[-1]:.1f} tok/s", flush=True)
    server.stop()
    d, h = statistics.median(direct), statistics.median(http)
    health.sort()
    p99 = health[min(len(health) - 1, int(0.99 * len(health)))]
    print(f"direct engine   : {d:.1f} output tok/s (median of {ns.repeats})")
    print(f"HTTP + SSE      : {h:.1f} output tok/s (median of {ns.repeats})")
    print(f"ratio http/direct: {h / d:.3f} (target >= 0.9)")
    print(
        f"/health under load: p50 {statistics.median(health):.1f} ms, p99 {p99:.1f} ms, "
        f"max {health[-1]:.1f} ms over {len(health)} probes (target p99 < 50 ms)"
    )


if __name__ == "__main__":
    main()
