"""The attention backend interface and the registry that picks one at start."""

from __future__ import annotations

import importlib
import logging
from typing import Protocol

import torch

from headroom.runtime.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str
    # Preferred KV block size; upstream flash-attn 2 pages must be a multiple of 256.
    block_size: int

    def forward(
        self,
        q: torch.Tensor,  # (N, Hq, D)
        k: torch.Tensor,  # (N, Hkv, D)
        v: torch.Tensor,  # (N, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (N, Hq, D)
        """Write k/v into the caches at meta.slot_mapping, then attend causally."""
        ...


# name -> "module:Class"; modules are imported only when chosen, so the CPU path never
# touches flash-attn or xformers.
_REGISTRY = {
    "torch": "headroom.runtime.attention.torch_ref:TorchAttention",
    "flash_attn": "headroom.runtime.attention.flash_attn:FlashAttention",
    "xformers": "headroom.runtime.attention.xformers:XFormersAttention",
}


def _load(name: str) -> type:
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def available_backends(device: torch.device) -> list[str]:
    """Backends usable here, best first; the torch reference is always last."""
    found = []
    if device.type == "cuda":
        for name in ("flash_attn", "xformers"):
            try:
                _load(name).check_available(device)
            except (ImportError, RuntimeError) as exc:
                log.info("attention backend %s unavailable: %s", name, exc)
            else:
                found.append(name)
    found.append("torch")
    return found


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = available_backends(device)[0]
    elif name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_REGISTRY)}")
    backend_cls = _load(name)
    backend_cls.check_available(device)
    log.info("attention backend: %s", name)
    return backend_cls()
