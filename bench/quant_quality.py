"""Perplexity of each CPU weight mode against float32, the way llama.cpp's llama-perplexity
measures it, and llama.cpp's own figure for the same GGUF on the same text.

The text is the ShareGPT prompts the benchmarks use, cut into --ctx-token chunks; in each
chunk the second half is scored (every token predicted with at least ctx/2 of context),
as llama-perplexity does. The default model's file is Q4_1, so "float32" here is those
same weights dequantised: llama.cpp's figure differs from it only by how llama.cpp
computes (its activations are rounded to 8 bits for the Q4_1 dot products), which is the
yardstick the issue asks a quantised mode to meet.

llama.cpp's tokenizer splits some whitespace runs differently from the tokenizers library
(e.g. "\\n " before a digit), so for a like-for-like figure pass --tokenize-with the URL of
a llama-server serving the same GGUF: every mode is then scored on llama.cpp's token ids.

Rows: float32; int8 and int4 with every chunk on the packed path (on a CPU with AVX2 or
AVX-512 VNNI that path rounds activations to 8 bits per group of 32, as llama.cpp does); and the
bfloat16 matmuls that serve batches too large for the packed weights where the CPU has
native bf16. The "+ bf16 KV" rows read the prompt's keys and values back from a bfloat16
cache, as `headroom serve` does beside quantised weights (--kv-cache-dtype auto). The
"served" rows are what `headroom serve` runs on a CPU with AVX-512 VNNI: the packed path up
to batch 4 and the tiled integer kernel above it: the same 8-bit arithmetic summed in
another order, so any difference from the int4 rows is the luck of rounding activations.

usage: python bench/quant_quality.py [--llama-perplexity PATH] [--tokenize-with URL]
                                     [--ctx 256] [--chunks 16]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line

from headroom.config import ModelConfig
from headroom.executor.scoring import chunked_perplexity, corpus
from headroom.models.loader import default_model_path, load_model
from headroom.models.quant import quantize_model


def llama_perplexity(binary: str, text: str, ctx: int, chunks: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        out = subprocess.run(
            [
                binary,
                "-m",
                str(default_model_path()),
                "-f",
                f.name,
                "-c",
                str(ctx),
                "--chunks",
                str(chunks),
                "-t",
                "2",
                "-b",
                str(ctx),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"no PPL in llama-perplexity's output:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1))


def tokenize(url: str, text: str) -> list[int]:
    import httpx

    return httpx.post(url + "/tokenize", json={"content": text}, timeout=300).json()["tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-perplexity", default=None, help="path of llama.cpp's llama-perplexity binary")
    p.add_argument("--tokenize-with", default=None, help="URL of a llama-server serving the same GGUF")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=16)
    args = p.parse_args()
    print(cpu_line())
    text = corpus(PROMPTS)
    rows = {}
    # (row, mode, batches up to which the packed weights serve, dtype of the float matmuls above,
    # KV cache dtype, whether batches above take the tiled integer kernel)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    packed = [
        (f"{mode}{kv_name}", mode, args.ctx, f32, kv, False)
        for kv_name, kv in (("", f32), (" + bf16 KV", bf16), (" + f16 KV", f16))
        for mode in ("int8", "int4")
    ]
    served = [
        (f"int4 served{kv_name}", "int4", 4, f32, kv, True)
        for kv_name, kv in (("", f32), (" + bf16 KV", bf16), (" + f16 KV", f16))
    ]
    variants = [
        ("float32", "none", 0, f32, f32, False),
        ("float32 + bf16 KV", "none", 0, f32, bf16, False),
        ("bfloat16 matmuls", "int8", 0, bf16, f32, False),
        *packed,
        *served,
    ]
    for name, mode, small_batch, large_dtype, kv_dtype, tiled in variants:
        loaded = load_model(ModelConfig(), torch.device("cpu"), torch.float32)
        ids = tokenize(args.tokenize_with, text) if args.tokenize_with else loaded.tokenizer.hf.encode(text)
        chunks = [ids[i * args.ctx : (i + 1) * args.ctx] for i in range(args.chunks)]
        assert len(chunks[-1]) == args.ctx, "text too short for that many chunks"
        quantize_model(loaded.model, mode, small_batch, large_dtype, tiled)
        rows[name] = chunked_perplexity(loaded.model, chunks, kv_dtype)
    if args.llama_perplexity:
        rows["llama.cpp Q4_1"] = llama_perplexity(args.llama_perplexity, text, args.ctx, args.chunks)
    base = rows["float32"]
    tokens = f"llama.cpp's tokens ({args.tokenize_with})" if args.tokenize_with else "the tokenizers library's tokens"
    print(f"perplexity over {args.chunks} chunks of {args.ctx} tokens (second halves scored), on {tokens}")
    print(f"{'mode':<20}{'ppl':>10}{'vs float32':>12}")
    for name, ppl in rows.items():
        print(f"{name:<20}{ppl:>10.4f}{ppl / base:>12.5f}")


if __name__ == "__main__":
    main()
