"""Which device and dtype "auto" means here."""

from __future__ import annotations

import torch

from headroom.models.quant import time_linears


def resolve_device(name: str) -> torch.device:
    """The device to serve on; "cuda" becomes "cuda:N" (the current card), so streams,
    graphs and memory queries all name the card the weights are on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_quantization(name: str, device: torch.device, dtype: torch.dtype, hidden_size: int,
                         intermediate_size: int) -> tuple[str, str]:
    """The weight-only quantisation to serve with, and why (for the log and /health)."""
    if name != "auto":
        return name, "chosen by flag or config"
    if device.type != "cpu":
        return "none", f"auto: no quantised kernels used on {device.type}"
    if dtype != torch.float32:
        return "none", f"auto: the CPU's {str(dtype).removeprefix('torch.')} path is used unquantised"
    # One stream reads every weight once a token, so fewer weight bytes should win; but
    # PyTorch's packed int4/int8 kernels are fast only on some CPUs, so time them here.
    times = time_linears(hidden_size, intermediate_size)
    best = min(times, key=times.__getitem__)
    said = ", ".join(f"{mode} {1000 * t:.2f} ms" for mode, t in times.items())
    return best, f"auto: fastest on this CPU for a {hidden_size}x{intermediate_size} linear at batch 1+16 ({said})"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 matmuls are ~2x faster than fp32 where the CPU has AMX tiles, and emulated
    # (much slower) where it has not.
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if amx else torch.float32
