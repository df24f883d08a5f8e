"""Adapters made with peft itself on the default model's weights (nothing downloaded), and
the transformers + peft model that is their reference."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from tests.reference import reference_model

# name -> peft's LoraConfig keywords: ranks, targets and scalings that differ.
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "b_scale": 0.5, "target_modules": ["q_proj", "v_proj"]},
    "mlp-r16": {"r": 16, "lora_alpha": 32, "b_scale": 1.0, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "all-r4-rs": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}


def make_adapter(hf: LlamaForCausalLM, out_dir: str, seed: int, b_scale: float = 0.2, **kwargs) -> None:
    """A PEFT adapter with random, non-zero A and B (peft's own init leaves B zero, which
    would make it the base model), at a size that moves the outputs without drowning them."""
    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(out_dir)
    model.unload()  # hands the base modules back, for the next adapter


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    hf = reference_model()
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        dirs[name] = str(root / name)
        make_adapter(hf, dirs[name], seed, **kwargs)
    return dirs


def peft_model(adapter_dir: str) -> PeftModel:
    return PeftModel.from_pretrained(reference_model(), adapter_dir).eval()
