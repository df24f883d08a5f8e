"""The flash-attn 2 backend: one paged varlen kernel call for the whole mixed batch."""

from __future__ import annotations

import inspect

import torch

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.torch_ref import write_kv


class FlashAttention:
    name = "flash_attn"
    # flash-attn 2 rejects paged KV unless the page size is a multiple of 256.
    block_size = 256
    cuda_graphs = True  # its decode path reads only device tensors

    @staticmethod
    def check_available(device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"flash_attn needs a CUDA device, got {device}")
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise RuntimeError("flash_attn needs compute capability >= 8.0 (Ampere or newer)")
        from flash_attn import flash_attn_varlen_func

        # flash_attn_varlen_func only takes a block table from 2.5.7 on.
        if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise ImportError("flash_attn_varlen_func has no block_table; need flash-attn >= 2.5.7")

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

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
        if meta.num_decodes == meta.num_seqs:
            # The k/v are already in the cache, so cache_seqlens counts the new token.
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        # causal=True aligns the mask bottom-right (flash-attn >= 2.1), so a chunk's
        # queries see the whole cached prefix plus the new tokens before them.
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
