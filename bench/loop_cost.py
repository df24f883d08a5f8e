"""The loop detector's cost per engine step at 32 sequences, against the step itself.

Runs the engine in-process on 32 held-out calibration prompts (greedy, max_tokens
--tokens, the server's default loop settings, policy `flag` so that nothing ends
early), reads the mean decode step time from the engine's counters, then replays the 32
outputs token by token through the same trackers and checks (LoopTracker.push and
LoopPolicy.check, what the engine thread runs per sequence per step) and times them.
Prints both and their ratio; the target is under 1%.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line

from headroom.config import AdminConfig, Config
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine
from headroom.runtime.loops import LoopPolicy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="replays timed; the best is kept")
    args = p.parse_args()
    print(cpu_line())
    rows = [json.loads(line) for line in (PROMPTS.parent / "smollm2-135m-labels.jsonl").open(encoding="utf-8")]
    prompts = [r["prompt"] for r in rows if r["split"] == "test" and r["prompt_tokens"] < 300][: args.sequences]
    engine = Engine(Config(admin=AdminConfig(loop_policy="flag")))
    ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in prompts]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=False)
    engine.generate(ids[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    before = engine.counters()
    requests = engine.generate(ids, sampling)
    after = engine.counters()
    steps = after.steps - before.steps
    step_s = (after.step_time_s - before.step_time_s) / steps
    looping = sum(r.loop_detected_at is not None for r in requests)

    policy = LoopPolicy.of(engine.config.admin)
    best = float("inf")
    for _ in range(args.repeats):
        replays = [engine.new_request(i, sampling) for i in ids]
        for r in replays:
            policy.attach(r)
        outputs = [r.output_token_ids for r in requests]
        started = time.perf_counter()
        for n in range(max(len(o) for o in outputs)):
            for replay, output in zip(replays, outputs, strict=True):
                if n < len(output):
                    replay.output_token_ids.append(output[n])
                    replay.loop.push(replay.output_token_ids)
                    policy.check(replay)
        best = min(best, time.perf_counter() - started)
    tokens = sum(len(r.output_token_ids) for r in requests)
    per_step = best / steps
    print(f"{len(requests)} sequences, {tokens} output tokens in {steps} steps; {looping} found looping")
    print(
        f"engine step: {step_s * 1000:.2f} ms mean; detector: {per_step * 1e6:.1f} us per step "
        f"({best / tokens * 1e6:.2f} us per token), {per_step / step_s:.2%} of the step"
    )


if __name__ == "__main__":
    main()
