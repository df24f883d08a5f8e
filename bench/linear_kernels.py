"""The packed linears' small-batch kernels side by side, in one sitting: the float-activation
kernels (q4_linear, q8_linear: each weight widened to float) against the integer-dot one
(qdot_linear: x rounded to int8 per group of 32, integer dot products, on AVX2 or AVX-512
VNNI), on the same weights, at the default model's shapes and a 1.7B model's, batches of
1-16 rows. Each layer's copies together span more than the last-level cache, as a model's
weights do, so a call pays for its bytes. Prints microseconds a call, the weights' GB/s, the
ratio, and a plain read of a large buffer for the bound.

    .venv/bin/python bench/linear_kernels.py [--threads 2] [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bandwidth import plain_read_gbps
from hol import cpu_line

from headroom.kernels import cpu_kernels
from headroom.models.quant import int4_groups, pack_nibbles

# (K, N): SmolLM2-135M's qkv, o, gate/up, down and output head; SmolLM2-1.7B's gate/up and down.
SHAPES = {
    "135M qkv": (576, 960, 4),
    "135M o": (576, 576, 4),
    "135M gate_up": (576, 3072, 4),
    "135M down": (1536, 576, 4),
    "135M head": (576, 49152, 8),
    "1.7B gate_up": (2048, 16384, 4),
    "1.7B down": (8192, 2048, 4),
}
SPAN = 64 * 2**20  # bytes of weights per shape, over its copies


def weights(k: int, n: int, bits: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Both kernels' layouts of one random weight: q4_linear's nibbles per group of 32 and
    qdot_linear's per 64; for int8, q8_linear's and qdot_linear's bytes are the same."""
    q, scale, low = int4_groups(torch.randn(n, k))
    if bits == 8:
        q = q * 17  # Q4_1's levels as 8-bit ones (as QuantLinear holds int8 with a minimum)
        scale = scale / 17
        return {"float": (q, scale, low), "integer": (q, scale, low)}
    return {"float": (pack_nibbles(q, 32), scale, low), "integer": (pack_nibbles(q, 64), scale, low)}


def call_each(kernel, x: torch.Tensor, layouts: list[tuple[torch.Tensor, ...]], *extra) -> None:
    for weight in layouts:
        kernel(x, *weight, *extra)


def timed(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):  # the fastest pass: the others met a noisy neighbour
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    kernels, why = cpu_kernels()
    if kernels is None or not kernels.qdot_available():
        sys.exit(f"no integer-dot kernel in this build ({why})")
    print(cpu_line())
    print(f"# {why}; threads={ns.threads}; plain read (sum over 512 MiB): {plain_read_gbps():.1f} GB/s")
    print(f"{'shape':>14} {'rows':>4} {'float us':>9} {'integer us':>10} {'ratio':>6} {'integer GB/s':>12}")
    with torch.inference_mode():
        for name in ns.shapes.split(","):
            k, n, bits = SHAPES[name]
            nbytes = k * n * bits // 8
            copies = [weights(k, n, bits) for _ in range(max(2, SPAN // nbytes))]
            float_kernel = kernels.q4_linear if bits == 4 else kernels.q8_linear
            floats, integers = [w["float"] for w in copies], [w["integer"] for w in copies]
            for m in (int(r) for r in ns.rows.split(",")):
                x = torch.randn(m, k)
                before = timed(functools.partial(call_each, float_kernel, x, floats)) / len(copies)
                after = timed(functools.partial(call_each, kernels.qdot_linear, x, integers, bits)) / len(copies)
                print(
                    f"{name:>14} {m:>4} {before * 1e6:>9.0f} {after * 1e6:>10.0f} {before / after:>5.2f}x "
                    f"{nbytes / after / 1e9:>12.1f}"
                )


if __name__ == "__main__":
    main()
