"""The attention interface: what one engine step tells the kernels about its flattened
batch, and what every backend (executor/attention/) does with it. The model calls it; the
executor chooses and runs the backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Describes B sequences whose new tokens are packed into one [N, ...] batch.

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; those are the
    last q_len positions of its context, whose total length (cached + new) is
    seq_lens[i]. Decodes come first: the first num_decodes sequences have q_len == 1.
    """

    slot_mapping: torch.Tensor  # (N,) int64: cache slot = block * block_size + offset
    query_start_loc: torch.Tensor  # (B+1,) int32, cumulative query lengths
    seq_start_loc: torch.Tensor  # (B+1,) int32, cumulative context lengths
    seq_lens: torch.Tensor  # (B,) int32, context length after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    # Host copies, so backends that loop on the CPU never sync with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    name: str
    # Preferred KV block size; upstream flash-attn 2 pages must be a multiple of 256.
    block_size: int
    # Whether a pure-decode forward reads only device tensors, so it can be captured in
    # a CUDA graph (backends that loop over meta's host-side lengths cannot).
    cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,  # (N, Hq, D)
        k: torch.Tensor,  # (N, Hkv, D)
        v: torch.Tensor,  # (N, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), or int8 rows of D + 4 (kv_rows.py)
        v_cache: torch.Tensor,  # the same shape
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (N, Hq, D)
        """Write k/v into the caches at meta.slot_mapping, then attend causally."""
        ...
