"""LoRA adapters in one mixed batch give, token for token, what transformers + peft give
each prompt alone (float32, the unquantised reference path), on both CPU attention paths."""

from __future__ import annotations

import pytest

from headroom.config import Config
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine
from tests.lora.conftest import ADAPTERS, peft_model
from tests.reference import greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "List three fruits.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(adapter_dirs, prompts):
    """adapter -> its greedy tokens per prompt, from PeftModel and from merge_and_unload."""
    found = {}
    for name, path in adapter_dirs.items():
        model = peft_model(path)
        unmerged = [greedy(model, p, MAX_TOKENS) for p in prompts]
        merged = model.merge_and_unload()
        assert [greedy(merged, p, MAX_TOKENS) for p in prompts] == unmerged  # the two oracles agree
        found[name] = unmerged
    return found


@pytest.mark.parametrize("backend", ["cpu_paged", "torch"])
def test_mixed_batch_equals_peft(default_model, adapter_dirs, prompts, reference, backend):
    config = Config(attention_backend=backend, lora=[f"{n}={p}" for n, p in adapter_dirs.items()])
    engine = Engine(config, loaded=default_model)
    # Every adapter and the base side by side in one batch, adapters interleaved.
    rows = [(name, i) for i in range(len(prompts)) for name in [*ADAPTERS, None]]
    requests = engine.generate(
        [prompts[i] for _, i in rows],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        lora=[name for name, _ in rows],
    )
    base = {i: r.output_token_ids for (name, i), r in zip(rows, requests, strict=True) if name is None}
    for (name, i), request in zip(rows, requests, strict=True):
        if name is not None:
            assert request.output_token_ids == reference[name][i], (name, i)
            assert request.output_token_ids != base[i], f"{name} gave the base model's tokens on prompt {i}"
    assert engine.block_manager.num_used_blocks == 0
