"""A fresh server's first long prompt beside a noisy neighbour (issue 57, item 3).

Each run starts a fresh `headroom serve` on 127.0.0.1 (defaults, then `--admission off`
as the FCFS baseline), then at t=0 starts another process that keeps one core busy for
`--busy` seconds, sends short chat requests as a Poisson stream (`--rate` a second for
`--duration` seconds) and one long prompt (~2,000 tokens, 512 out) at t=1 s. Prints the
long prompt's TTFT and the short class's TTFT p50/p99 per run, then pooled over
`--repeat` runs of each server, alternated, and the ratio of the defaults to FCFS.

    python bench/neighbour.py [--repeat 3] [--busy 20] [--json out.json] [--server-arg=--no-tune-threads]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line, drive, free_port, load_prompts, pct, start_server, stop_server


def spin(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_once(admission: bool, args, shorts, longs, seed: int) -> dict:
    port = free_port()
    proc = start_server(port, "auto", None, admission, args.server_arg)
    try:
        neighbour = multiprocessing.get_context("spawn").Process(target=spin, args=(args.busy,))
        neighbour.start()
        try:
            run = asyncio.run(
                drive(f"http://127.0.0.1:{port}", shorts, longs[:1], args.rate, args.duration, [1.0], seed)
            )
        finally:
            neighbour.join(args.busy + 30)
            if neighbour.is_alive():
                neighbour.kill()
        # The thread tuner's count at the end and how often it switched (/health).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            threads = json.load(response).get("threads")
    finally:
        stop_server(proc)
    short = [r.ttft for r in run.results if r.cls == "short" and r.status == 200 and r.ttft is not None]
    (long,) = [r for r in run.results if r.cls == "long"]
    failed = [r.status for r in run.results if r.status != 200]
    return {"long_ttft": long.ttft, "short_ttft": short, "failed": failed, "threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--busy", type=float, default=20.0, help="seconds the neighbour keeps one core busy")
    p.add_argument("--rate", type=float, default=2.0, help="short requests per second")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of short requests")
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument(
        "--server-arg", action="append", default=[], help="a flag for both servers (a variant; repeat for more)"
    )
    args = p.parse_args()
    print(cpu_line())
    shorts, longs = load_prompts()
    runs: dict[str, list[dict]] = {"defaults": [], "fcfs": []}
    for i in range(args.repeat):
        for name, admission in (("defaults", True), ("fcfs", False)):
            r = run_once(admission, args, shorts, longs, seed=i)
            runs[name].append(r)
            print(
                f"{name:9s} run {i + 1}: long TTFT {r['long_ttft']:6.2f} s; short TTFT p50 "
                f"{statistics.median(r['short_ttft']):.2f} s p99 {pct(r['short_ttft'], 0.99):.2f} s "
                f"({len(r['short_ttft'])} ok, {len(r['failed'])} failed); threads {r['threads']}",
                flush=True,
            )
    pooled = {}
    for name, rs in runs.items():
        shorts_all = [t for r in rs for t in r["short_ttft"]]
        pooled[name] = {
            "long_ttft_mean": statistics.mean(r["long_ttft"] for r in rs),
            "long_ttft_each": [round(r["long_ttft"], 2) for r in rs],
            "short_ttft_p50": statistics.median(shorts_all),
            "short_ttft_p99": pct(shorts_all, 0.99),
        }
        row = pooled[name]
        print(
            f"{name:9s} pooled: long TTFT mean {row['long_ttft_mean']:.2f} s {row['long_ttft_each']}; "
            f"short TTFT p50 {row['short_ttft_p50']:.2f} s p99 {row['short_ttft_p99']:.2f} s"
        )
    d, f = pooled["defaults"], pooled["fcfs"]
    print(
        f"defaults / fcfs: long TTFT {d['long_ttft_mean'] / f['long_ttft_mean']:.2f}x (target <= 2), "
        f"short TTFT p99 {d['short_ttft_p99'] / f['short_ttft_p99']:.2f}x (target <= 1)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "pooled": pooled}, indent=1))


if __name__ == "__main__":
    main()
