"""Our Triton paged-attention backend: one kernel for decode, one for prefill and chunked
prefill, both reading K/V straight from the paged cache through the block table.

GQA maps query head h to KV head h // (Hq // Hkv). Scores, softmax and the output are
accumulated in fp32 whatever the input dtype (the online softmax of FlashAttention: a
running max and sum per query row, rescaled as each KV block arrives). A prefill chunk's
query rows sit at the end of their sequence, so row j of a chunk of q_len rows attends
to cached positions 0 .. seq_len - q_len + j.

On CUDA it is the fallback when flash-attn is not installed. With TRITON_INTERPRET=1
(set before triton is imported) the same kernels run on the CPU through Triton's
interpreter, which is how CI checks them against the torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from headroom.executor.attention.metadata import AttentionMetadata
from headroom.executor.attention.torch_ref import write_kv

# Triton's interpreter computes tl.dot on bf16/fp16 operands wrongly (it has no numpy
# type for them), so there the prefill kernel's matmul operands are upcast to fp32. Loads,
# masking, paging, GQA and the online softmax are the same code either way.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    block_tables,
    seq_lens,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)  # decode row == sequence index (decodes come first, one row each)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq_len = tl.load(seq_lens + seq)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)  # running max
    total = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)  # running sum of exp
    acc = tl.zeros([BLOCK_D], tl.float32)
    for b in range(tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables + seq * stride_bt + b).to(tl.int64)
        pos = b * BLOCK_SIZE + offs
        ok = pos < seq_len
        kv_off = block * stride_kb + offs[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache + kv_off, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale  # (BLOCK_SIZE,)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache + kv_off, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    first_seq,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)  # BLOCK_M query rows of this sequence
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = seq_len - q_len + rows  # each row's position in its sequence
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        offs = tl.arange(0, BLOCK_SIZE)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past this tile's last row are masked for every row in it: stop there.
        visible = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
        for b in range(tl.cdiv(visible, BLOCK_SIZE)):
            block = tl.load(block_tables + seq * stride_bt + b).to(tl.int64)
            k_pos = b * BLOCK_SIZE + offs
            k_ok = k_pos < seq_len
            kv_off = block * stride_kb + offs[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_cache + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale  # (BLOCK_M, BLOCK_SIZE), fp32
            causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            scores = tl.where(causal, scores, float("-inf"))
            # Every row sees position 0, so after the first block no row's max is -inf.
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_cache + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                v = v.to(tl.float32)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / total[:, None]
        o_off = (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


class TritonAttention:
    name = "triton"
    block_size = 16
    block_m = 16  # query rows per prefill program
    cuda_graphs = True  # its decode kernel reads only device tensors

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
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k_cache.shape[2]
        strides = (
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            out.stride(0),
            out.stride(1),
        )
        shape = {
            "GROUP": group,
            "BLOCK_SIZE": k_cache.shape[1],
            "HEAD_DIM": head_dim,
            "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        }
        if meta.num_decodes:
            _decode_kernel[(meta.num_decodes, num_heads)](
                q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, scale, *strides, **shape
            )
        num_prefills = meta.num_seqs - meta.num_decodes
        if num_prefills:
            longest = max(meta.query_lens_cpu[meta.num_decodes :])
            grid = (num_prefills, num_heads, triton.cdiv(longest, self.block_m))
            _prefill_kernel[grid](
                q,
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
                meta.num_decodes,
                *strides,
                **shape,
                BLOCK_M=self.block_m,
                IEEE=q.dtype == torch.float32 or INTERPRETED,
                DOT_FP32=INTERPRETED,
            )
        return out
