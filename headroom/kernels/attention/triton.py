"""Our Triton paged-attention kernels: decode (a kernel over parts of each context and one
that merges the parts) and prefill or chunked prefill, all reading K/V straight from the
paged cache through the block table (of the model's dtype, or int8 rows with a scale
each). executor/attention/triton_paged.py launches them.

GQA maps query head h to KV head h // (Hq // Hkv). Scores, softmax and the output are
accumulated in fp32 whatever the input dtype (the online softmax of FlashAttention: a
running max and sum per query row, rescaled as each tile of keys arrives). A prefill chunk's
query rows sit at the end of their sequence, so row j of a chunk of q_len rows attends
to cached positions 0 .. seq_len - q_len + j.

On CUDA it is the fallback when flash-attn is not installed. With TRITON_INTERPRET=1
(set before triton is imported) the same kernels run on the CPU through Triton's
interpreter, which is how CI checks them against the torch reference.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter computes tl.dot on bf16/fp16 operands wrongly (it has no numpy
# type for them), so there the kernels' matmul operands are upcast to fp32. Loads,
# masking, paging, GQA and the online softmax are the same code either way.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _online_softmax(q, k, v, visible, scale, m, total, acc, IEEE: tl.constexpr):
    # One tile of keys and values folded into each query row's running max, sum of exp and
    # unnormalised output (FlashAttention's online softmax); fp32 dots (ieee) for fp32 inputs.
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * scale, float("-inf"))  # (rows, keys), fp32
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, total * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _rows(cache, row, d, key_ok, d_ok, INT8: tl.constexpr):
    # The cache rows starting at `row` (keys, 1), dims d: an int8 row is its float32 scale
    # then one byte a dim (executor/attention/kv_rows.py), widened to float32.
    ok = key_ok[:, None] & d_ok[None, :]
    if INT8:
        values = tl.load(cache + row + 4 + d[None, :], mask=ok, other=0).to(tl.float32)
        scale = tl.load((cache + row).to(tl.pointer_type(tl.float32)), mask=key_ok[:, None], other=0.0)
        return values * scale
    else:
        return tl.load(cache + row + d[None, :], mask=ok, other=0.0)


@triton.jit
def decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    parts_ptr,
    block_tables,
    seq_lens,
    scale,
    max_parts,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    PART: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WHOLE: tl.constexpr,
    INT8: tl.constexpr,
):
    # One program per (sequence, KV head, PART keys): the GROUP query heads that share a KV
    # head read its keys once, and a long context is cut into parts that run side by side
    # (one program walking a whole context block by block left the card's memory mostly idle).
    # Each part leaves its unnormalised output, softmax max and sum (a row of BLOCK_D + 2 floats
    # in parts_ptr); merge_kernel combines them. WHOLE: max_seq_len fits one part, so the output is
    # stored here and no merge is launched.
    seq = tl.program_id(0)  # decode row == sequence index (decodes come first, one row each)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    start = part * PART
    if start < seq_len:
        g = tl.arange(0, BLOCK_G)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        offs = tl.arange(0, TILE)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max per query head
        total = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        end = tl.minimum(seq_len, start + PART)
        for t in range(start, end, TILE):
            pos = t + offs
            ok = pos < end
            block = tl.load(block_tables + seq * stride_bt + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            kv_off = block[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh
            k = _rows(k_cache, kv_off, d, ok, d_ok, INT8).to(q.dtype)
            v = _rows(v_cache, kv_off, d, ok, d_ok, INT8).to(q.dtype)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            # The first position of a part is always in it, so no row's max stays -inf.
            m, total, acc = _online_softmax(q, k, v, ok[None, :], scale, m, total, acc, IEEE)
        if WHOLE:
            o_off = seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
            out = acc / total[:, None]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            row = ((seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * max_parts + part) * (BLOCK_D + 2)
            tl.store(parts_ptr + row[:, None] + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
            tl.store(parts_ptr + row + BLOCK_D, m, mask=g_ok)
            tl.store(parts_ptr + row + BLOCK_D + 1, total, mask=g_ok)


@triton.jit
def merge_kernel(
    parts_ptr,
    out_ptr,
    seq_lens,
    max_parts,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PART: tl.constexpr,
):
    # One program per (sequence, query head): the parts' partial softmaxes rescaled to their
    # common max and summed, as FlashAttention merges blocks.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.cdiv(tl.load(seq_lens + seq), PART)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * max_parts * (BLOCK_D + 2)
    acc = tl.load(parts_ptr + row + d, mask=d_ok, other=0.0)
    m = tl.load(parts_ptr + row + BLOCK_D)
    total = tl.load(parts_ptr + row + BLOCK_D + 1)
    for p in range(1, parts):
        row += BLOCK_D + 2
        m_part = tl.load(parts_ptr + row + BLOCK_D)
        m_new = tl.maximum(m, m_part)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_part - m_new)
        acc = acc * alpha + tl.load(parts_ptr + row + d, mask=d_ok, other=0.0) * beta
        total = total * alpha + tl.load(parts_ptr + row + BLOCK_D + 1) * beta
        m = m_new
    out = acc / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def prefill_kernel(
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
    INT8: tl.constexpr,
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
            kv_off = block * stride_kb + offs[:, None] * stride_ks + kv_head * stride_kh
            k = _rows(k_cache, kv_off, d, k_ok, d_ok, INT8).to(q.dtype)
            v = _rows(v_cache, kv_off, d, k_ok, d_ok, INT8).to(q.dtype)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            # Every row sees position 0, so after the first block no row's max is -inf.
            m, total, acc = _online_softmax(q, k, v, causal, scale, m, total, acc, IEEE)
        out = acc / total[:, None]
        o_off = (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
