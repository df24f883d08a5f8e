"""Read a llama.cpp GGUF file into an HF-style config dict and HF-named float32 tensors."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize

# GGUF "general.architecture" -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (config.json-style dict, state dict in HF naming with float32 tensors)."""
    config, makers = read_gguf(path)
    return config, {name: make() for name, make in makers.items()}


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
    """(config.json-style dict, for each HF-named tensor a function that dequantises it to
    float32): the file is mapped, not read, so a model can be built a tensor at a time."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFReader(path)
    config = _config(reader)
    # llama.cpp's converter reorders the rows of q/k (weights and biases) of llama-arch
    # models so that each head's rotary pairs are adjacent (interleaved RoPE); we use
    # HF's rotate-half RoPE, so those rows must go back. Qwen2 is stored unpermuted.
    permuted = config["model_type"] == "llama"
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        rope_heads = None
        if permuted and ".q_proj." in name:
            rope_heads = config["num_attention_heads"]
        elif permuted and ".k_proj." in name:
            rope_heads = config["num_key_value_heads"]
        makers[name] = functools.partial(_tensor, tensor, rope_heads)
        if name == "model.embed_tokens.weight" and "vocab_size" not in config:
            config["vocab_size"] = int(tensor.shape[-1])  # GGUF lists dimensions fastest-first
    if config["model_type"] == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in makers
    config["tie_word_embeddings"] = "lm_head.weight" not in makers
    return config, makers


def _tensor(tensor: Any, rope_heads: int | None) -> torch.Tensor:
    weights = _dequantize(tensor)
    if rope_heads is not None:
        weights = _unpermute_rope(weights, rope_heads)
    return torch.from_numpy(weights)


def _config(reader: GGUFReader) -> dict[str, Any]:
    fields = reader.fields
    arch = _value(fields, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    hf_arch, model_type = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return _value(fields, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or hidden // heads
    rotary_dim = get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rotary_dim}) are not supported")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 4096),
    }
    rope_scaling = _rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor"))
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with per-frequency RoPE factors (rope_freqs, e.g. Llama 3.1) are not supported")
    if "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    bos = _value(fields, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    # End-of-turn tokens (e.g. Llama 3's <|eot_id|>) stop generation just like eos does.
    eos = [_value(fields, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _value(fields: dict[str, ReaderField], key: str, default: Any = None) -> Any:
    """A scalar or string metadata value (arrays are not needed here)."""
    field = fields.get(key)
    if field is None:
        return default
    raw = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(raw).decode("utf-8")
    if field.types[0] == GGUFValueType.FLOAT32:
        # The shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06.
        return float(str(raw[0]))
    return raw[0].item()


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {name!r} in GGUF file")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _dequantize(tensor: Any) -> np.ndarray:
    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name!r} uses GGML type {tensor.tensor_type.name}, "
            "which this gguf package cannot dequantize"
        ) from None
    # GGUF lists dimensions fastest-first (ne order); torch wants them slowest-first.
    weights = weights.reshape(tuple(int(n) for n in reversed(tensor.shape)))
    weights = weights.astype(np.float32, copy=False)
    # F32 tensors come back as views of the read-only memory map.
    return weights if weights.flags.writeable else weights.copy()


def _unpermute_rope(weights: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores row (head, i, half) where HF has row (head, half, i).
    rows = weights.shape[0]
    grouped = weights.reshape(n_heads, rows // n_heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)
