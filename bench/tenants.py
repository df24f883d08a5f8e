"""Isolation between tenants on the real server: an interactive tenant's short requests
beside another tenant's reasoning requests (long prompts, long outputs), through the HTTP
API, each run against a fresh server on 127.0.0.1.

  interactive  Poisson --rate req/s for --duration s, ~50-token chat prompts, 32 tokens
  reasoning    --reasoning requests of 1,200-2,000-token prompts and --reasoning-tokens
               output tokens (ignore_eos), spread evenly over the first 60% of --duration

For each server: the interactive stream alone, then both tenants together. Servers:
`none` is `headroom serve` with no config and no flags beyond the port (everyone the
default tenant, as a new user starts it); `tenants` a config that names the two tenants
and nothing else (requests say which with X-Tenant); `--peer URL` adds an OpenAI-compatible
server already running there (vLLM's CPU build from ../shared/peers/, model `smollm2`).
With --lora, each tenant runs on its own rank-16 LoRA adapter (all seven projections, made
as bench/lora.py makes them), loaded with --lora-modules and named by `model` in every
request, instead of the base model (not with --peer).
Prints, per server, the interactive tenant's TTFT p99, TPOT p50 and end-to-end p99 alone
and mixed (and their ratio), the reasoning tenant's TTFT p50 and end-to-end p50, and when
the whole mixed load was done. Also --all-long: --clients closed-loop clients sending only
2,000-token prompts with 256 output tokens, defaults against `--admission off`.
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
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.hol import cpu_line, free_port, load_prompts, pct, start_server, stop_server

TENANTS_TOML = """
[admission]
default_tenant = "interactive"

[[admission.tenants]]
name = "interactive"

[[admission.tenants]]
name = "reasoning"
"""


@dataclass
class Result:
    tenant: str
    sent_at: float
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    done_at: float | None = None
    tokens: int = 0


async def one(
    session: aiohttp.ClientSession,
    url: str,
    model: str | None,
    tenant: str,
    header: str | None,
    messages: list[dict],
    max_tokens: int,
    ignore_eos: bool,
    t0: float,
) -> Result:
    result = Result(tenant, time.monotonic() - t0)
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"X-Tenant": header} if header else {}
    start, first = time.monotonic(), None
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        result.status = r.status
        if r.status != 200:
            await r.read()
            return result
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.monotonic()
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
    end = time.monotonic()
    result.ttft, result.e2e, result.done_at = (first or end) - start, end - start, end - t0
    if result.tokens > 1 and first is not None:
        result.tpot = (end - first) / (result.tokens - 1)
    return result


async def drive(
    url: str, models: tuple[str | None, str | None], headers: tuple[str | None, str | None], ns, mixed: bool
) -> list[Result]:
    short_msgs, long_msgs = PROMPTS
    rng = random.Random(7)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(ns.rate)) <= ns.duration:
        arrivals.append(t)
    spread = 0.6 * ns.duration
    reasoning_at = [i * spread / max(1, ns.reasoning - 1) for i in range(ns.reasoning)] if mixed else []
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def at(delay: float, coro):
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            return await coro

        tasks = [
            at(
                a,
                one(session, url, models[0], "interactive", headers[0], short_msgs[i % len(short_msgs)], 32, False, t0),
            )
            for i, a in enumerate(arrivals)
        ]
        tasks += [
            at(
                a,
                one(
                    session,
                    url,
                    models[1],
                    "reasoning",
                    headers[1],
                    long_msgs[j % len(long_msgs)],
                    ns.reasoning_tokens,
                    True,
                    t0,
                ),
            )
            for j, a in enumerate(reasoning_at)
        ]
        return list(await asyncio.gather(*tasks))


async def all_long(url: str, model: str | None, ns) -> tuple[float, float]:
    """--clients closed-loop clients, each sending --long-requests long requests: tok/s, TTFT p50."""
    _, long_msgs = PROMPTS
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client(c: int) -> list[Result]:
            return [
                await one(session, url, model, "long", None, long_msgs[(c + i) % len(long_msgs)], 256, True, t0)
                for i in range(ns.long_requests)
            ]

        results = [r for rs in await asyncio.gather(*(client(c) for c in range(ns.clients))) for r in rs]
    elapsed = time.monotonic() - t0
    return sum(r.tokens for r in results) / elapsed, statistics.median(r.ttft for r in results if r.ttft)


def stats(results: list[Result], tenant: str) -> dict:
    ok = [r for r in results if r.tenant == tenant and r.status == 200]
    values = {k: [getattr(r, k) for r in ok if getattr(r, k) is not None] for k in ("ttft", "tpot", "e2e")}
    return {
        "n": len([r for r in results if r.tenant == tenant]),
        "ok": len(ok),
        "ttft_p50": statistics.median(values["ttft"]) if values["ttft"] else float("nan"),
        "ttft_p99": pct(values["ttft"], 0.99),
        "tpot_p50": statistics.median(values["tpot"]) if values["tpot"] else float("nan"),
        "e2e_p50": statistics.median(values["e2e"]) if values["e2e"] else float("nan"),
        "e2e_p99": pct(values["e2e"], 0.99),
        "done_s": max((r.done_at for r in ok), default=float("nan")),
    }


def run_server(name: str, ns, variant: list[str]) -> dict:
    """Alone and mixed against a fresh server each (a peer: the one at --peer), with the variant's flags."""
    extra = variant + ns.lora_args
    out = {"server": name + (f" {' '.join(extra)}" if extra and name != "peer" else "")}
    for mixed in (False, True):
        config_path, proc = None, None
        if name == "peer":
            url, models = ns.peer, (ns.peer_model, ns.peer_model)
        else:
            if name == "tenants":
                with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
                    f.write(TENANTS_TOML)
                config_path = f.name
            port = free_port()
            proc = start_server(port, "auto", config_path, True, extra)
            url, models = f"http://127.0.0.1:{port}", ns.models
        headers = ("interactive", "reasoning") if name == "tenants" else (None, None)
        try:
            results = asyncio.run(drive(url, models, headers, ns, mixed))
        finally:
            if proc is not None:
                stop_server(proc)
            if config_path:
                os.unlink(config_path)
        key = "mixed" if mixed else "alone"
        out[key] = {"interactive": stats(results, "interactive")}
        if mixed:
            out[key]["reasoning"] = stats(results, "reasoning")
            out[key]["all_done_s"] = max(r.done_at or 0.0 for r in results)
    return out


