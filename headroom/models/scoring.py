"""Logits for every position of one token sequence, in a single prefill through the
paged model with the torch reference attention: what perplexity is measured on."""

from __future__ import annotations

import torch

from headroom.models.llama import ForwardContext
from headroom.runtime.attention.metadata import AttentionMetadata
from headroom.runtime.attention.torch_ref import TorchAttention

BLOCK = 16


@torch.inference_mode()
def sequence_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row i predicts token i + 1."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    args = model.args
    shape = (blocks, BLOCK, args.num_kv_heads, args.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(args.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=n, max_seq_len=n,
        num_decodes=0, query_lens_cpu=[n], seq_lens_cpu=[n])
    hidden = model(torch.tensor(ids), torch.arange(n), ForwardContext(meta, caches, TorchAttention()))
    return model.compute_logits(hidden)
