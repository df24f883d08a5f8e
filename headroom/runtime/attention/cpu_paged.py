"""The CPU backend: decode rows through headroom's C++ kernel, which reads K and V in
place from the block table (no gather into a padded copy, no mask); prefill chunks and
any non-float32 cache through the torch reference it extends."""

from __future__ import annotations

import torch

from headroom.models.kernels import cpu_kernels
from headroom.runtime.attention.metadata import AttentionMetadata
from headroom.runtime.attention.torch_ref import TorchAttention


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

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache.dtype != torch.float32:
            return super().decode(q, k_cache, v_cache, meta, scale)
        nd = meta.num_decodes
        return self.kernels.paged_decode_attention(q.float(), k_cache, v_cache, meta.block_tables[:nd],
                                                   meta.seq_lens[:nd], scale).to(q.dtype)
