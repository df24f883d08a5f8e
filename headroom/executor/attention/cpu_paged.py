"""The CPU backend: headroom's C++ kernels read K and V in place from the block table (no
gather into a padded copy, no mask) from a float32, float16, bfloat16 or int8 cache. A step of
decodes only writes its K/V and attends in one call; a step with prefill chunks writes its
K/V, then attends every row in one call, so a chunk deep in a long context costs its own
tokens rather than a widened copy of the whole context. Other caches and head sizes, and
builds without the kernels, take the torch reference it extends."""

from __future__ import annotations

import functools
import time

import torch

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.kv_rows import to_rows
from headroom.executor.attention.torch_ref import TorchAttention, write_kv
from headroom.kernels import cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)  # the caches the C++ kernel reads
# How a chunk's tiles take their dot products (the kernel's paged_tile.h).
DOTS = {0: "float32 FMAs", 1: "bfloat16 pairs (AVX-512 BF16)", 2: "bfloat16 AMX tiles"}


def time_dots(kernels, dots: int, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> float:
    """Seconds a 256-token chunk's attention over a 1,024-token context of the model's
    heads takes with these dot products: the fastest of five (the others met a neighbour)."""
    block, context, chunk = 16, 1024, 256
    gen = torch.Generator().manual_seed(0)
    k_cache = to_rows(torch.randn(context // block, block, kv_heads, head_dim, generator=gen), kv_dtype)
    v_cache = to_rows(torch.randn(context // block, block, kv_heads, head_dim, generator=gen), kv_dtype)
    q = torch.randn(chunk, heads, head_dim, generator=gen)
    table = torch.arange(context // block, dtype=torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    best = float("inf")
    for _ in range(6):  # the first warms the caches and the thread pool
        began = time.perf_counter()
        kernels.paged_prefill_attention(q, k_cache, v_cache, table, lens, starts, head_dim**-0.5, dots)
        best = min(best, time.perf_counter() - began)
    return best


@functools.cache
def dots_faster(form: int, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the bfloat16 form is clearly (10%) faster than float32 here, and the timings
    in words. Which wins depends on the core (AMD runs a bfloat16 pair as fast as a float32
    FMA; Intel's vdpbf16ps at a fraction of it, its AMX tiles far faster), so it is measured
    where it serves; once a process, so that every engine in it computes alike."""
    kernels, _ = cpu_kernels()
    fp32_s = time_dots(kernels, 0, heads, kv_heads, head_dim, kv_dtype)
    bf16_s = time_dots(kernels, form, heads, kv_heads, head_dim, kv_dtype)
    timed = f"a 256-token chunk's attention {bf16_s * 1e3:.2f} ms with {DOTS[form]}, {fp32_s * 1e3:.2f} ms in float32"
    return bf16_s < 0.9 * fp32_s, timed


class CpuPagedAttention(TorchAttention):
    name = "cpu_paged"

    @staticmethod
    def check_available(device: torch.device) -> None:
        if device.type != "cpu":
            raise RuntimeError(f"runs on the CPU only, not {device.type}")
        module, why = cpu_kernels()
        if module is None:
            raise RuntimeError(why)

    def __init__(self) -> None:
        self.kernels, _ = cpu_kernels()
        self.dots = 0  # how the chunks take their dot products (kernels: bf16_attention_form; device.py)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_decodes == meta.num_seqs and k_cache.dtype in KERNEL_DTYPES and q.dtype == torch.float32:
            # A decode-only step: one call writes this step's K/V and attends.
            return self.kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, k, v, meta.slot_mapping
            )
        if self._prefill_in_place(q, k_cache):
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return self.kernels.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, self.dots
            )
        return super().forward(q, k, v, k_cache, v_cache, meta, scale)

    def _prefill_in_place(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            k_cache.dtype in KERNEL_DTYPES
            and q.dtype == torch.float32
            and self.kernels.paged_prefill_available(q.shape[-1])
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache.dtype not in KERNEL_DTYPES:
            return super().decode(q, k_cache, v_cache, meta, scale)
        nd = meta.num_decodes
        return self.kernels.paged_decode_attention(
            q.float(), k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
        ).to(q.dtype)
