"""The LoRA deltas of one projection for every adapter of a step, in Triton for the GPU
(Punica's SGMV shape, as headroom's C++ kernel runs it on the CPU, with the same call):
the rows of each group run under one slot's A and B, out[row] += x[row] @ A @ B.

Two launches a projection: the shrink (x @ A into a float32 scratch of rank width) and
the expand (scratch @ B added into out). A program takes BLOCK_M rows of one group, so a
slot's weights are read once per tile of its rows, and nothing is padded to the largest
group. The grid spans every group by the step's row count, and tiles past a group's end
return at once: the launch never reads the group sizes back from the device, which
would stall the host once per projection.

With TRITON_INTERPRET=1 (set before triton is imported) the same kernels run on the CPU
through Triton's interpreter, which is how CI checks them against the C++ kernel and torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headroom.kernels.attention.triton import INTERPRETED

BLOCK_M = 16  # rows of one group per program (tl.dot's smallest side)
BLOCK_K = 64  # input columns per step of the shrink's loop
BLOCK_N = 64  # output columns per expand program


@triton.jit
def _group_tile(rows_ptr, starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    # This program's tile of its group (program_id 0) rows (program_id 1): whether it holds
    # any, their places n in rows, which of them are in the group, their batch rows, the slot.
    group = tl.program_id(0)
    first = tl.load(starts_ptr + group) + tl.program_id(1) * BLOCK_M
    end = tl.load(starts_ptr + group + 1)
    n = first + tl.arange(0, BLOCK_M)
    n_ok = n < end
    row = tl.load(rows_ptr + n, mask=n_ok, other=0).to(tl.int64)
    return first < end, n, n_ok, row, tl.load(slots_ptr + group).to(tl.int64)


@triton.jit
def shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    rows_ptr,
    starts_ptr,
    slots_ptr,
    I,
    R,
    stride_x,
    stride_as,
    stride_ai,
    stride_t,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # One program per (group, BLOCK_M of its rows): t[n] = x[rows[n]] @ A[slot].
    busy, n, n_ok, row, slot = _group_tile(rows_ptr, starts_ptr, slots_ptr, BLOCK_M)
    if busy:
        a_slot = a_ptr + slot * stride_as
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < I
            x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_slot + k[:, None] * stride_ai + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if DOT_FP32:
                x, a = x.to(tl.float32), a.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(t_ptr + n[:, None] * stride_t + r[None, :], acc, mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def expand_kernel(
    t_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    starts_ptr,
    slots_ptr,
    R,
    O,
    stride_t,
    stride_bs,
    stride_br,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # One program per (group, BLOCK_M of its rows, BLOCK_N output columns):
    # out[rows[n], cols] += t[n] @ B[slot][:, cols]. A row is in one group only, so no two
    # programs write the same place.
    busy, n, n_ok, row, slot = _group_tile(rows_ptr, starts_ptr, slots_ptr, BLOCK_M)
    if busy:
        b_slot = b_ptr + slot * stride_bs
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        j = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < O
        t = tl.load(t_ptr + n[:, None] * stride_t + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_slot + r[:, None] * stride_br + j[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0.0)
        if DOT_FP32:
            b = b.to(tl.float32)
        else:
            t = t.to(b.dtype)  # the delta's second product in the weights' dtype, as torch's bmm
        if IEEE:
            y = tl.dot(t, b, input_precision="ieee")
        else:
            y = tl.dot(t, b)
        place = out_ptr + row[:, None] * stride_o + j[None, :]
        ok = n_ok[:, None] & j_ok[None, :]
        y += tl.load(place, mask=ok, other=0.0).to(tl.float32)
        tl.store(place, y.to(out_ptr.dtype.element_ty), mask=ok)


def lora_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    spans: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """out: (N, O), updated in place; x: (N, I); a: (S, I, R) and b: (S, R, O), each slot's
    A and B; spans: where each row of B may be non-zero (the C++ kernel skips the rest;
    here a tile's dot costs the same with zeros, so they are not read); rows: (K,) int64,
    the batch rows grouped by adapter; starts: (G + 1,) int64, where each group begins in
    rows; slots: (G,) int64, each group's slot. A row is in at most one group. The
    arguments of headroom's C++ lora_add_, for tensors on the GPU. Unlike the C++ kernel,
    this one does not check the indices (rows < N, in one group each, slots < S): reading
    them back would stall the host every projection, so the caller vouches for them, as
    LoraRegistry does by building them from the slots it placed."""
    if x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("out and x must be 2-D with contiguous rows")
    if a.dim() != 3 or b.dim() != 3 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a and b must be contiguous (S, I, R) and (S, R, O)")
    (n, i), (s, _, r), o = x.shape, a.shape, b.shape[2]
    if out.shape != (n, o) or a.shape[1] != i or b.shape[:2] != (s, r) or not (x.dtype == a.dtype == b.dtype):
        raise ValueError(
            f"shapes do not agree: out {tuple(out.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if starts.numel() != slots.numel() + 1:
        raise ValueError("starts must hold one more entry than slots")
    k, groups = rows.numel(), slots.numel()
    if k == 0 or groups == 0 or r == 0:
        return
    t = torch.empty(k, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(r))
    ieee = x.dtype == torch.float32
    dot_fp32 = INTERPRETED and x.dtype != torch.float32  # the interpreter's bf16/fp16 dots are wrong
    tiles = triton.cdiv(k, BLOCK_M)
    shrink_kernel[(groups, tiles)](
        x, a, t, rows, starts, slots, i, r, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=block_r, IEEE=ieee, DOT_FP32=dot_fp32,
    )  # fmt: skip
    expand_kernel[(groups, tiles, triton.cdiv(o, BLOCK_N))](
        t, b, out, rows, starts, slots, r, o, t.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, IEEE=ieee, DOT_FP32=dot_fp32,
    )  # fmt: skip
