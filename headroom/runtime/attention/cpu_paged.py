"""The CPU backend: decode rows through headroom's C++ kernel, which reads K and V in
place from the block table (no gather into a padded copy, no mask) from a float32, float16
or bfloat16 cache and, in a step of decodes only, writes the step's K/V in the same call;
prefill chunks, and any other cache, through the torch reference it extends."""

from __future__ import annotations

import torch

from headroom.models.kernels import cpu_kernels
from headroom.runtime.attention.metadata import AttentionMetadata
from headroom.runtime.attention.torch_ref import TorchAttention

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the caches the C++ kernel reads


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

    def reads_unwritten_slots(self, dtype: torch.dtype) -> bool:
        return dtype not in KERNEL_DTYPES  # the kernel reads each context to its length only

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_decodes == meta.num_seqs and k_cache.dtype in KERNEL_DTYPES and q.dtype == torch.float32:
            # A decode-only step: one call writes this step's K/V and attends.
            return self.kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                       k, v, meta.slot_mapping)
        return super().forward(q, k, v, k_cache, v_cache, meta, scale)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache.dtype not in KERNEL_DTYPES:
            return super().decode(q, k_cache, v_cache, meta, scale)
        nd = meta.num_decodes
        return self.kernels.paged_decode_attention(q.float(), k_cache, v_cache, meta.block_tables[:nd],
                                                   meta.seq_lens[:nd], scale).to(q.dtype)
