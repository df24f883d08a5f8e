"""Weight-only quantised linears for the CPU, on PyTorch's own packed-weight kernels.

int4: 4-bit weights in groups of 32 along the input dimension, each group with a scale
and a minimum (w = scale * q + min, q in 0..15), run by _weight_int4pack_mm_for_cpu.
That is llama.cpp's Q4_1 block: the default model's linears are stored that way, and
re-quantising the weights the loader dequantised from such blocks finds the same q,
scale and minimum again, so this path computes with the file's own weights.
int8: one symmetric scale per output row (absmax / 127), run by _weight_int8pack_mm;
used for the output head, which the file stores as Q8_0.
Activations, accumulation and everything outside the linears stay in the model dtype.
"""

from __future__ import annotations

import time

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(weight.dtype))
        self.bias = bias
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q as int32 (N, K), scale (N, K/32), minimum (N, K/32)) with w ~ scale * q + minimum."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15
    q = torch.round((groups - low[..., None]) / scale.clamp(min=1e-12)[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scale, low


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale, low = int4_groups(weight)
        self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel computes (q - 8) * scale + zero.
        zeros = low + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zeros.t()], dim=-1).contiguous())
        self.bias = bias
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.qweight, INT4_GROUP,
                                              self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def int4_fits(linear: nn.Linear) -> bool:
    return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0


def quantize_model(model: nn.Module, mode: str) -> None:
    """Swap the model's linears for quantised ones in place (fp32 activations on the CPU)."""
    if mode == "none":
        return
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            bias = None if child.bias is None else child.bias.detach()
            if mode == "int4" and name != "lm_head" and int4_fits(child):
                setattr(parent, name, Int4Linear(child.weight.detach(), bias))
            else:
                setattr(parent, name, Int8Linear(child.weight.detach(), bias))


def time_linears(in_features: int, out_features: int, batch_sizes: tuple[int, ...] = (1, 16),
                 repeats: int = 5) -> dict[str, float]:
    """Seconds per call of one linear of this shape in each mode, summed over batch sizes.
    PyTorch's packed kernels are fast only where the CPU has the instructions they were
    written for (on an AVX2-only core they lose to fp32 by 3-25x), so measure, never assume."""
    weight = torch.randn(out_features, in_features)
    dense = nn.Linear(in_features, out_features, bias=False)
    dense.weight.data = weight
    layers = {"none": dense, "int8": Int8Linear(weight, None), "int4": Int4Linear(weight, None)}
    times: dict[str, float] = {}
    with torch.inference_mode():
        for mode, layer in layers.items():
            total = 0.0
            for m in batch_sizes:
                x = torch.randn(m, in_features)
                layer(x)
                start = time.perf_counter()
                for _ in range(repeats):
                    layer(x)
                total += (time.perf_counter() - start) / repeats
            times[mode] = total
    return times
