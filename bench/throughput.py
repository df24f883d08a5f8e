"""Output tokens/s of the engine at several concurrencies, and the step overhead share.

Each run submits `concurrency` requests at once (prompt of --prompt-len random token
ids, --output-len output tokens with ignore_eos) and steps the engine until all finish.
Step overhead = 1 - (model forward time / step wall time): scheduling, input building,
sampling and detokenisation.

On CUDA, decode replays CUDA graphs; `--compare-eager` runs the same levels again on an
engine with graphs off (in this process, same weights) and prints graphs/eager ratios.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from headroom.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import EngineStats


def run_once(engine: Engine, concurrency: int, prompt_len: int, output_len: int, rng: random.Random) -> dict:
    vocab = engine.loaded.args.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.stats = EngineStats()
    started = time.perf_counter()
    requests = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    s = engine.stats
    decode_times = [r.finished_time - r.first_token_time for r in requests]
    assert all(r.num_output_tokens == output_len for r in requests)
    return {
        "concurrency": concurrency,
        "output_tok_s": concurrency * output_len / elapsed,
        "elapsed_s": elapsed,
        "mean_ttft_s": sum(r.first_token_time - r.arrival_time for r in requests) / concurrency,
        "mean_tpot_ms": 1000 * sum(decode_times) / concurrency / max(output_len - 1, 1),
        "overhead_share": 1 - s.forward_time_s / s.step_time_s,
        "steps": s.steps,
        "preemptions": s.preemptions,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="auto, none, int8, int4 (CPU)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, float32, bfloat16, float16, int8")
    p.add_argument("--compare-kv", default=None, help="also run with this KV cache dtype; print ratios")
    p.add_argument("--concurrency", default=None, help="default: 1,8,32,64 on CPU, 1,32,128 on CUDA")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument("--compare-eager", action="store_true", help="CUDA: also run with graphs off; print ratios")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--tune-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine measures and picks its thread count (the default, as the server's)",
    )
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    cuda = ns.device == "cuda" or (ns.device == "auto" and torch.cuda.is_available())
    levels = [int(c) for c in (ns.concurrency or ("1,32,128" if cuda else "1,8,32,64")).split(",")]
    results = run_levels(ns, levels, enforce_eager=ns.enforce_eager)
    if ns.compare_eager and not ns.enforce_eager:
        if not cuda:
            print("# --compare-eager: no CUDA graphs on the CPU; nothing to compare")
            return
        eager = run_levels(ns, levels, enforce_eager=True)
        for g, e in zip(results, eager, strict=True):
            print(f"# ratio graphs/eager at c{g['concurrency']}: {g['output_tok_s'] / e['output_tok_s']:.2f}x")
    if ns.compare_kv:
        other = run_levels(ns, levels, enforce_eager=ns.enforce_eager, kv_cache_dtype=ns.compare_kv)
        for a, b in zip(results, other, strict=True):
            print(
                f"# ratio kv {ns.kv_cache_dtype}/{ns.compare_kv} at c{a['concurrency']}: "
                f"{a['output_tok_s'] / b['output_tok_s']:.2f}x"
            )


def run_levels(
    ns: argparse.Namespace, levels: list[int], enforce_eager: bool, kv_cache_dtype: str | None = None
) -> list[dict]:
    config = Config(
        model=ModelConfig(
            model=ns.model,
            device=ns.device,
            dtype=ns.dtype,
            quantization=ns.quantization,
            enforce_eager=enforce_eager,
            tune_threads=ns.tune_threads,
        ),
        cache=CacheConfig(
            kv_cache_memory_gib=2.0, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype or ns.kv_cache_dtype
        ),
        scheduler=SchedulerConfig(max_num_seqs=max(levels), max_num_batched_tokens=ns.max_num_batched_tokens),
        attention_backend=ns.attention_backend,
    )
    engine = Engine(config)
    print(
        f"# throughput: model={engine.loaded.name} device={engine.executor.device} dtype={engine.executor.dtype} "
        f"quantization={engine.loaded.quantization} kv_cache_dtype={engine.executor.kv_dtype} "
        f"backend={engine.executor.backend.name} cuda_graphs={engine.executor.cuda_graphs} "
        f"threads={torch.get_num_threads()} "
        f"torch={torch.__version__} cpu={platform.processor() or platform.machine()}"
        + (
            f" gpu={torch.cuda.get_device_name(engine.executor.device)}"
            if engine.executor.device.type == "cuda"
            else ""
        )
    )
    print(f"# prompt={ns.prompt_len} output={ns.output_len} ignore_eos=True, random prompt token ids")
    rng = random.Random(0)
    run_once(engine, 2, 16, 4, rng)  # warm-up
    results = []
    print(
        f"{'conc':>5} {'out tok/s':>10} {'elapsed s':>10} {'TTFT s':>8} {'TPOT ms':>8} {'overhead':>9} {'steps':>6}"
        f" {'threads':>8}"
    )
    tuner = engine.threads
    for c in levels:
        r = run_once(engine, c, ns.prompt_len, ns.output_len, rng)
        results.append(r)
        # The count the engine ran at by the end, and its switches so far (runtime/threads.py).
        threads = f"{tuner.current} ({tuner.switches})" if tuner is not None else "-"
        print(
            f"{c:>5} {r['output_tok_s']:>10.1f} {r['elapsed_s']:>10.2f} {r['mean_ttft_s']:>8.2f} "
            f"{r['mean_tpot_ms']:>8.1f} {r['overhead_share']:>8.1%} {r['steps']:>6} {threads:>8}",
            flush=True,
        )
    base = results[0]["output_tok_s"]
    for r in results[1:]:
        print(f"# ratio c{r['concurrency']}/c{results[0]['concurrency']}: {r['output_tok_s'] / base:.2f}x")
    return results


if __name__ == "__main__":
    main()
