"""Decode attention bandwidth: how fast a backend reads the paged KV cache.

A decode step reads each sequence's whole cached K and V once, so its speed is best
measured in bytes per second against the memory's peak. This times backend.forward
on a decode-only batch (B sequences, context L each, the model's head layout) and
prints achieved GB/s and, where the peak is known (or given), the fraction of it.
"""

from __future__ import annotations

import argparse
import time

import torch

from headroom.runtime.attention import AttentionMetadata, select_backend

# Peak memory bandwidth in GB/s, by a substring of torch.cuda.get_device_name().
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864, "L4": 300, "A10": 600}


def decode_batch(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=kv_dtype or dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = (context - 1)
    slots = (tables[:, last // block_size].long() * block_size + last % block_size)
    ones = torch.arange(batch + 1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=ones, seq_start_loc=ones * context, seq_lens=seq_lens,
        block_tables=tables, max_query_len=1, max_seq_len=context, num_decodes=batch,
        query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype)
    return q, k, torch.randn_like(k), k_cache, v_cache, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default=None, help="the cache's dtype, if not --dtype (the CPU: float32 queries, "
                   "a bfloat16 cache)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", default="512,2048,8192")
    # SmolLM2-135M's layout: 9 query heads, 3 KV heads, head_dim 64; Llama-3-8B: 32/8/128.
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-gbps", type=float, default=None, help="the memory's peak (default: by device name)")
    ns = p.parse_args()
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    kv_dtype = getattr(torch, ns.kv_dtype or ns.dtype)
    backend = select_backend(ns.attention_backend, device)
    block_size = backend.block_size
    peak = ns.peak_gbps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak is None:
        peak = next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)
    print(f"# attention_bandwidth: device={name} backend={backend.name} block_size={block_size} dtype={ns.dtype} kv_dtype={ns.kv_dtype or ns.dtype} "
          f"batch={ns.batch} heads={ns.heads}/{ns.kv_heads} head_dim={ns.head_dim} peak={peak} GB/s")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for context in (int(c) for c in ns.context.split(",")):
        q, k, v, k_cache, v_cache, meta = decode_batch(ns.batch, context, ns.heads, ns.kv_heads, ns.head_dim,
                                                        block_size, device, dtype, kv_dtype)
        scale = ns.head_dim ** -0.5
        for _ in range(3):
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        sync()
        started = time.perf_counter()
        for _ in range(ns.iters):
            backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        sync()
        seconds = (time.perf_counter() - started) / ns.iters
        kv_bytes = 2 * ns.batch * context * ns.kv_heads * ns.head_dim * kv_dtype.itemsize
        gbps = kv_bytes / seconds / 1e9
        share = f", {100 * gbps / peak:.1f}% of peak" if peak else ""
        print(f"context {context:>6}: {1e3 * seconds:8.3f} ms per decode step, KV read {kv_bytes / 2**20:8.1f} MiB, "
              f"{gbps:8.1f} GB/s{share}")


if __name__ == "__main__":
    main()
