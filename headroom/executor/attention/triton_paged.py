"""Our Triton paged-attention backend: launches the kernels of headroom/kernels/attention/triton.py
(decode over parts of each context, then a merge of the parts; prefill or chunked prefill)
on the paged cache through the block table.

On CUDA it is the fallback when flash-attn is not installed. With TRITON_INTERPRET=1
(set before triton is imported) the same kernels run on the CPU through Triton's
interpreter, which is how CI checks them against the torch reference.
"""

from __future__ import annotations

import os

import torch
import triton

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.torch_ref import write_kv
from headroom.kernels.attention.triton import INTERPRETED, decode_kernel, merge_kernel, prefill_kernel


class TritonAttention:
    name = "triton"
    block_size = 16
    block_m = 16  # query rows per prefill program
    decode_part = 256  # keys per decode program (a context of more runs in parts side by side)
    decode_tile = 64  # keys per decode loop step
    cuda_graphs = True  # its decode kernels read only device tensors (and max_seq_len, a bound there)

    @staticmethod
    def parts_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
        """Scratch for the decode parts, each row written before the merge reads it."""
        return torch.empty(rows, width, dtype=torch.float32, device=device)

    @staticmethod
    def check_available(device: torch.device) -> None:
        if device.type == "cuda":
            return
        if os.environ.get("TRITON_INTERPRET") == "1":
            return  # the interpreter runs the kernels on the CPU (slowly: for tests)
        raise RuntimeError("the Triton backend needs CUDA (or TRITON_INTERPRET=1 to run on the CPU)")

    def forward(
        self,
        q: torch.Tensor,  # (N, Hq, D)
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), or int8 rows (kv_rows.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_d = max(16, triton.next_power_of_2(head_dim))
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0))
        # tl.dot in fp32 when the inputs are fp32 (ieee: no tf32) or interpreted (see INTERPRETED).
        precision = {"IEEE": q.dtype == torch.float32 or INTERPRETED, "DOT_FP32": INTERPRETED}
        int8 = k_cache.dtype == torch.int8  # rows of a scale and a byte a dim (kv_rows.py)
        if meta.num_decodes:
            # Under a CUDA graph max_seq_len is the model's length, so the grid fits any step.
            max_parts = triton.cdiv(meta.max_seq_len, self.decode_part)
            whole = max_parts == 1
            rows = meta.num_decodes * num_heads * max_parts
            # A whole step's decode kernel stores straight to out and never touches parts.
            parts = out if whole else self.parts_buffer(rows, block_d + 2, q.device)
            decode_kernel[(meta.num_decodes, num_kv_heads, max_parts)](
                q,
                k_cache,
                v_cache,
                out,
                parts,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_parts,
                q.stride(0),
                q.stride(1),
                *cache_strides,
                out.stride(0),
                out.stride(1),
                GROUP=group,
                BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot's smallest tile
                BLOCK_SIZE=k_cache.shape[1],
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                TILE=self.decode_tile,
                PART=self.decode_part,
                WHOLE=whole,
                INT8=int8,
                **precision,
            )
            if not whole:
                merge_kernel[(meta.num_decodes, num_heads)](
                    parts,
                    out,
                    meta.seq_lens,
                    max_parts,
                    out.stride(0),
                    out.stride(1),
                    HEAD_DIM=head_dim,
                    BLOCK_D=block_d,
                    PART=self.decode_part,
                )
        num_prefills = meta.num_seqs - meta.num_decodes
        if num_prefills:
            longest = max(meta.query_lens_cpu[meta.num_decodes :])
            grid = (num_prefills, num_heads, triton.cdiv(longest, self.block_m))
            prefill_kernel[grid](
                q,
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
                meta.num_decodes,
                q.stride(0),
                q.stride(1),
                *cache_strides,
                out.stride(0),
                out.stride(1),
                GROUP=group,
                BLOCK_SIZE=k_cache.shape[1],
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_M=self.block_m,
                INT8=int8,
                **precision,
            )
        return out
