"""Where one decode step of the default model goes, by part (issue 58: a small model's fixed cost).

Runs the engine in-process, as the server builds it (defaults, n-gram guessing off so
that a step is one token), on --streams prompts of --prompt-len random token ids and
--tokens greedy tokens each, and times each part of every decode step with
perf_counter around the call:

    schedule   Scheduler.schedule
    prepare    the runner's input tensors and block tables (ModelRunner.prepare)
    linears    every projection and the lm_head (the packed int4 matmuls)
    attention  the attention backend's call (cache write and decode attention)
    rest       the rest of the forward: embedding, norms, RoPE, SiLU, Python between them
    sample     the sampler
    update     the scheduler's update, the outputs' delivery and everything else in step()

The wrappers themselves cost a little (two perf_counter calls a linear); the step is
also timed once without them (--repeat passes, the fastest) and the difference is
printed. Prints the weight bytes a step reads and the plain-read bound at --bandwidth
GB/s, or at what a sum over 512 MB reads a second here where it is not given.

    python bench/step_parts.py [--streams 1] [--tokens 128] [--bandwidth 20] [--model FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line

from headroom.config import Config, ModelConfig, SpeculativeConfig
from headroom.contracts.request import SamplingParams
from headroom.models.quant import QuantLinear
from headroom.runtime.engine import Engine


class Parts:
    """Seconds by part for the steps being timed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, part: str) -> None:
        """Times obj.name's calls while `on`. A proxy rather than a function, so that a
        callable object's other attributes stay in use (the sampler's add and remove)."""
        parts, inner = self, getattr(obj, name)

        class Timed:
            def __getattr__(self, attr):
                return getattr(inner, attr)

            def __call__(self, *args, **kwargs):
                if not parts.on:
                    return inner(*args, **kwargs)
                t = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    parts.seconds[part] += time.perf_counter() - t

        setattr(obj, name, Timed())


def plain_read_gb_s(mb: int = 512, repeat: int = 7) -> float:
    """GB/s of a plain read at the engine's thread count: a sum over a buffer far past the caches."""
    buf = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def decode(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """Prefill the prompts, then time the decode steps alone: seconds, steps."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.submit(engine.new_request(p, params), lambda out: None)
    engine.step()  # takes the requests in (the engine thread is not started)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    steps, started = 0, time.perf_counter()
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - started, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=None, help="measured plain-read GB/s, for the bound")
    p.add_argument("--model", default=None, help="a GGUF file or checkpoint (bench/random_model.py makes a 1.7B one)")
    ns = p.parse_args()
    print(cpu_line())
    engine = Engine(Config(model=ModelConfig(model=ns.model), speculative=SpeculativeConfig(method="off")))
    engine.threads = None  # no thread trials: every step at the configured count
    rng = random.Random(0)
    vocab = engine.loaded.args.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.streams)]

    decode(engine, prompts(), 8)  # warm-up
    plain = min(decode(engine, prompts(), ns.tokens)[0] / ns.tokens for _ in range(ns.repeat))

    parts = Parts()
    model, runner = engine.runner.model, engine.runner
    linears = [m for m in model.modules() if isinstance(m, (QuantLinear, torch.nn.Linear))]
    weight_bytes = 0
    for m in linears:
        parts.wrap(m, "forward", "linears")
        if not isinstance(m, QuantLinear):
            read = (m.weight, m.bias)
        elif ns.streams > m.small_batch:  # the layout forward takes: tiles, else the float matmul's
            read = (*m.tiles, m.bias) if m.tiles is not None else (m.large.weight, m.bias)
        else:
            read = (m.qweight, m.scales, m.mins, m.bias)
        weight_bytes += sum(t.numel() * t.element_size() for t in read if t is not None)
    parts.wrap(runner.backend, "forward", "attention")
    parts.wrap(model, "forward", "forward")
    parts.wrap(model, "compute_logits", "logits")
    parts.wrap(runner, "prepare", "prepare")
    parts.wrap(engine.scheduler, "schedule", "schedule")
    parts.wrap(engine, "sampler", "sample")
    parts.wrap(engine, "step", "step")
    parts.on = True
    timed = []
    for _ in range(ns.repeat):
        parts.seconds.clear()
        seconds, steps = decode(engine, prompts(), ns.tokens)
        timed.append((seconds, steps, dict(parts.seconds)))
    seconds, steps, s = min(timed, key=lambda t: t[0])
    # Prefill steps ran inside decode() too: scale the parts by the decode steps' share.
    whole = s["step"]
    share = seconds / whole if whole else 1.0
    per = {k: 1000 * v * share / steps for k, v in s.items()}
    linear_ms = per.get("linears", 0.0)
    # The lm_head runs in compute_logits, outside the forward; the other linears inside it.
    rest = per["forward"] - (linear_ms - per["logits"]) - per["attention"]
    outside = per["step"] - per["schedule"] - per["prepare"] - per["forward"] - per["logits"] - per["sample"]
    rows = [
        ("schedule", per["schedule"]),
        ("prepare", per["prepare"]),
        ("linears", linear_ms),
        ("attention", per["attention"]),
        ("rest of forward", rest),
        ("sample", per["sample"]),
        ("update and the rest", outside),
    ]
    step_ms = per["step"]
    print(
        f"# step_parts: model={engine.loaded.name} quantization={engine.loaded.quantization} "
        f"threads={torch.get_num_threads()} streams={ns.streams} prompt={ns.prompt_len} tokens={ns.tokens}"
    )
    print(f"decode step, no wrappers: {1000 * plain:.2f} ms; with them: {step_ms:.2f} ms")
    for name, ms in rows:
        print(f"  {name:20s} {ms:6.2f} ms  {100 * ms / step_ms:5.1f}%")
    mb = weight_bytes / 1e6
    bandwidth = ns.bandwidth or plain_read_gb_s()
    bound = mb / bandwidth  # MB / (GB/s) = ms
    print(
        f"weights the linears read a step: {mb:.1f} MB; at the plain read's {bandwidth:.1f} GB/s"
        f"{'' if ns.bandwidth else ' (measured here)'} that is {bound:.2f} ms: the linears run at "
        f"{mb / linear_ms:.1f} GB/s ({100 * bound / linear_ms:.0f}% of it), the step at {100 * bound / step_ms:.0f}%"
    )


if __name__ == "__main__":
    main()
