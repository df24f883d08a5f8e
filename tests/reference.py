"""The independent reference: the default model's GGUF weights in transformers' Llama, and
its greedy continuation through generate()."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headroom.models.gguf_loader import load_gguf
from headroom.models.loader import default_model_path


def reference_model() -> LlamaForCausalLM:
    config, state = load_gguf(default_model_path())
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """generate() owns the KV cache: its keyword has changed name across transformers
    releases, and the project's range (transformers>=4.46) spans them."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()
