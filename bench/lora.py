"""Output tokens/s with LoRA adapters against the base model alone, through HTTP.

headroom is started as a user starts it (`headroom serve`, defaults), with N rank-16
adapters (all seven projections, made with peft on the default model's weights and
written to --adapters-dir) given by --lora-modules. Load: c closed-loop clients, prompts
of --prompt-len tokens, --output-len output tokens with ignore_eos; with k adapters,
request i names adapter i % k (k=0: the base). One server serves every level, so the
ratios are against the base within the same process and sitting.

A peer started with the same adapters under the same names (vLLM's CPU build:
`--enable-lora --max-lora-rank 16 --lora-modules a0=DIR/a0 ...`) is measured with
--peer NAME=URL on the same levels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line, free_port, start_server, stop_server
from peers import model_name, one, prompts

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(out_dir: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """count PEFT adapters with random non-zero A and B, made once and reused."""
    made = [(f"a{i}", out_dir / f"a{i}") for i in range(count)]
    if all((path / "adapter_model.safetensors").exists() for _, path in made):
        return made
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from headroom.models.gguf_loader import load_gguf
    from headroom.models.loader import default_model_path

    config, state = load_gguf(default_model_path())
    hf = LlamaForCausalLM(LlamaConfig(**config))
    hf.load_state_dict(state, strict=False)
    for i, (_, path) in enumerate(made):
        torch.manual_seed(i)
        model = get_peft_model(
            hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.1)
        model.save_pretrained(str(path))
        model.unload()
    return made


async def level(url: str, models: list[str], texts: list[str], concurrency: int, per_client: int, out: int) -> dict:
    jobs = [(models[i % len(models)], text) for i, text in enumerate(texts[: concurrency * per_client])]
    results = []

    async def client() -> None:
        while jobs:
            model, text = jobs.pop()
            results.append(await one(url, model, text, out))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "tok_s": len(results) * out / elapsed,
        "tpot_ms": 1000 * statistics.median((e2e - ttft) / (out - 1) for ttft, e2e, _ in results),
    }


def measure(name: str, url: str, ns: argparse.Namespace, adapters: list[str]) -> list[dict]:
    base = asyncio.run(model_name(url))
    texts = prompts(ns.concurrency * ns.per_client * (len(ns.levels) + 1), ns.prompt_len, seed=7)
    asyncio.run(level(url, [base, *adapters], texts[:8], 4, 2, 8))  # warm-up, every adapter once
    rows = []
    for i, k in enumerate(ns.levels):
        models = adapters[:k] or [base]
        chunk = texts[(i + 1) * ns.concurrency * ns.per_client :]
        result = asyncio.run(level(url, models, chunk, ns.concurrency, ns.per_client, ns.output_len))
        rows.append({"server": name, "adapters": k, **result})
        print(f"# {rows[-1]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters-dir", default="/tmp/headroom-lora-bench")
    p.add_argument("--levels", default="0,1,4,8", help="numbers of distinct adapters over the requests")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--peer", action="append", default=[], help="NAME=URL of a server with the same adapters")
    p.add_argument("--out", default=None, help="write the rows here as JSON")
    ns = p.parse_args()
    ns.levels = [int(k) for k in ns.levels.split(",")]
    print(cpu_line())
    made = make_adapters(Path(ns.adapters_dir), max(ns.levels), ns.rank)
    names = [name for name, _ in made]
    port = free_port()
    proc = start_server(port, "auto", None, True, extra=["--lora-modules", *(f"{n}={p}" for n, p in made)])
    try:
        rows = measure("headroom", f"http://127.0.0.1:{port}", ns, names)
    finally:
        stop_server(proc)
    for spec in ns.peer:
        name, _, url = spec.partition("=")
        rows += measure(name, url.rstrip("/"), ns, names)
    base = {r["server"]: r["tok_s"] for r in rows if r["adapters"] == 0}
    print(f"{'server':<10} {'adapters':>8} {'tok/s':>8} {'vs base':>8} {'tpot ms':>8} {'vs headroom':>12}")
    for r in rows:
        ours = next((h["tok_s"] for h in rows if h["server"] == "headroom" and h["adapters"] == r["adapters"]), None)
        vs_base = r["tok_s"] / base[r["server"]] if r["server"] in base else float("nan")
        vs_ours = ours / r["tok_s"] if ours else float("nan")
        row = f"{r['server']:<10} {r['adapters']:>8} {r['tok_s']:>8.1f} {vs_base:>8.2f}"
        print(f"{row} {r['tpot_ms']:>8.1f} {vs_ours:>12.2f}")
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
