"""Which device and dtype "auto" means here."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """The device to serve on; "cuda" becomes "cuda:N" (the current card), so streams,
    graphs and memory queries all name the card the weights are on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 matmuls are ~2x faster than fp32 where the CPU has AMX tiles, and emulated
    # (much slower) where it has not.
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if amx else torch.float32