def print_row(s: dict) -> None:
    a, m = s["alone"]["interactive"], s["mixed"]["interactive"]
    r = s["mixed"]["reasoning"]

    def cell(key: str, scale: float = 1.0) -> str:
        return f"{a[key] * scale:.2f} -> {m[key] * scale:.2f} ({m[key] / a[key]:.1f}x)"

    print(
        f"| {s['server']} | {cell('ttft_p99')} s | {cell('tpot_p50', 1000)} ms | {cell('e2e_p99')} s | "
        f"{r['ttft_p50']:.1f} s | {r['e2e_p50']:.1f} s | {s['mixed']['all_done_s']:.0f} s | "
        f"{m['ok']}/{m['n']}, {r['ok']}/{r['n']} |",
        flush=True,
    )


PROMPTS: tuple = ()


def main() -> None:
    global PROMPTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="none,tenants", help="none, tenants (comma-separated)")
    p.add_argument("--peer", default=None, help="URL of a running peer server to measure too")
    p.add_argument("--peer-model", default="smollm2")
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--reasoning", type=int, default=6)
    p.add_argument("--reasoning-tokens", type=int, default=1024)
    p.add_argument("--all-long", action="store_true", help="the all-long load instead")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--long-requests", type=int, default=1, help="long requests per closed-loop client")
    p.add_argument(
        "--headroom-args",
        default="",
        help="extra flags for `headroom serve` (a variant, measured after the defaults; not with "
        "--servers tenants if they name a --config)",
    )
    p.add_argument("--lora", action="store_true", help="each tenant on its own rank-16 adapter")
    p.add_argument("--adapters-dir", default="/tmp/headroom-lora-bench")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    ns.models, ns.lora_args = (None, None), []
    if ns.lora:
        if ns.all_long or ns.peer:
            p.error("--lora measures headroom's servers in the tenants scenario only")
        from bench.lora import make_adapters

        made = make_adapters(Path(ns.adapters_dir), 2, 16)
        ns.models = tuple(name for name, _ in made)
        ns.lora_args = ["--lora-modules", *(f"{name}={path}" for name, path in made)]
    PROMPTS = load_prompts()
    print(cpu_line())
    summaries = []
    if ns.all_long:
        print(f"# all-long: {ns.clients} clients x {ns.long_requests} requests, ~2,000-token prompts, 256 tokens")
        for name, admission in (("defaults", True), ("--admission off", False)):
            port = free_port()
            proc = start_server(port, "auto", None, admission)
            try:
                tok_s, ttft = asyncio.run(all_long(f"http://127.0.0.1:{port}", None, ns))
            finally:
                stop_server(proc)
            summaries.append({"server": name, "tok_s": tok_s, "ttft_p50": ttft})
            print(f"{name:16s} {tok_s:6.1f} tok/s, TTFT p50 {ttft:.1f} s", flush=True)
        if ns.peer:
            tok_s, ttft = asyncio.run(all_long(ns.peer, ns.peer_model, ns))
            summaries.append({"server": "peer", "tok_s": tok_s, "ttft_p50": ttft})
            print(f"{'peer':16s} {tok_s:6.1f} tok/s, TTFT p50 {ttft:.1f} s", flush=True)
    else:
        print(
            f"# tenants: interactive {ns.rate}/s for {ns.duration:.0f} s (32 tokens); {ns.reasoning} reasoning "
            f"requests (~2,000-token prompts, {ns.reasoning_tokens} tokens) over the first "
            f"{0.6 * ns.duration:.0f} s"
        )
        print(
            "| server | short TTFT p99 alone -> mixed | short TPOT p50 | short e2e p99 | reasoning TTFT p50 | "
            "reasoning e2e p50 | all done | ok |"
        )
        print("|---|---|---|---|---|---|---|---|")
        names = [n for n in ns.servers.split(",") if n] + (["peer"] if ns.peer else [])
        # The defaults first, then the variant (a user starts the server without flags).
        variant = ns.headroom_args.split()
        variants = [[], variant] if variant else [[]]
        for name in names:
            for flags in variants if name != "peer" else [[]]:
                summaries.append(run_server(name, ns, flags))
                print_row(summaries[-1])
    if ns.json:
        Path(ns.json).write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
