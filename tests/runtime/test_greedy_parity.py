"""Greedy output of the paged runtime equals a dense reference, token for token.

The reference is transformers' LlamaForCausalLM holding the same (dequantised) weights,
decoding each prompt alone with no paging, batching or chunking.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from headroom.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.models.gguf_loader import load_gguf
from headroom.models.loader import default_model_path, load_model, save_hf_checkpoint
from headroom.runtime.engine import Engine
from tests.reference import greedy, reference_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three fruits.",
    "Translate 'good morning' into Spanish, French and German, one per line.",
    (
        "Tell me a short story about a robot who learns to paint. Keep it under fifty words, "
        "give the robot a name, and end with a surprising twist about its favourite colour."
    ),
    "2+2=?",
]
LONG_SYSTEM = (
    "You are a meticulous assistant working for a travel agency. Always answer politely, "
    "mention the agency's name (Headroom Travel) once, keep answers short, avoid jargon, "
    "and never invent prices. If you do not know something, say so plainly."
)


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    plain = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    shared = [
        tok.apply_chat_template([{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS[:4]
    ]
    return plain, shared


@pytest.fixture(scope="module")
def reference(prompts):
    hf = reference_model()

    plain, shared = prompts
    return [greedy(hf, p, MAX_TOKENS) for p in plain], [greedy(hf, p, MAX_TOKENS) for p in shared]


def make_engine(loaded, **overrides) -> Engine:
    cache = CacheConfig(
        **{k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(CacheConfig)}}
    )
    sched = SchedulerConfig(
        **{k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(SchedulerConfig)}}
    )
    return Engine(Config(cache=cache, scheduler=sched), loaded=loaded)


def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    requests = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    return [r.output_token_ids for r in requests]


def test_reference_is_not_degenerate(reference):
    plain, _ = reference
    assert len({tuple(t) for t in plain}) == len(plain)
    assert all(len(t) >= 3 for t in plain)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 32, "max_num_seqs": 8}, id="chunked-prefill-32"),
        pytest.param({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, id="no-chunking"),
        pytest.param({"enable_prefix_caching": False, "block_size": 256}, id="block-256"),
    ],
)
def test_batched_greedy_equals_dense_reference(loaded, prompts, reference, overrides):
    engine = make_engine(loaded, **overrides)
    assert run(engine, prompts[0]) == reference[0]


def test_greedy_survives_preemption(loaded, prompts, reference):
    # 14 blocks of 16 tokens cannot hold 8 sequences of ~40-80 tokens: preemption must happen.
    engine = make_engine(loaded, num_blocks=14, block_size=16)
    assert run(engine, prompts[0]) == reference[0]
    assert engine.stats.preemptions > 0


def test_greedy_with_prefix_cache_hits(loaded, prompts, reference):
    engine = make_engine(loaded, block_size=16)
    _, shared = prompts
    first = run(engine, shared[:1])
    rest = engine.generate(shared[1:], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(r.num_cached_tokens >= 48 for r in rest)  # the long system prompt's blocks
    assert first + [r.output_token_ids for r in rest] == reference[1]


def test_hf_checkpoint_dir_gives_the_same_tokens(loaded, prompts, reference, tmp_path):
    config, state = load_gguf(default_model_path())
    save_hf_checkpoint(config, state, loaded.tokenizer, str(tmp_path / "smollm2-hf"))
    from_dir = load_model(ModelConfig(model=str(tmp_path / "smollm2-hf")), torch.device("cpu"), torch.float32)
    assert from_dir.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    ) == loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    engine = Engine(Config(), loaded=from_dir)
    assert run(engine, prompts[0]) == reference[0]


def test_served_float32_path_gives_the_same_tokens(prompts, reference):
    # `headroom serve --dtype float32 --quantization none`: the engine loads the model itself
    # and runs RMSNorm, the residual add, RoPE, SiLU * up and decode attention (with its
    # K/V write) through headroom's CPU kernels.
    engine = Engine(Config(model=ModelConfig(dtype="float32", quantization="none")))
    model = engine.loaded.model
    assert engine.executor.backend.name == "cpu_paged"
    assert model.norm.kernels is not None and model.layers[0].attn.kernels is not None
    assert run(engine, prompts[0]) == reference[0]
