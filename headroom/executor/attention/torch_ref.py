"""The torch reference backend: runs anywhere, and is the oracle for every other one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.kv_rows import from_rows, to_rows


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    num_kv_heads, width = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, to_rows(k, k_cache.dtype))
    v_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, to_rows(v, v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached positions as (length, Hkv, D)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return gather_blocks(cache, block_table[:num_blocks]).flatten(0, 1)[:length]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for any shape of ids; index_select is several times faster on CPU."""
    flat = cache.index_select(0, block_ids.flatten().long())
    return flat.view(*block_ids.shape, *cache.shape[1:])


def decode_groups(seq_lens: list[int], slack: float = 1.5, min_len: int = 256) -> list[list[int]]:
    """Decode rows grouped by context length, so one long context does not pad every
    short one to its length (padding per group stays under `slack`x)."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and seq_lens[i] <= slack * max(seq_lens[groups[-1][0]], min_len):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class TorchAttention:
    name = "torch"
    block_size = 16
    cuda_graphs = False  # its forward loops over host-side lengths

    @staticmethod
    def check_available(device: torch.device) -> None:
        return None

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
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        starts = meta.query_start_loc.tolist() if nd < meta.num_seqs else []
        for i in range(nd, meta.num_seqs):
            lo, hi = starts[i], starts[i + 1]
            out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The first meta.num_decodes sequences, one query token each."""
        out = torch.empty_like(q)
        for rows in decode_groups(meta.seq_lens_cpu[: meta.num_decodes]):
            index = torch.tensor(rows, device=q.device)
            out[index] = self._decode(
                q[index],
                k_cache,
                v_cache,
                meta.block_tables[index],
                meta.seq_lens[index],
                max(meta.seq_lens_cpu[i] for i in rows),
                scale,
            )
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, tables, seq_lens, max_len: int, scale: float) -> torch.Tensor:
        # Decodes of similar length at once: pad each context to the longest, mask the tail.
        block_size = k_cache.shape[1]
        tables = tables[:, : -(-max_len // block_size)]
        keys = from_rows(gather_blocks(k_cache, tables).flatten(1, 2), q.dtype)  # (B, L, Hkv, D)
        values = from_rows(gather_blocks(v_cache, tables).flatten(1, 2), q.dtype)
        positions = torch.arange(keys.shape[1], device=q.device)
        mask = positions[None, :] < seq_lens[:, None]  # (B, L)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, Hq, 1, D)
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, k_cache, v_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
        q_len = q.shape[0]
        # A cache in another dtype than the queries (a 16-bit or int8 KV cache beside float32
        # activations) is widened to theirs.
        keys = from_rows(gather_kv(k_cache, block_table, seq_len), q.dtype).transpose(0, 1)  # (Hkv, L, D)
        values = from_rows(gather_kv(v_cache, block_table, seq_len), q.dtype).transpose(0, 1)
        if q_len == seq_len:
            mask, causal = None, True
        else:
            # Query j sits at position seq_len - q_len + j and sees keys up to there.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = (torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None])[None, None]
            causal = False
        # A leading batch dimension of 1: with 3-D inputs torch takes its unfused math path
        # on the CPU, 1.5x slower at 128 tokens and 6x at 2,048 than its flash kernel.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
