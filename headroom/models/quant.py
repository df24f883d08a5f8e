"""Weight-only quantised linears for the CPU, on headroom's own kernels (headroom/kernels).

int4: the decoder's linears as 4-bit groups of 32 along the input dimension with a scale
and a minimum each (w = scale * q + min, q in 0..15, scale and min float16): llama.cpp's
Q4_1 block. The default model's file stores its linears that way, and re-quantising the
weights the loader dequantised from such blocks finds the same q, scale and minimum
again, so this path computes with the file's own weights. The output head goes to int8.
int8: groups of 32 in one of two forms, whichever reproduces the weight more closely:
one scale each (w = scale * q, q in -127..127), Q8_0's block, which is how the default
model stores its (tied) embedding and output head; or a scale and a minimum each
(w = scale * q + min, q in 0..255), which holds every Q4_1 group exactly (q = 17 times
its 4-bit value). So on the default model int8 too computes with the file's own weights,
at twice int4's bytes but with a cheaper unpacking.

A decode step of one sequence reads every weight once, so fewer bytes win there; a
batch of many rows is compute-bound. Batches of at most `small_batch` rows (the
crossover measured at start) take the packed weights, through integer dot products of x
rounded to int8 per group (llama.cpp's Q8_1 activations) on a CPU with AVX2 or AVX-512
VNNI (qdot_linear), else as floats (q4_linear, q8_linear). Larger ones take, on a CPU with
AVX-512 VNNI, the same 8-bit integer arithmetic on a second copy of the weights laid out
in tiles of 16 rows, one byte each, or two 4-bit weights a byte for int4 (qgemm_linear;
the byte tiles took 1.4-1.6x less time than oneDNN's bfloat16 at 32-4096 rows on a 2-core
EPYC); elsewhere a float GEMM of the float weight the QuantLinear was built from (the same
tensor, not a copy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headroom.kernels import cpu_kernels

QUANTIZATIONS = ("none", "int8", "int4")
GROUP = 32
TILE = 16  # output rows per register in qgemm_linear
BATCH_SIZES = (1, 4, 16, 32, 64)


def asymmetric_groups(
    weight: torch.Tensor, levels: int, float16: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (N, K) in 0..levels as uint8, scale (N, K/32), minimum (N, K/32)) with
    w ~ scale * q + minimum: Q4_1's block for levels=15, its 8-bit twin for 255. With
    float16, scale and minimum are float16 values (as Q4_1 stores them), q found for those."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / levels
    if float16:  # a Q4_1 group's (high - low) / 15 is its float16 scale but for float32 rounding
        scale, low = scale.half().float(), low.half().float()
    q = torch.round((groups - low[..., None]) / scale.clamp(min=1e-12)[..., None]).clamp(0, levels)
    return q.view(n, k).to(torch.uint8), scale.contiguous(), low.contiguous()


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (N, K) in 0..15, scale (N, K/32), minimum (N, K/32)) with w ~ scale * q + minimum,
    scale and minimum float16 values held as float32."""
    return asymmetric_groups(weight, 15, float16=True)


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) in -127..127, scale (N, K/32)) with w ~ scale * q."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 127
    q = torch.round(groups / scale.clamp(min=1e-12)[..., None]).clamp(-127, 127)
    return q.view(n, k).to(torch.int8), scale.contiguous()


def pack_nibbles(q: torch.Tensor, chunk: int) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K/2) bytes: in each chunk of `chunk` weights, byte i
    holds weight i in its low nibble and weight chunk/2 + i in its high one."""
    n, k = q.shape
    halves = q.view(n, k // chunk, 2, chunk // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor, chunk: int) -> torch.Tensor:
    n, k = packed.shape[0], 2 * packed.shape[1]
    halves = packed.view(n, k // chunk, chunk // 2)
    return torch.cat([halves & 0x0F, halves >> 4], dim=-1).view(n, k)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Q4_1's order, for the float-activation kernel: chunks of one group of 32."""
    return pack_nibbles(q, GROUP)


