"""A random-weight model of a real shape, for measuring what a step costs at 1-2B parameters.

Writes, under --out (never into the project):
- `<name>.Q4_1.gguf`: the linears in Q4_1 and the embedding in Q8_0, as the default model's GGUF
  is written, with the default model's tokenizer; headroom and llama-server read this file.
- `hf/`: the same weights as a bfloat16 Hugging Face folder (the GGUF's tensors dequantised,
  q/k rows back in HF order), with config.json and the tokenizer; vLLM reads this folder.

The weights are N(0, 0.02) from --seed, norms 1: the text they write is noise, but every server
does the same work a token as with a trained model of that shape (the loads use ignore_eos).

    python bench/random_model.py                 # SmolLM2-1.7B's shape, ~1.1 GB GGUF + 3.4 GB folder
    headroom serve --model ~/.cache/headroom-bench/smollm2-1.7b-random/smollm2-1.7b-random.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from transformers import AutoTokenizer

from headroom.models.loader import default_model_path

# Hugging Face config.json shapes of real models that use the default model's tokenizer.
SHAPES = {
    "smollm2-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rope_theta": 130000.0,
        "max_position_embeddings": 8192,
    },
    "smollm2-360m": {
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    },
}
VOCAB = 49152
STD = 0.02


def hf_config(shape: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def permute_rope(weights: np.ndarray, heads: int) -> np.ndarray:
    """HF's row order (head, half, i) to llama.cpp's (head, i, half), as its converter writes q/k."""
    rows = weights.shape[0]
    grouped = weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)


def linears(config: dict) -> list[tuple[str, str, tuple[int, int], int]]:
    """(GGUF name, HF name, HF shape (out, in), heads for the RoPE row order or 0) of every linear."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = []
    for i in range(config["num_hidden_layers"]):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        out += [
            (g + "attn_q.weight", h + "self_attn.q_proj.weight", (heads * head_dim, hidden), heads),
            (g + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), kv_heads),
            (g + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), 0),
            (g + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * head_dim), 0),
            (g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (inter, hidden), 0),
            (g + "ffn_up.weight", h + "mlp.up_proj.weight", (inter, hidden), 0),
            (g + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, inter), 0),
        ]
    return out


def write_gguf(path: Path, name: str, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Write the GGUF; return the HF state dict of exactly the weights it holds, in bfloat16."""
    rng = np.random.default_rng(seed)
    source = GGUFReader(default_model_path())
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(3)  # MOSTLY_Q4_1, as the default model's file says
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)

    state: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, weights: np.ndarray, kind: GGMLQuantizationType, heads: int = 0) -> None:
        stored = permute_rope(weights, heads) if heads else weights
        packed = quantize(stored, kind) if kind != GGMLQuantizationType.F32 else stored
        writer.add_tensor(gguf_name, packed, raw_dtype=kind)
        held = dequantize(packed, kind).reshape(weights.shape) if kind != GGMLQuantizationType.F32 else weights
        if heads:  # back to HF's row order: the inverse of permute_rope
            grouped = held.reshape(heads, held.shape[0] // heads // 2, 2, *held.shape[1:])
            held = np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(held, dtype=np.float32)).to(torch.bfloat16)

    def normal(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * STD

    ones = np.ones(config["hidden_size"], dtype=np.float32)
    add(
        "token_embd.weight",
        "model.embed_tokens.weight",
        normal((VOCAB, config["hidden_size"])),
        GGMLQuantizationType.Q8_0,
    )
    add("output_norm.weight", "model.norm.weight", ones, GGMLQuantizationType.F32)
    for i in range(config["num_hidden_layers"]):
        add(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", ones, GGMLQuantizationType.F32)
        add(
            f"blk.{i}.ffn_norm.weight",
            f"model.layers.{i}.post_attention_layernorm.weight",
            ones,
            GGMLQuantizationType.F32,
        )
    for gguf_name, hf_name, shape, heads in linears(config):
        add(gguf_name, hf_name, normal(shape), GGMLQuantizationType.Q4_1, heads)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def write_hf(folder: Path, gguf_path: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(str(folder))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    p.add_argument("--out", default=None, help="folder (default ~/.cache/headroom-bench/<shape>-random)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    name = f"{ns.shape}-random"
    out = Path(ns.out or os.path.expanduser(f"~/.cache/headroom-bench/{name}"))
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(SHAPES[ns.shape])
    gguf_path = out / f"{name}.Q4_1.gguf"
    start = time.perf_counter()
    state = write_gguf(gguf_path, name, config, ns.seed)
    params = sum(t.numel() for t in state.values())
    print(
        f"{gguf_path}: {params / 1e9:.2f}B parameters, {gguf_path.stat().st_size / 1e9:.2f} GB, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    write_hf(out / "hf", gguf_path, config, state)
    print(f"{out / 'hf'}: bfloat16, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
