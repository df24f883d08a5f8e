"""The xformers backend: one memory_efficient_attention call over the mixed batch."""

from __future__ import annotations

import torch

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.torch_ref import write_kv


def context_slots(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """Cache slots of every context position, sequence after sequence: (sum(seq_lens),)."""
    device = meta.block_tables.device
    total = sum(meta.seq_lens_cpu)
    seq_ids = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), meta.seq_lens, output_size=total)
    positions = torch.arange(total, device=device) - meta.seq_start_loc[seq_ids]
    blocks = meta.block_tables[seq_ids, positions // block_size].long()
    return blocks * block_size + positions % block_size


class XFormersAttention:
    name = "xformers"
    block_size = 16
    cuda_graphs = False  # its forward loops over host-side lengths

    @staticmethod
    def check_available(device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"xformers needs a CUDA device, got {device}")
        from xformers.ops import fmha  # noqa: F401
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask  # noqa: F401

    def __init__(self) -> None:
        from xformers.ops import fmha
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask

        self._attend = fmha.memory_efficient_attention_forward
        self._mask = BlockDiagonalCausalFromBottomRightMask

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        # xformers runs paged biases only on FA2 (pages % 256) or decode-only split-k: gather.
        slots = context_slots(meta, k_cache.shape[1])
        keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        # GQA goes in xformers' 5-D [batch, seq, kv_group, heads_per_group, dim] layout.
        shape = (1, slots.shape[0], num_kv_heads, group, head_dim)
        mask = self._mask.from_seqlens(meta.query_lens_cpu, meta.seq_lens_cpu, device=q.device)
        out = self._attend(
            q.view(1, num_tokens, num_kv_heads, group, head_dim),
            keys[None, :, :, None].expand(shape),
            values[None, :, :, None].expand(shape),
            attn_bias=mask,
            scale=scale,
        )
        return out.reshape(num_tokens, num_heads, head_dim)
