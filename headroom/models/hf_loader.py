"""Read a Hugging Face checkpoint directory: config.json plus one or more .safetensors files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (config.json dict, state dict); tensors keep the dtype they are stored in."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)

    state: dict[str, torch.Tensor] = {}
    for shard in _shard_files(path):
        state.update(load_file(shard))
    return config, state


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
