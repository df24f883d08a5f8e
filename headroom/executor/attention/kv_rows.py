"""The KV cache's rows: a cache holds each token's keys (or values) as one row a kv head.
A float cache's row is head_dim elements; an int8 cache's is head_dim values after their
float32 scale (max |x| / 127), as llama.cpp's q8_0 blocks: one scale a 64-dim row, 68
bytes where float16 takes 128. The C++ kernels read and write the same layout
(kernels/attention/paged_tile.h), with the same float32 operations, so a row written by
either on the CPU is the same bytes (rows holding a NaN aside: the model has failed there)."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the scale's float32


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements a kv head's row takes in a cache of dtype."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))


def to_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., head_dim), rounded into rows of a cache of dtype."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    # A zero row, or one past float's range (its values saturate at +-127).
    scale = torch.where((scale > 0) & scale.isfinite(), scale, torch.ones_like(scale))
    values = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat((scale.contiguous().view(torch.int8), values), dim=-1)


def from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache (..., row_width), widened to dtype (..., head_dim)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., :SCALE_BYTES].contiguous().view(torch.float32)
    return (rows[..., SCALE_BYTES:].float() * scale).to(dtype)
