"""Read a Hugging Face checkpoint directory: config.json plus one or more .safetensors files."""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (config.json dict, state dict); tensors keep the dtype they are stored in."""
    config, makers = read_hf_dir(path)
    return config, {name: make() for name, make in makers.items()}


def read_hf_dir(path: str) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
    """(config.json dict, for each tensor a function that reads it from its shard): the
    shards are opened, not read, so a model can be built a tensor at a time."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)

    makers: dict[str, Callable[[], torch.Tensor]] = {}
    for shard in _shard_files(path):
        opened = safe_open(shard, framework="pt")
        makers.update((name, functools.partial(opened.get_tensor, name)) for name in opened.keys())  # noqa: SIM118
    return config, makers


def _shard_files(path: str) -> list[str]:
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [s for s in shards if not os.path.isfile(s)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that are missing: {missing}")
        return shards
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (PyTorch .bin checkpoints are not supported)")
    return shards
