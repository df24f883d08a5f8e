"""The same load against any OpenAI-compatible servers, one table, ratios against headroom.

headroom is started the way a user starts it (`headroom serve`, defaults, 127.0.0.1);
peers are given as NAME=URL[@PID] (start them with ../shared/peers/, one at a time on a
small machine: pass --only to measure one server per invocation and --append to add its
row to a JSON file). With a PID, the server's peak RSS (VmHWM) is read from /proc.

Load, for every server: prompts of --prompt-len tokens (ShareGPT text, each with a fresh
nonce so no server answers from a prompt cache), --output-len tokens with ignore_eos,
closed-loop clients at each concurrency, a new connection per request. TTFT alone is the
mean first-token latency at concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line, free_port, start_server, stop_server


def prompts(n: int, length: int, seed: int) -> list[str]:
    from headroom.models.loader import default_model_path
    from headroom.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    rows = [json.loads(line)["prompt"] for line in PROMPTS.open(encoding="utf-8")]
    text = " ".join(r for r in rows if len(r) > 200)
    ids = tok.hf.encode(text)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - length)
        out.append(tok.hf.decode(ids[start : start + length - 8]))  # room for the nonce
    return out


async def one(url: str, model: str, prompt: str, output_len: int) -> tuple[float, float, int]:
    body = {
        "model": model,
        "prompt": f"[{uuid.uuid4().hex[:8]}] {prompt}",
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=900)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        session.post(url + "/v1/completions", json=body) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                tokens += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


async def level(url: str, model: str, texts: list[str], concurrency: int, per_client: int, output_len: int) -> dict:
    queue = list(texts[: concurrency * per_client])
    results = []

    async def client() -> None:
        while queue:
            results.append(await one(url, model, queue.pop(), output_len))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    # Streamed chunks can carry more than one token; count output_len per request.
    tpot = [(e2e - ttft) / (output_len - 1) for ttft, e2e, _ in results]
    return {
        "tok_s": len(results) * output_len / elapsed,
        "ttft": statistics.mean(r[0] for r in results),
        "tpot": statistics.median(tpot),
    }


def peak_rss_gib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return None


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


def measure(name: str, url: str, pid: int | None, ns: argparse.Namespace) -> dict:
    model = asyncio.run(model_name(url))
    texts = prompts(ns.concurrency_high * ns.per_client + ns.per_client + 4, ns.prompt_len, seed=len(name))
    asyncio.run(level(url, model, texts[:2], 1, 2, 8))  # warm-up
    row = {"server": name}
    low = asyncio.run(level(url, model, texts[2:], 1, ns.per_client, ns.output_len))
    high = asyncio.run(level(url, model, texts[2 + ns.per_client :], ns.concurrency_high, ns.per_client, ns.output_len))
    row.update(
        tok_s_c1=low["tok_s"],
        tpot_c1_ms=1000 * low["tpot"],
        ttft_alone_ms=1000 * low["ttft"],
        tok_s_high=high["tok_s"],
        peak_rss_gib=peak_rss_gib(pid),
    )
    print(f"# {name}: {row}", flush=True)
    return row


def table(rows: list[dict], concurrency_high: int) -> None:
    base = next((r for r in rows if r["server"] == "headroom"), None)
    print(
        f"| server | out tok/s c=1 | c={concurrency_high} | TPOT c=1 ms | TTFT alone ms | peak RSS GiB |"
        " c=1 vs headroom | c=high vs headroom |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rss = "" if r["peak_rss_gib"] is None else f"{r['peak_rss_gib']:.2f}"
        ratios = (
            ("", "")
            if base is None
            else (f"{r['tok_s_c1'] / base['tok_s_c1']:.2f}x", f"{r['tok_s_high'] / base['tok_s_high']:.2f}x")
        )
        print(
            f"| {r['server']} | {r['tok_s_c1']:.1f} | {r['tok_s_high']:.1f} | {r['tpot_c1_ms']:.0f} | "
            f"{r['ttft_alone_ms']:.0f} | {rss} | {ratios[0]} | {ratios[1]} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peers", nargs="*", help="NAME=URL[@PID] of a running OpenAI-compatible server")
    p.add_argument("--no-headroom", action="store_true", help="do not start and measure headroom")
    p.add_argument("--headroom-args", default="", help="extra flags for `headroom serve` (a variant)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency-high", type=int, default=32)
    p.add_argument("--per-client", type=int, default=2, help="requests per closed-loop client")
    p.add_argument("--append", default=None, help="JSON file of rows to add this run's rows to, then print all")
    ns = p.parse_args()
    print(cpu_line())
    rows = json.loads(Path(ns.append).read_text()) if ns.append and Path(ns.append).exists() else []
    if not ns.no_headroom:
        port = free_port()
        proc = start_server(port, "auto", None, True, extra=ns.headroom_args.split())
        try:
            name = "headroom" + (f" {ns.headroom_args}" if ns.headroom_args else "")
            rows.append(measure(name, f"http://127.0.0.1:{port}", proc.pid, ns))
        finally:
            stop_server(proc)
    for spec in ns.peers:
        name, _, rest = spec.partition("=")
        url, _, pid = rest.partition("@")
        rows.append(measure(name, url.rstrip("/"), int(pid) if pid else None, ns))
    if ns.append:
        Path(ns.append).write_text(json.dumps(rows, indent=2))
    table(rows, ns.concurrency_high)


if __name__ == "__main__":
    main()
