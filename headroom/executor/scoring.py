"""Logits for every position of one token sequence, in a single prefill through the
paged model with the torch reference attention (or another backend), and perplexity over
chunks of a text scored the way llama.cpp's llama-perplexity does (the second half of each
chunk), of the base model or under one of its LoRA adapters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from headroom.contracts.attention import AttentionBackend, AttentionMetadata
from headroom.contracts.request import AdapterRef
from headroom.executor.attention.kv_rows import cache_shape
from headroom.executor.attention.torch_ref import TorchAttention
from headroom.models.llama import ForwardContext
from headroom.models.lora import LoraRegistry

BLOCK = 16


@torch.inference_mode()
def sequence_logits(
    model,
    ids: list[int],
    kv_dtype: torch.dtype = torch.float32,
    adapter: tuple[LoraRegistry, AdapterRef] | None = None,
    attention: AttentionBackend | None = None,
) -> torch.Tensor:
    """(len(ids), vocab): row i predicts token i + 1. The prompt's attention reads its keys
    and values back from a cache of kv_dtype, as a served prefill does, through `attention`
    (default: the torch reference). With an adapter (the registry that loaded it, its
    ref), every row runs under it."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    args = model.args
    shape = cache_shape(blocks, BLOCK, args.num_kv_heads, args.head_dim, kv_dtype)
    caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(args.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        num_decodes=0,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    lora = adapter[0].step([(adapter[1], n)]) if adapter is not None else None
    hidden = model(
        torch.tensor(ids), torch.arange(n), ForwardContext(meta, caches, attention or TorchAttention(), lora=lora)
    )
    return model.compute_logits(hidden)


def corpus(prompts_file: Path) -> str:
    """The longer prompts of a calibration file (JSON lines with a "prompt"), as one text."""
    rows = [json.loads(line)["prompt"] for line in prompts_file.open(encoding="utf-8")]
    return "\n\n".join(r for r in rows if len(r) > 200)


def chunked_perplexity(
    model,
    chunks: list[list[int]],
    kv_dtype: torch.dtype = torch.float32,
    adapter: tuple[LoraRegistry, AdapterRef] | None = None,
    attention: AttentionBackend | None = None,
) -> float:
    """exp(mean NLL) over the second half of each chunk: every scored token has at least
    half a chunk of context."""
    total, count = 0.0, 0
    for ids in chunks:
        first = len(ids) // 2
        logits = sequence_logits(model, ids, kv_dtype, adapter, attention)
        total += F.cross_entropy(logits[first:-1], torch.tensor(ids[first + 1 :]), reduction="sum").item()
        count += len(ids) - 1 - first
    return math.exp(total / count)
