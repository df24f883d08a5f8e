"""Runaways on the real server: short chat requests (Poisson) plus prompts that make the
default model run on to a large cap, with the length probe (the defaults) against the
prompt-only predictor (`[admission] probe = false`), each against a fresh `headroom
serve` on 127.0.0.1. The variants keep the names the stored results use.

  prompt-only   admission's prediction from the prompt is all the scheduler has
  in-flight     the defaults: the length probe re-estimates every 16 tokens
  in-flight+policy   also [admin] max_runaway_probability = 0.9 (deprioritize)

Tenants with the default limits: `chat` sends the shorts, --batch-tenants others (batch-0,
batch-1, ...) the runaways. (Until 2026-11-25 a tenant's in-flight cap was a fixed 16,000
tokens, about 7 runaways at once, and requests queued FIFO within a tenant; figures from
then used 6 batch tenants and 42 runaways, `--batch-tenants 6 --runaways 42 --duration
150`, to fill the default 16-bit KV cache, 1 GiB or ~46k tokens. The cap is now the KV
cache itself, and a request that fits passes one that does not.)

Runaways are the held-out (test split) prompts of data/calibration/sharegpt_prompts.jsonl
that ran to their 512-token cap at temperature 0 in calibration, sent with max_tokens
--runaway-tokens and real stopping (no ignore_eos); the probe never saw them. Shorts are
test-split prompts that stopped within 80 tokens. The runaways together outgrow the KV
pool, so the scheduler must choose whom to preempt and whom to admit first: that is
where the estimate acts. Prints per-class TTFT, the makespan and mean end-to-end of all
requests, preemptions, and for each runaway the output tokens at which it was flagged
(polled from /admin/sequences).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line, free_port, pct, start_server, stop_server

LABELS = PROMPTS.parent / "smollm2-135m-labels.jsonl"
ADMIN_TOKEN = "bench-runaways-admin-token-0123456789"
VARIANTS = {
    "prompt-only": "[admission]\nprobe = false\n",
    "in-flight": "[admission]\nprobe = true\n",
    "in-flight+policy": "[admission]\nprobe = true\n\n[admin]\nmax_runaway_probability = 0.9\n",
}


def config_text(variant: str, batch_tenants: int) -> str:
    """The variant's settings, with a `chat` tenant (the default) and the batch tenants,
    all with the default limits."""
    names = ["chat", *(f"batch-{i}" for i in range(batch_tenants))]
    head, _, admin = VARIANTS[variant].partition("\n[admin]")
    tenants = "".join(f'\n[[admission.tenants]]\nname = "{n}"\n' for n in names)
    return head + 'default_tenant = "chat"\n' + tenants + (f"\n[admin]{admin}" if admin else "")


def load_prompts() -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in LABELS.open(encoding="utf-8")]
    test = [r for r in rows if r["split"] == "test" and r["temperature"] == 0.0]
    runaways = [
        r["prompt"]
        for r in test
        if r["finish_reason"] == "length" and r["max_tokens"] == 512 and r["prompt_tokens"] < 400
    ]
    shorts = [r["prompt"] for r in test if r["finish_reason"] == "stop" and r["output_tokens"] < 80]
    return runaways, shorts


async def one(
    session: aiohttp.ClientSession, url: str, cls: str, prompt: str, max_tokens: int, t0: float, tenant: str = "chat"
) -> dict:
    sent = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, tokens, rid = None, 0, None
    async with session.post(url + "/v1/chat/completions", json=body, headers={"X-Tenant": tenant}) as r:
        rid = r.headers.get("X-Request-Id")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.monotonic()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        status = r.status
    end = time.monotonic()
    return {
        "cls": cls,
        "id": rid,
        "status": status,
        "sent": sent - t0,
        "ttft": (first or end) - sent,
        "e2e": end - sent,
        "end": end - t0,
        "tokens": tokens,
    }


async def watch(session: aiohttp.ClientSession, url: str, flagged: dict, stop: asyncio.Event) -> None:
    """Each sequence's first flag, as /admin/sequences shows it."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    while not stop.is_set():
        async with session.get(url + "/admin/sequences?limit=500", headers=headers) as r:
            if r.status == 200:
                for s in (await r.json())["data"]:
                    if s.get("runaway_flagged_at") is not None and s["id"] not in flagged:
                        flagged[s["id"]] = s["runaway_flagged_at"]
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


