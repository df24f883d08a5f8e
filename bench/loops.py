"""Loops on the real server: what the loop policy saves and what it cuts by mistake.

Every held-out (test split) prompt of data/calibration/smollm2-135m-labels.jsonl labelled
at temperature 0, sent through /v1/chat/completions with max_tokens 512 and real
stopping (no ignore_eos): about half run to the cap in calibration, most of them in a
loop, the rest end on their own. Short chat requests (test-split prompts that stopped
within 80 tokens, max_tokens 128) arrive beside them as a Poisson stream and are the
ones whose TTFT and TPOT should not suffer. Each variant is a fresh `headroom serve`:

  defaults   no config: [admin] loop_policy = "cap" (32 more tokens after a loop is found)
  off        loop_policy = "off": the baseline every other variant is compared with
  stop       loop_policy = "stop"
  ladder     loop_policy = "flag" with [admin] ladder = deprioritize, cap, abort (2 s apart)

Prints, per variant: output tokens of the long requests, the engine's busy seconds (its
/metrics counter), the makespan, the shorts' TTFT p50/p99 and TPOT p50, how many long
requests the detector acted on, and false stops: requests that ended on their own in the
`off` run (finish_reason stop) but were ended here by a policy (length under the cap,
repetition, abort) with fewer tokens than they had there.
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
ADMIN_TOKEN = "bench-loops-admin-token-0123456789"
VARIANTS = {
    "defaults": "",
    "off": '[admin]\nloop_policy = "off"\n',
    "stop": '[admin]\nloop_policy = "stop"\n',
    "ladder": '[admin]\nloop_policy = "flag"\nladder = ["deprioritize", "cap", "abort"]\nladder_step_s = 2.0\n',
}


def load_prompts() -> tuple[list[dict], list[str]]:
    rows = [json.loads(line) for line in LABELS.open(encoding="utf-8")]
    test = [r for r in rows if r["split"] == "test" and r["temperature"] == 0.0 and r["prompt_tokens"] < 600]
    shorts = [r["prompt"] for r in test if r["finish_reason"] == "stop" and r["output_tokens"] < 80]
    return test, shorts


async def one(
    session: aiohttp.ClientSession, url: str, cls: str, key: str, prompt: str, max_tokens: int, t0: float
) -> dict:
    sent = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = finish = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                choice = chunk["choices"][0]
                if first is None and choice["delta"].get("content"):
                    first = time.monotonic()
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        status = r.status
    end = time.monotonic()
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {
        "cls": cls,
        "key": key,
        "status": status,
        "finish": finish,
        "tokens": tokens,
        "ttft": (first or end) - sent,
        "tpot": tpot,
        "end": end - t0,
    }


async def drive(url: str, longs: list[dict], shorts: list[str], args) -> list[dict]:
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(args.rate)) < args.duration:
        arrivals.append(t)
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def at(delay: float, *a) -> dict:
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            return await one(session, url, *a, t0)

        spread = args.duration * 0.6 / max(len(longs), 1)
        tasks = [asyncio.create_task(at(spread * j, "long", r["id"], r["prompt"], 512)) for j, r in enumerate(longs)]
        tasks += [
            asyncio.create_task(at(a, "short", f"s{i}", shorts[i % len(shorts)], 128)) for i, a in enumerate(arrivals)
        ]
        return list(await asyncio.gather(*tasks))


async def counters(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        if line.startswith(
            ("headroom:engine_busy_seconds_total", "headroom:loops_detected_total", "headroom:policy_actions_total")
        ):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def summarize(name: str, results: list[dict], server: dict, baseline: dict | None) -> dict:
    longs = [r for r in results if r["cls"] == "long" and r["status"] == 200]
    shorts = [r for r in results if r["cls"] == "short" and r["status"] == 200]
    out = {
        "variant": name,
        "makespan_s": max(r["end"] for r in results),
        "counters": server,
        "long_n": len(longs),
        "long_tokens": sum(r["tokens"] for r in longs),
        "long_finish": {
            f: sum(1 for r in longs if r["finish"] == f) for f in ("stop", "length", "repetition", "abort")
        },
        "short_n": len(shorts),
        "short_ttft_p50": statistics.median(r["ttft"] for r in shorts),
        "short_ttft_p99": pct([r["ttft"] for r in shorts], 0.99),
        "short_tpot_p50": statistics.median(r["tpot"] for r in shorts if r["tpot"] is not None),
        "busy_s": server.get("headroom:engine_busy_seconds_total", 0.0),
    }
    if baseline is not None:
        base = {r["key"]: r for r in baseline["results"] if r["cls"] == "long"}
        ended = [r for r in longs if base[r["key"]]["finish"] == "stop"]
        # Ended by a policy before the baseline's own end. Greedy continuations differ between
        # runs (a batch's composition changes the rounding), so a sequence may also loop here
        # where it did not there: ended by a policy, but later than the baseline's own end,
        # is a different continuation, not a cut answer; those are counted apart.
        out["false_stops"] = sum(1 for r in ended if r["finish"] != "stop" and r["tokens"] < base[r["key"]]["tokens"])
        out["diverged"] = sum(1 for r in ended if r["finish"] != "stop" and r["tokens"] >= base[r["key"]]["tokens"])
        out["ended_on_their_own"] = len(ended)
        capped = [r for r in longs if base[r["key"]]["finish"] == "length"]
        out["runaways_cut"] = sum(1 for r in capped if r["tokens"] < base[r["key"]]["tokens"])
        out["runaways"] = len(capped)
    out["results"] = results
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1.0, help="short requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of short arrivals")
    p.add_argument("--longs", type=int, default=0, help="send only the first N long prompts (0: all)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summaries here (JSON)")
    args = p.parse_args()
    longs, shorts = load_prompts()
    longs = longs[: args.longs] if args.longs else longs
    print(cpu_line())
    print(
        f"# {len(longs)} held-out prompts (max_tokens 512) over the first {args.duration * 0.6:.0f}s, shorts at "
        f"{args.rate}/s for {args.duration:.0f}s (max_tokens 128), temperature 0, no ignore_eos"
    )
    os.environ["HEADROOM_ADMIN_TOKEN"] = ADMIN_TOKEN
    names = args.variants.split(",")
    # The baseline runs first where it is asked for with others: every other variant is read against it.
    runs: dict[str, dict] = {}
    for name in sorted(names, key=lambda n: n != "off"):
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(VARIANTS[name])
            path = f.name
        port = free_port()
        proc = start_server(port, "auto", path if VARIANTS[name] else None, admission=True)
        url = f"http://127.0.0.1:{port}"
        try:
            results = asyncio.run(drive(url, longs, shorts, args))
            server = asyncio.run(counters(url))
        finally:
            stop_server(proc)
            os.unlink(path)
        runs[name] = summarize(name, results, server, runs.get("off") if name != "off" else None)
    for name in names:
        s = runs[name]
        print(
            f"\n{name}: makespan {s['makespan_s']:.1f}s, engine busy {s['busy_s']:.1f}s, "
            f"long output tokens {s['long_tokens']} ({s['long_finish']})"
        )
        print(
            f"  shorts n={s['short_n']}: TTFT p50 {s['short_ttft_p50']:.3f}s p99 {s['short_ttft_p99']:.3f}s, "
            f"TPOT p50 {s['short_tpot_p50'] * 1000:.1f} ms"
        )
        if "false_stops" in s:
            off = runs["off"]
            print(
                f"  vs off: long tokens {s['long_tokens'] / off['long_tokens']:.2f}x, engine busy "
                f"{s['busy_s'] / off['busy_s']:.2f}x; runaways cut {s['runaways_cut']}/{s['runaways']}, "
                f"false stops {s['false_stops']}/{s['ended_on_their_own']} (and {s['diverged']} that ran "
                "longer than there, then looped)"
            )
        print(f"  {s['counters']}")
    if args.out:
        Path(args.out).write_text(json.dumps([runs[n] for n in names], indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
