"""Speculative decoding's gain, and its cost where guesses miss (issue 56).

Starts `headroom serve` on 127.0.0.1 with its defaults (n-gram speculation), then with
each other method (`--speculative-config '{"method": "suffix"}'`; `--methods draft` adds the
default model as its own draft), then with `'{"method": "off"}'`, and sends each the same
chat requests (greedy, `--max-tokens` out) at each concurrency, closed loop:

- grounded: the answer copies much of the prompt (repeat, correct, quote with line numbers)
  a ShareGPT prompt of 400-1,500 characters from data/calibration/;
- open: ShareGPT prompts as they are.

Each level gets prompts no earlier level sent: suffix decoding guesses from the outputs
of earlier requests, and a prompt it has answered before would be guessed whole.

Prints output tokens per second per set and concurrency for each server, and the ratio of
speculation on to off measured in the same sitting (servers alternated `--repeat` times,
pooled). Every load is bounded: `--requests` per level, then it stops.

`--peer NAME=URL` measures a server already running there on the same prompts instead
(llama-server or vLLM's CPU build from ../shared/peers/, with or without their n-gram
speculation; restart llama-server between runs, its prompt cache would answer repeats).

    python bench/speculative.py [--levels 1 8 32] [--methods ngram suffix] [--repeat 1] [--json out.json]
    python bench/speculative.py --peer llama-ngram=http://127.0.0.1:8103 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line, free_port, start_server, stop_server

from headroom.models.loader import default_model_path

# The flags each method's server gets: n-gram is the default, so none. The draft is the
# default model drafting for itself (the only model here): every guess is kept, and each
# costs a forward as dear as the target's, which the price must see.
DRAFT = {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 4}
METHODS = {
    "ngram": [],
    "suffix": ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}'],
    "draft": ["--speculative-config", json.dumps(DRAFT)],
}
OFF = ["--speculative-config", '{"method": "off"}']
WARM = ["Say hello.", "Name a colour."]
TASKS = [
    "Repeat the following text exactly as it is written:\n\n{}",
    "Correct the spelling and grammar of the following text and return the whole corrected text:\n\n{}",
    "Quote the following text in full, as a block quote:\n\n{}",
]


def prompt_sets(count: int) -> dict[str, list[str]]:
    rows = [json.loads(line)["prompt"] for line in PROMPTS.open(encoding="utf-8")]
    bodies = [r for r in rows if 400 <= len(r) <= 1500][:count]
    grounded = [TASKS[i % len(TASKS)].format(body) for i, body in enumerate(bodies)]
    open_ = [r for r in rows if 20 <= len(r) <= 400][:count]
    return {"grounded": grounded, "open": open_}


async def level(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str) -> dict:
    """Closed loop: `concurrency` clients take the prompts in turn until none is left."""
    queue = list(prompts)
    tokens, failed = 0, 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, failed
        while queue:
            text = queue.pop(0)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    failed += 1
                    continue
                tokens += (await response.json())["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=600)
    # A connection a request: llama-server drops a kept-alive one (../shared/peers/README.md).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "failed": failed}


async def spec_metrics(url: str) -> dict[str, float]:
    """The spec_decode counters (headroom's, or vLLM's of the same names); {} where none."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    found = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            for prefix in ("headroom", "vllm"):
                if line.startswith(f"{prefix}:spec_decode_{name}_total"):
                    found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as response:
        return (await response.json())["data"][0]["id"]


def measure(name: str, url: str, sets: dict[str, list[str]], args) -> dict:
    model = asyncio.run(served_model(url))
    asyncio.run(level(url, WARM, 1, 16, model))  # the first requests pay for lazy setup; none of the sets
    figures = {}
    for set_name, prompts in sets.items():
        at = 0
        for concurrency in args.levels:
            count = max(args.requests, concurrency)
            chosen, at = prompts[at : at + count], at + count
            r = asyncio.run(level(url, chosen, concurrency, args.max_tokens, model))
            figures[f"{set_name} c={concurrency}"] = r
            print(
                f"{name:8s} {set_name:8s} c={concurrency:<3d} {r['tokens'] / r['seconds']:7.1f} tok/s "
                f"({r['tokens']} tokens in {r['seconds']:.1f} s, {r['failed']} failed)",
                flush=True,
            )
    figures["spec"] = asyncio.run(spec_metrics(url))
    return figures


def run_server(name: str, extra: list[str], sets: dict[str, list[str]], args) -> dict:
    port = free_port()
    proc = start_server(port, "auto", None, True, extra)
    try:
        return measure(name, f"http://127.0.0.1:{port}", sets, args)
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=["ngram", "suffix"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--peer", help="NAME=URL: measure the server running there instead")
    args = p.parse_args()
    print(cpu_line())
    sets = prompt_sets(sum(max(args.requests, c) for c in args.levels))
    if args.peer:
        name, url = args.peer.split("=", 1)
        runs: dict[str, list[dict]] = {name: [measure(name, url, sets, args)]}
    else:
        runs = {"off": [], **{m: [] for m in args.methods}}
        for _ in range(args.repeat):  # the defaults first
            for method in args.methods:
                runs[method].append(run_server(method, METHODS[method], sets, args))
            runs["off"].append(run_server("off", OFF, sets, args))
    report(runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "runs": runs}, indent=1))


def report(runs: dict[str, list[dict]]) -> None:
    """Pooled output tok/s per set and level for each server, and its ratio to off where
    off ran beside it; then the guesses each kept (where its /metrics counts them)."""
    print("\npooled output tok/s" + (": off, then each method and its ratio to off" if "off" in runs else ""))
    for key in next(iter(runs.values()))[0]:
        if key == "spec":
            continue
        rate = {
            name: sum(r[key]["tokens"] for r in rs) / sum(r[key]["seconds"] for r in rs) for name, rs in runs.items()
        }
        cells = [
            f"{name} {rate[name]:7.1f}"
            + (f" {rate[name] / rate['off']:.2f}x" if "off" in rate and name != "off" else "")
            for name in runs
        ]
        print(f"  {key:14s} " + "  ".join(cells))
    for name, rs in runs.items():
        spec = rs[-1]["spec"]
        if spec.get("num_draft_tokens"):
            rows = f" in {spec['num_drafts']:.0f} rows" if "num_drafts" in spec else ""
            print(
                f"{name} guesses: {spec['num_draft_tokens']:.0f}{rows}, "
                f"{spec['num_accepted_tokens'] / spec['num_draft_tokens']:.0%} kept"
            )


if __name__ == "__main__":
    main()
