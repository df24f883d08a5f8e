"""Decode attention bandwidth: how fast a backend reads the paged KV cache.

A decode step reads each sequence's whole cached K and V once, so its speed is best
measured in bytes per second against the memory's peak. This times backend.forward
on a decode-only batch (B sequences, context L each, the model's head layout) and
prints achieved GB/s and, where the peak is known (or given), the fraction of it.

On the CPU, --layers N gives each of N layers a cache of its own and times a step over
all of them, as the model's step reads them: past the last-level cache this is the DRAM
regime, and the plain-read line beside it (a sum over a buffer larger than any cache, in
the same run) is the bound to compare with. --chunk Q times prefill instead: Q new tokens
per sequence at each context, read in place by the backend against the torch
reference's gather of the whole context (before/after in one run).
"""

from __future__ import annotations

import argparse
import time

import torch

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention import select_backend
from headroom.executor.attention.kv_rows import row_width, to_rows

# Peak memory bandwidth in GB/s, by a substring of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 80GB HBM3": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10": 600,
}


def decode_batch(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = to_rows(torch.randn(shape, device=device), kv_dtype or dtype)
    v_cache = to_rows(torch.randn(shape, device=device), kv_dtype or dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = context - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size
    ones = torch.arange(batch + 1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=ones,
        seq_start_loc=ones * context,
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context,
        num_decodes=batch,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype)
    return q, k, torch.randn_like(k), k_cache, v_cache, meta


def chunk_batch(
    batch: int,
    chunk: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: torch.dtype,
):
    """B sequences, each bringing `chunk` new tokens that end a `context`-token context."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = to_rows(torch.randn(num_blocks, block_size, kv_heads, head_dim), kv_dtype)
    v_cache = to_rows(torch.randn(num_blocks, block_size, kv_heads, head_dim), kv_dtype)
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).int()
    positions = torch.arange(context - chunk, context)
    slots = (tables[:, positions // block_size].long() * block_size + positions % block_size).flatten()
    starts = torch.arange(batch + 1, dtype=torch.int32) * chunk
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=starts,
        seq_start_loc=torch.arange(batch + 1, dtype=torch.int32) * context,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables,
        max_query_len=chunk,
        max_seq_len=context,
        num_decodes=0,
        query_lens_cpu=[chunk] * batch,
        seq_lens_cpu=[context] * batch,
    )
    q = torch.randn(batch * chunk, heads, head_dim)
    k = torch.randn(batch * chunk, kv_heads, head_dim)
    return q, k, torch.randn_like(k), k_cache, v_cache, meta


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def plain_read_gbps(megabytes: int = 512) -> float:
    """A sum over a buffer larger than any cache: the read bandwidth a kernel can hope for."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    seconds = min(timed(buffer.sum, 3) for _ in range(3))
    return buffer.numel() * 4 / seconds / 1e9


def cpu_main(ns, backend, kv_dtype: torch.dtype) -> None:
    from headroom.executor.attention.torch_ref import TorchAttention

    reference = TorchAttention()
    plain = plain_read_gbps()
    print(f"plain read (sum over 512 MiB): {plain:.1f} GB/s; threads={torch.get_num_threads()}")
    scale = ns.head_dim**-0.5
    for context in (int(c) for c in ns.context.split(",")):
        if ns.chunk:
            args = chunk_batch(
                ns.batch, ns.chunk, context, ns.heads, ns.kv_heads, ns.head_dim, backend.block_size, kv_dtype
            )
            before = timed(lambda args=args: reference.forward(*args, scale), ns.iters)
            after = timed(lambda args=args: backend.forward(*args, scale), ns.iters)
            print(
                f"context {context:>6}, {ns.batch} x {ns.chunk}-token chunks: torch reference {1e3 * before:8.3f} ms, "
                f"{backend.name} {1e3 * after:8.3f} ms ({before / after:.2f}x)"
            )
            continue
        layers = [
            decode_batch(
                ns.batch,
                context,
                ns.heads,
                ns.kv_heads,
                ns.head_dim,
                backend.block_size,
                torch.device("cpu"),
                torch.float32,
                kv_dtype,
            )
            for _ in range(ns.layers)
        ]

        def step(backend=backend, layers=layers):
            for q, k, v, k_cache, v_cache, meta in layers:
                backend.forward(q, k, v, k_cache, v_cache, meta, scale)

        seconds = min(timed(step, ns.iters) for _ in range(ns.repeat))
        kv_bytes = (
            2 * ns.layers * ns.batch * context * ns.kv_heads * row_width(ns.head_dim, kv_dtype) * kv_dtype.itemsize
        )
        gbps = kv_bytes / seconds / 1e9
        print(
            f"context {context:>6}, {ns.layers} layers: {1e3 * seconds:8.3f} ms per decode step, KV read "
            f"{kv_bytes / 2**20:8.1f} MiB, {gbps:6.1f} GB/s, {100 * gbps / plain:.0f}% of the plain read"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="the cache's dtype, if not --dtype (the CPU: float32 queries, a bfloat16 cache)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", default="512,2048,8192")
    # SmolLM2-135M's layout: 9 query heads, 3 KV heads, head_dim 64; Llama-3-8B: 32/8/128.
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-gbps", type=float, default=None, help="the memory's peak (default: by device name)")
    p.add_argument("--layers", type=int, default=1, help="CPU: layers per step, each with its own cache")
    p.add_argument("--chunk", type=int, default=0, help="CPU: time prefill chunks of this many tokens instead")
    p.add_argument(
        "--repeat", type=int, default=3, help="CPU decode: the best of this many timings (a VM's bandwidth drifts)"
    )
    ns = p.parse_args()
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    kv_dtype = getattr(torch, ns.kv_dtype or ns.dtype)
    backend = select_backend(ns.attention_backend, device)
    block_size = backend.block_size
    peak = ns.peak_gbps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak is None:
        peak = next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)
    print(
        f"# attention_bandwidth: device={name} backend={backend.name} block_size={block_size} dtype={ns.dtype} "
        f"kv_dtype={ns.kv_dtype or ns.dtype} "
        f"batch={ns.batch} heads={ns.heads}/{ns.kv_heads} head_dim={ns.head_dim} peak={peak} GB/s"
    )
    if device.type == "cpu":
        cpu_main(ns, backend, kv_dtype)
        return
    sync = torch.cuda.synchronize
    for context in (int(c) for c in ns.context.split(",")):
        q, k, v, k_cache, v_cache, meta = decode_batch(
            ns.batch, context, ns.heads, ns.kv_heads, ns.head_dim, block_size, device, dtype, kv_dtype
        )
        scale = ns.head_dim**-0.5
        for _ in range(3):
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        sync()
        started = time.perf_counter()
        for _ in range(ns.iters):
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        sync()
        seconds = (time.perf_counter() - started) / ns.iters
        kv_bytes = 2 * ns.batch * context * ns.kv_heads * row_width(ns.head_dim, kv_dtype) * kv_dtype.itemsize
        gbps = kv_bytes / seconds / 1e9
        share = f", {100 * gbps / peak:.1f}% of peak" if peak else ""
        print(
            f"context {context:>6}: {1e3 * seconds:8.3f} ms per decode step, KV read {kv_bytes / 2**20:8.1f} MiB, "
            f"{gbps:8.1f} GB/s{share}"
        )


if __name__ == "__main__":
    main()