def integer_tiles(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, ...]:
    """The layout of qgemm_linear: (N/16, K/32, 8, 16, 4) bytes, so that one 64-byte load
    holds 4 consecutive weights of 16 output rows; scales and minima as (N/16, K/32, 16).
    With bits 4 (q in 0..15), steps 4-7 of a group go into the high nibbles of steps 0-3:
    (N/16, K/32, 4, 16, 4), half the bytes for a decode step to read; and its scales and
    minima, which int4_groups makes float16 values, are stored as float16 (a decode step
    reads them beside the weights)."""
    n, k = q.shape
    tiles = q.view(n // TILE, TILE, k // GROUP, GROUP // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    dtype = torch.float32
    if bits == 4:
        assert all(torch.equal(v, v.half().float()) for v in (scale, low)), "int4 scales and minima must be float16"
        tiles = (tiles[:, :, :4] | (tiles[:, :, 4:] << 4)).contiguous()
        dtype = torch.float16
    by_tile = [t.view(n // TILE, TILE, k // GROUP).transpose(1, 2).to(dtype).contiguous() for t in (scale, low)]
    return tiles, *by_tile


class LargeBatchMatmul:
    """x @ W^T for batches too large for the packed weights, in `dtype`: the float32 weight
    as it is (the same tensor, not a copy), or one bfloat16 copy laid out once for oneDNN,
    where oneDNN would otherwise reorder the weight on every call (10-40% of a call at
    the batch sizes of a decode step, measured on a 2-core EPYC; results bit-identical)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.dtype = dtype
        self.weight = weight if weight.dtype == dtype else weight.to(dtype)
        # oneDNN's bf16 kernels need a CPU it has them for (AVX-512 or later); elsewhere F.linear.
        self.onednn = (
            dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


class QuantLinear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        small_batch: int,
        large_dtype: torch.dtype = torch.float32,
        tiled: bool = True,
    ):
        """Batches over small_batch: with tiled (and AVX-512 VNNI), the packed path's integer
        arithmetic laid out for many rows; otherwise a float matmul in large_dtype (bfloat16
        where the CPU multiplies it natively; the weight is copied once to it)."""
        super().__init__()
        kernels, why = cpu_kernels()
        if kernels is None:
            raise RuntimeError(f"quantised linears need headroom's CPU kernels: {why}")
        self.kernels, self.bits, self.small_batch = kernels, bits, small_batch
        # The integer-dot kernel (AVX2 or AVX-512 VNNI) where this build has it; it reads 64
        # weights at a time.
        self.qdot = kernels.qdot_available() and weight.shape[1] % 64 == 0
        self.out_features = weight.shape[0]
        self.bias = bias
        if bits == 4:
            q, scale, low = int4_groups(weight)
            # The integer-dot kernel unpacks 64 weights (two groups, in order) at a time.
            self.nibble_chunk = 2 * GROUP if self.qdot else GROUP
            self.qweight, self.scales, self.mins = pack_nibbles(q, self.nibble_chunk), scale, low
        else:
            symmetric, with_min = (*int8_groups(weight), None), asymmetric_groups(weight, 255)
            q, scale, low = min(
                (symmetric, with_min), key=lambda form: (rebuild(*form) - weight.float()).abs().max().item()
            )
            if self.qdot and low is None:  # scale * q == scale * (q + 128) - 128 * scale, exactly
                q, low = (q.to(torch.int16) + 128).to(torch.uint8), -128 * scale
            self.qweight, self.scales, self.mins = q, scale, low
        # Batches over small_batch: the same integer arithmetic on a second layout of the same
        # weights (int4 two a byte), where the kernel has it; otherwise the float matmul.
        self.tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.large: LargeBatchMatmul | None = None
        if tiled and self.qdot and kernels.qgemm_available() and self.out_features % TILE == 0:
            self.tiles = integer_tiles(q, scale, low, bits)
        else:
            self.large = LargeBatchMatmul(weight, large_dtype)

    def large_batch(self, flat: torch.Tensor) -> torch.Tensor:
        """The path for (M, K) batches over small_batch: tiled integer, else the float matmul."""
        if self.tiles is not None:
            return self.kernels.qgemm_linear(flat, *self.tiles)
        return self.large(flat).to(flat.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The model's activations are (tokens, features) already: no reshape and view back,
        # two ATen calls a linear that a small model's decode step pays ~250 times.
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.shape[0] > self.small_batch:
            y = self.large_batch(flat)
        elif self.qdot:
            y = self.kernels.qdot_linear(flat, self.qweight, self.scales, self.mins, self.bits)
        elif self.bits == 4:
            y = self.kernels.q4_linear(flat, self.qweight, self.scales, self.mins)
        else:
            y = self.kernels.q8_linear(flat, self.qweight, self.scales, self.mins)
        if self.bias is not None:
            y = y + self.bias
        return y if flat is x else y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        if self.bits == 8:
            return rebuild(self.qweight, self.scales, self.mins)
        return rebuild(unpack_nibbles(self.qweight, self.nibble_chunk), self.scales, self.mins)


def rebuild(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """The float weight that groups of q with their scale (and minimum) stand for."""
    w = q.float().view(*scale.shape, GROUP) * scale[..., None]
    return (w if low is None else w + low[..., None]).view(q.shape)


def packable(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP == 0


@dataclass(frozen=True)
class Crossover:
    """Seconds per call at each batch size of a float linear, the packed path, and the path
    a QuantLinear takes above small_batch (the tiled integer kernel, or the float one)."""

    float_s: dict[int, float]
    packed_s: dict[int, float]
    large_s: dict[int, float]

    @property
    def relative_cost(self) -> float:
        """Time against float's, the better quantised path at each batch size, averaged over
        the batch sizes: a lone stream and a full batch weigh alike."""
        return sum(min(self.large_s[m], self.packed_s[m]) / self.float_s[m] for m in BATCH_SIZES) / len(BATCH_SIZES)

    @property
    def small_batch(self) -> int:
        """The largest batch up to which the packed weights beat the large path (0: never)."""
        best = 0
        for m in BATCH_SIZES:
            if self.packed_s[m] >= self.large_s[m]:
                break
            best = m
        return best


def measure_crossover(
    in_features: int, out_features: int, bits: int, large_dtype: torch.dtype = torch.float32, repeats: int = 7
) -> Crossover:
    """Time linears of the model's shape at each batch size: float, packed, and the path
    above small_batch (tiled where the CPU has the integer kernel). The
    weights span more than a last-level cache, as a model's do, so that the float path
    pays for its bytes as it does when serving. Where the packed kernel wins depends on
    the CPU's vectors, caches and memory, so it is measured where it serves, never assumed."""
    copies = max(2, (48 * 2**20) // (large_dtype.itemsize * in_features * out_features))
    weights = [torch.randn(out_features, in_features) for _ in range(copies)]
    packed = [QuantLinear(w, None, bits, small_batch=max(BATCH_SIZES), large_dtype=large_dtype) for w in weights]
    matmuls = [LargeBatchMatmul(w, large_dtype) for w in weights]
    floats = [lambda x, matmul=matmul: matmul(x).float() for matmul in matmuls]
    larges = [layer.large_batch for layer in packed]  # the same layers, every batch on the large path
    float_s, packed_s, large_s = {}, {}, {}
    with torch.inference_mode():
        for m in BATCH_SIZES:
            x = torch.randn(m, in_features)
            for layers, into in ((floats, float_s), (packed, packed_s), (larges, large_s)):
                for layer in layers:
                    layer(x)
                best = float("inf")
                for _ in range(repeats):  # the fastest pass: the others met a noisy neighbour
                    start = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    best = min(best, time.perf_counter() - start)
                into[m] = best / copies
    return Crossover(float_s, packed_s, large_s)


def quantize_model(
    model: nn.Module, mode: str, small_batch: int, large_dtype: torch.dtype = torch.float32, tiled: bool = True
) -> None:
    """Swap the model's linears for packed ones in place: int4 for the decoder's linears
    and int8 for the output head in "int4" mode, int8 for all in "int8" mode. Batches over
    small_batch rows take the tiled integer kernel where tiled and the CPU has it, else
    multiply the float weights in large_dtype."""
    if mode == "none":
        return
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or not packable(child):
                continue
            bits = 4 if mode == "int4" and name != "lm_head" else 8
            setattr(parent, name, QuantLinear(child.weight, child.bias, bits, small_batch, large_dtype, tiled))
