"""What the length probe costs the engine: the share of step time spent in it
with 32 running sequences, and output tok/s with it on against off, in one process.

The engine runs the default model with its defaults. Each round generates the same
--concurrency requests (prompts of --prompt-len token ids, --output-len tokens,
temperature 0; ignore_eos is off so the probe has to guess, as it does in serving) with
the probe off, then on, then off and on again; the ratio is on/off over the rounds.
The probe's own time is measured around Engine.hidden_hook (its predictions, the loop
signals and the PCA), and the forward pass's extra gather of the probe rows is inside
the step time it is compared with.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from headroom.config import Config
from headroom.contracts.request import SamplingParams
from headroom.prediction.probe_model import load_probe
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import EngineStats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line


def run(engine: Engine, prompts: list[list[int]], output_len: int, hook_time: list[float]) -> dict:
    engine.stats = EngineStats()
    hook_time.clear()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, min_tokens=output_len)
    started = time.perf_counter()
    requests = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(r.num_output_tokens for r in requests)
    return {
        "tok_s": tokens / elapsed,
        "step_s": engine.stats.step_time_s,
        "probe_s": sum(hook_time),
        "steps": engine.stats.steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    engine = Engine(Config())
    shape = engine.loaded.args
    probe = load_probe(None, shape.hidden_size, shape.num_layers, shape.vocab_size)
    if probe is None:
        raise SystemExit("no packaged length probe fits the default model")
    refiner = engine.use_probe(probe, every=16, runaway_threshold=0.8, long_min_output=512)
    observe = refiner.observe
    hook_time: list[float] = []

    def timed(requests, hidden):
        start = time.perf_counter()
        observe(requests, hidden)
        hook_time.append(time.perf_counter() - start)

    def switch(on: bool) -> None:
        if on:
            engine.watch_hidden(frozenset({probe.layer}), timed, refiner.due, refiner)
        else:
            engine.watch_hidden(frozenset(), None)

    rng = random.Random(0)
    prompts = [[rng.randrange(100, shape.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    switch(False)
    engine.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up

    print(cpu_line())
    print(
        f"# {args.concurrency} sequences, {args.prompt_len}-token prompts, "
        f"{args.output_len} output tokens, estimates every 16 tokens"
    )
    print(f"{'round':>5} {'probe':>5} {'tok/s':>8} {'steps':>6} {'step s':>8} {'probe s':>8} {'probe share':>12}")
    totals = {False: 0.0, True: 0.0}
    shares = []
    for r in range(args.rounds):
        for on in (False, True):
            switch(on)
            res = run(engine, prompts, args.output_len, hook_time)
            totals[on] += res["tok_s"]
            share = res["probe_s"] / res["step_s"]
            if on:
                shares.append(share)
            print(
                f"{r:>5} {'on' if on else 'off':>5} {res['tok_s']:>8.1f} {res['steps']:>6} {res['step_s']:>8.2f} "
                f"{res['probe_s']:>8.3f} {100 * share:>11.2f}%"
            )
    print(
        f"\ntok/s on/off: {totals[True] / totals[False]:.3f}x; probe share of step time: "
        f"{100 * min(shares):.2f}-{100 * max(shares):.2f}%; estimates: {refiner.estimates}"
    )


if __name__ == "__main__":
    main()
