"""Head-of-line blocking on the real server: a Poisson stream of short chat requests
plus long requests (prompt ~2,000 tokens, 512 output tokens), in three runs, each
against a fresh `headroom serve` on 127.0.0.1:

  short-only       the short stream alone (the baseline short-class TTFT)
  mixed-fcfs       short + long with --admission off (plain FCFS)
  mixed-admission  short + long with admission on

Scenarios: `defaults` (the default) starts the server with no config file and no
flags beyond the port, the way a new user would, and sends everything as one tenant;
`tenants` writes a config with an interactive (premium) and a reasoning (batch) tenant
and sends the long requests as the latter.

Prints per-class p50/p99 TTFT and TPOT, long requests' TTFT and end-to-end, total
output tokens/s, and writes a PNG of short-class TTFT over time for the three runs.
`--repeat N` does each run N times on fresh servers and pools their requests.
Short prompts are the shortest of data/calibration/sharegpt_prompts.jsonl (ShareGPT,
see its README); long prompts concatenate longer ones up to ~2,000 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "calibration" / "sharegpt_prompts.jsonl"

TENANTS_TOML = """
[admission]
enabled = {enabled}
default_tenant = "interactive"

[[admission.tenants]]
name = "interactive"
tier = "premium"

[[admission.tenants]]
name = "reasoning"
tier = "batch"
max_in_flight_tokens = 8000
burst_tokens = 100000
rate_tokens_per_s = 100000
"""


@dataclass
class Result:
    cls: str
    sent_at: float
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    tpot: float | None = None
    status: int = 0


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    duration: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    port: int, dtype: str, config_path: str | None, admission: bool, extra: list[str] | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "headroom.app.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--port",
        str(port),
        *(extra or []),
    ]
    if config_path:
        cmd += ["--config", config_path]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if not admission:
        cmd += ["--admission", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-3000:])
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def one(
    session: aiohttp.ClientSession,
    url: str,
    cls: str,
    messages: list[dict],
    max_tokens: int,
    tenant: str | None,
    t0: float,
) -> Result:
    result = Result(cls, time.monotonic() - t0)
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": cls == "long",
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first = None
    headers = {"X-Tenant": tenant} if tenant else {}
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
    result.ttft = (first or end) - start
    result.e2e = end - start
    if result.tokens > 1 and first is not None:
        result.tpot = (end - first) / (result.tokens - 1)
    return result


async def drive(
    url: str,
    short_msgs: list[list[dict]],
    long_msgs: list[list[dict]],
    rate: float,
    duration: float,
    long_at: list[float],
    seed: int,
    short_tokens: int = 32,
    tenants: tuple[str | None, str | None] = (None, None),
) -> Run:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        arrivals.append(t)
    t0 = time.monotonic()
    tasks = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def at(delay: float, coro_fn):
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            return await coro_fn()

        for i, a in enumerate(arrivals):
            msgs = short_msgs[i % len(short_msgs)]
            tasks.append(
                asyncio.create_task(at(a, lambda m=msgs: one(session, url, "short", m, short_tokens, tenants[0], t0)))
            )
        for j, a in enumerate(long_at):
            msgs = long_msgs[j % len(long_msgs)]
            tasks.append(asyncio.create_task(at(a, lambda m=msgs: one(session, url, "long", m, 512, tenants[1], t0))))
        results = await asyncio.gather(*tasks)
    run = Run("", list(results), time.monotonic() - t0)
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(run: Run) -> dict:
    out = {
        "run": run.name,
        "duration_s": run.duration,
        "output_tok_s": sum(r.tokens for r in run.results) / run.duration,
    }
    for cls in ("short", "long"):
        rs = [r for r in run.results if r.cls == cls]
        if not rs:
            continue
        ok = [r for r in rs if r.status == 200]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        tpot = [r.tpot for r in ok if r.tpot is not None]
        out[cls] = {
            "n": len(rs),
            "ok": len(ok),
            "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
            "ttft_p99": pct(ttft, 0.99),
            "tpot_p50": statistics.median(tpot) if tpot else float("nan"),
            "tpot_p99": pct(tpot, 0.99),
            "e2e_max": max((r.e2e for r in ok), default=float("nan")),
        }
        if cls == "long":
            out[cls]["ttft_each"] = [round(r.ttft, 2) for r in ok]
            out[cls]["e2e_each"] = [round(r.e2e, 2) for r in ok]
    return out


def load_prompts(tokens_per_char: float = 0.25) -> tuple[list[list[dict]], list[list[dict]]]:
    rows = [json.loads(line) for line in PROMPTS.open(encoding="utf-8")]
    short = [r["prompt"] for r in rows if 10 <= len(r["prompt"]) <= 200][:200]
    longer = sorted((r["prompt"] for r in rows if len(r["prompt"]) > 1500), key=len, reverse=True)
    longs, current = [], ""
    for text in longer:  # ~2,000 tokens at ~4 characters a token
        current += text + "\n\n"
        if len(current) * tokens_per_char >= 2000:
            longs.append(current[: int(2000 / tokens_per_char)] + "\n\nSummarise the text above.")
            current = ""
    return [[{"role": "user", "content": s}] for s in short], [[{"role": "user", "content": s}] for s in longs]


def plot(runs: list[Run], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in runs:
        rs = sorted((r for r in run.results if r.cls == "short" and r.ttft is not None), key=lambda r: r.sent_at)
        ax.plot([r.sent_at for r in rs], [r.ttft * 1000 for r in rs], marker=".", linewidth=1, label=run.name)
    for run in runs:
        for r in run.results:
            if r.cls == "long":
                ax.axvline(r.sent_at, color="grey", linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("request sent at (s into the run); dotted: long requests")
    ax.set_ylabel("short-class TTFT (ms, log)")
    ax.set_title("Head-of-line blocking: short-class TTFT over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def cpu_line() -> str:
    fields = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        return "# cpu: unknown (no lscpu)"
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx"))]
    return f"# cpu: {fields.get('Model name', '?')}, {os.cpu_count()} cores, {' '.join(flags)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("defaults", "tenants"), default="defaults")
    p.add_argument("--rate", type=float, default=1.5, help="short requests per second (Poisson)")
    p.add_argument("--short-tokens", type=int, default=32, help="max_tokens of a short request")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of short arrivals")
    p.add_argument("--long-at", default="5,20,35", help="seconds at which long requests are sent")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--plot", default=str(ROOT / "bench" / "hol_ttft.png"))
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument("--runs", default="short-only,mixed-fcfs,mixed-admission")
    p.add_argument("--config", default=None, help="TOML for `headroom serve` in scenario defaults (a variant)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each kind, each on a fresh server, pooled: a p99 of 99 requests is their "
        "second slowest, and the short-only baseline alone spans 74-114 ms run to run",
    )
    ns = p.parse_args()
    short_msgs, long_msgs = load_prompts()
    long_at = [float(x) for x in ns.long_at.split(",") if x]
    tenants = ("interactive", "reasoning") if ns.scenario == "tenants" else (None, None)
    print(
        f"# hol, scenario {ns.scenario}: {ns.rate} short req/s (Poisson, max_tokens {ns.short_tokens}, greedy) "
        f"for {ns.duration:.0f} s; {len(long_at)} long requests (~2,000-token prompts, 512 tokens, ignore_eos) "
        f"at {long_at} s; each run {ns.repeat}x, pooled"
    )
    print(cpu_line())
    runs, summaries = [], []
    for name in ns.runs.split(","):
        admission = name != "mixed-fcfs"
        run = Run(name)
        for _ in range(ns.repeat):
            config_path = ns.config if ns.scenario == "defaults" else None
            if ns.scenario == "tenants":
                with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
                    f.write(TENANTS_TOML.format(enabled="true" if admission else "false"))
                config_path = f.name
            port = free_port()
            proc = start_server(port, ns.dtype, config_path, admission)  # fresh: no prefix cache carried over
            try:
                url = f"http://127.0.0.1:{port}"
                asyncio.run(drive(url, short_msgs[:3], [], 5.0, 1.0, [], 1, ns.short_tokens, tenants))  # warm-up
                one_run = asyncio.run(
                    drive(
                        url,
                        short_msgs,
                        long_msgs,
                        ns.rate,
                        ns.duration,
                        [] if name == "short-only" else long_at,
                        7,
                        ns.short_tokens,
                        tenants,
                    )
                )
            finally:
                stop_server(proc)
                if config_path and config_path != ns.config:
                    os.unlink(config_path)
            run.results += one_run.results
            run.duration += one_run.duration
        runs.append(run)
        s = summarize(run)
        summaries.append(s)
        line = f"{name:16s} tok/s {s['output_tok_s']:6.1f}"
        for cls in ("short", "long"):
            if cls in s:
                c = s[cls]
                line += (
                    f" | {cls}: n={c['n']} ok={c['ok']} TTFT p50 {c['ttft_p50'] * 1000:7.0f} ms "
                    f"p99 {c['ttft_p99'] * 1000:7.0f} ms, TPOT p50 {c['tpot_p50'] * 1000:5.0f} ms "
                    f"p99 {c['tpot_p99'] * 1000:5.0f} ms"
                )
        print(line, flush=True)
        if "long" in s:
            print(f"{'':16s} long TTFT each {s['long']['ttft_each']} s, end-to-end each {s['long']['e2e_each']} s")
    base = next((s for s in summaries if s["run"] == "short-only"), None)
    if base:
        for s in summaries[1:]:
            print(f"# {s['run']}: short p99 TTFT {s['short']['ttft_p99'] / base['short']['ttft_p99']:.2f}x short-only")
    fcfs = next((s for s in summaries if s["run"] == "mixed-fcfs"), None)
    adm = next((s for s in summaries if s["run"] == "mixed-admission"), None)
    if fcfs and adm:
        print(f"# mixed-admission / mixed-fcfs: total tok/s {adm['output_tok_s'] / fcfs['output_tok_s']:.2f}x")
        if adm.get("long") and fcfs.get("long") and adm["long"]["ttft_each"] and fcfs["long"]["ttft_each"]:
            for key, label in (("ttft_each", "long TTFT"), ("e2e_each", "long end-to-end")):
                a, f = statistics.mean(adm["long"][key]), statistics.mean(fcfs["long"][key])
                print(f"# {label} mean {a:.1f} s vs FCFS {f:.1f} s ({a / f:.2f}x)")
    if plot(runs, ns.plot):
        print(f"# plot: {ns.plot}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
