"""The registry that picks an attention backend at start (the interface is
contracts/attention.py)."""

from __future__ import annotations

import importlib
import logging

import torch

from headroom.contracts.attention import AttentionBackend

log = logging.getLogger(__name__)


# name -> "module:Class"; modules are imported only when chosen, so the CPU path never
# touches flash-attn or xformers.
_REGISTRY = {
    "torch": "headroom.executor.attention.torch_ref:TorchAttention",
    "cpu_paged": "headroom.executor.attention.cpu_paged:CpuPagedAttention",
    "flash_attn": "headroom.executor.attention.flash_attn:FlashAttention",
    "triton": "headroom.executor.attention.triton_paged:TritonAttention",
    "xformers": "headroom.executor.attention.xformers:XFormersAttention",
}


def _load(name: str) -> type:
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


# On CUDA, best first: upstream flash-attn, then our Triton kernels, then xformers; on
# the CPU, our paged decode kernel where it built.
GPU_PREFERENCE = ("flash_attn", "triton", "xformers")
CPU_PREFERENCE = ("cpu_paged",)


def check_backends(device: torch.device) -> dict[str, str | None]:
    """Each backend this device could use, best first, with why it cannot (None: it can).
    The torch reference is always last and always usable."""
    found: dict[str, str | None] = {}
    if device.type in ("cuda", "cpu"):
        for name in GPU_PREFERENCE if device.type == "cuda" else CPU_PREFERENCE:
            try:
                _load(name).check_available(device)
            except (ImportError, RuntimeError) as exc:
                found[name] = f"{type(exc).__name__}: {exc}"
            else:
                found[name] = None
    found["torch"] = None
    return found


def available_backends(device: torch.device) -> list[str]:
    """Backends usable here, best first; the torch reference is always last."""
    return [name for name, why_not in check_backends(device).items() if why_not is None]


def choose_backend(name: str, device: torch.device) -> tuple[str, str]:
    """The backend to use and why, in words for the start-up log and /health."""
    if name != "auto":
        if name not in _REGISTRY:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_REGISTRY)}")
        return name, "chosen by --attention-backend"
    checked = check_backends(device)
    chosen = next(n for n, why_not in checked.items() if why_not is None)
    passed = [f"{n} unavailable ({why_not})" for n, why_not in checked.items() if why_not is not None]
    reason = f"auto on {device.type}: " + "; ".join([*passed, f"{chosen} is the best available"])
    return chosen, reason


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    name, reason = choose_backend(name, device)
    backend_cls = _load(name)
    backend_cls.check_available(device)
    backend = backend_cls()
    backend.reason = reason
    log.info("attention backend: %s (%s)", name, reason)
    return backend