async def drive(url: str, runaways: list[str], shorts: list[str], args) -> tuple[list[dict], dict]:
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(args.rate)) < args.duration:
        arrivals.append(t)
    flagged: dict[str, int] = {}
    stop = asyncio.Event()
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def at(delay: float, cls: str, prompt: str, max_tokens: int, tenant: str = "chat") -> dict:
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            return await one(session, url, cls, prompt, max_tokens, t0, tenant)

        watcher = asyncio.create_task(watch(session, url, flagged, stop))
        # The runaways arrive over the first seconds, so the shorts meet them all running.
        tasks = [
            asyncio.create_task(
                at(
                    0.5 * j,
                    "runaway",
                    runaways[j % len(runaways)],
                    args.runaway_tokens,
                    f"batch-{j % args.batch_tenants}",
                )
            )
            for j in range(args.runaways)
        ]
        tasks += [asyncio.create_task(at(a, "short", shorts[i % len(shorts)], 128)) for i, a in enumerate(arrivals)]
        results = await asyncio.gather(*tasks)
        stop.set()
        await watcher
    return list(results), flagged


async def server_counters(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    wanted = {}
    for line in text.splitlines():
        if line.startswith(("headroom:num_preemptions_total", "headroom:probe_decisions_total")):
            name, value = line.rsplit(" ", 1)
            wanted[name] = float(value)
    return wanted


def summarize(name: str, results: list[dict], flagged: dict, counters: dict) -> dict:
    out = {
        "variant": name,
        "makespan_s": max(r["end"] for r in results),
        "mean_e2e_s": statistics.mean(r["e2e"] for r in results),
        "counters": counters,
    }
    for cls in ("short", "runaway"):
        rs = [r for r in results if r["cls"] == cls and r["status"] == 200]
        if not rs:
            out[cls] = {"n": 0}
            continue
        ttft = [r["ttft"] for r in rs]
        out[cls] = {
            "n": len(rs),
            "ttft_p50": statistics.median(ttft),
            "ttft_p99": pct(ttft, 0.99),
            "e2e_mean": statistics.mean(r["e2e"] for r in rs),
            "tokens_mean": statistics.mean(r["tokens"] for r in rs),
        }
    out["runaway"]["flagged_at"] = [flagged.get(r["id"]) for r in results if r["cls"] == "runaway"]
    out["runaway"]["tokens"] = [r["tokens"] for r in results if r["cls"] == "runaway"]
    out["short"]["flagged"] = sum(1 for r in results if r["cls"] == "short" and r["id"] in flagged)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runaways", type=int, default=16)
    p.add_argument("--batch-tenants", type=int, default=2, help="tenants the runaways are spread over")
    p.add_argument("--runaway-tokens", type=int, default=2048)
    p.add_argument("--rate", type=float, default=1.0, help="short requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of short arrivals")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summaries here (JSON)")
    args = p.parse_args()
    runaways, shorts = load_prompts()
    print(cpu_line())
    print(
        f"# {args.runaways} runaways from {len(runaways)} prompts (max_tokens {args.runaway_tokens}), shorts at "
        f"{args.rate}/s for {args.duration:.0f}s (max_tokens 128), temperature 0, no ignore_eos"
    )
    os.environ["HEADROOM_ADMIN_TOKEN"] = ADMIN_TOKEN
    summaries = []
    for name in args.variants.split(","):
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(config_text(name, args.batch_tenants))
            path = f.name
        port = free_port()
        proc = start_server(port, "auto", path, admission=True)
        url = f"http://127.0.0.1:{port}"
        try:
            results, flagged = asyncio.run(drive(url, runaways, shorts, args))
            summary = summarize(name, results, flagged, asyncio.run(server_counters(url)))
        finally:
            stop_server(proc)
            os.unlink(path)
        summaries.append(summary)
        s, r = summary["short"], summary["runaway"]
        print(f"\n{name}: makespan {summary['makespan_s']:.1f}s, mean e2e {summary['mean_e2e_s']:.1f}s")
        print(
            f"  short   n={s['n']} TTFT p50 {s['ttft_p50']:.3f}s p99 {s['ttft_p99']:.3f}s, e2e mean "
            f"{s['e2e_mean']:.2f}s, flagged {s['flagged']}"
        )
        print(
            f"  runaway n={r['n']} TTFT p50 {r['ttft_p50']:.3f}s, e2e mean {r['e2e_mean']:.1f}s, tokens {r['tokens']}"
        )
        print(f"  flagged at (output tokens): {r['flagged_at']}")
        print(f"  {summary['counters']}")
    if args.out:
        Path(args.out).write_text(json.dumps(summaries, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
