"""The KV cache's dtype: what auto picks and why, a 16-bit cache beside float32 weights
through the C++ decode kernel and the torch reference alike, and its pool sized by its
own element size."""

from __future__ import annotations

import pytest
import torch

from headroom.config import CacheConfig, Config, ConfigError, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.executor.device import resolve_kv_dtype
from headroom.runtime.engine import Engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
TEXTS = ["The capital of France is", "Once upon a time", "def fib(n):", "My favourite colour is"]


@pytest.mark.parametrize(
    "name, device, dtype, quantization, want, why",
    [
        ("auto", CPU, torch.float32, "int4", torch.float16, "auto: float16 beside int4 weights"),
        ("auto", CPU, torch.float32, "int8", torch.float16, "auto: float16 beside int8 weights"),
        ("auto", CPU, torch.float32, "none", torch.float32, "auto: the model's dtype"),
        ("auto", CPU, torch.bfloat16, "none", torch.bfloat16, "auto: the model's dtype"),
        ("auto", CUDA, torch.bfloat16, "none", torch.bfloat16, "auto: the model's dtype"),
        ("float32", CPU, torch.float32, "int4", torch.float32, "chosen by flag or config"),
        ("bfloat16", CPU, torch.float32, "none", torch.bfloat16, "chosen by flag or config"),
    ],
)
def test_auto_takes_float16_only_beside_quantised_cpu_weights(name, device, dtype, quantization, want, why):
    got, reason = resolve_kv_dtype(name, device, dtype, quantization)
    assert got == want and reason.startswith(why)


def test_a_cache_dtype_unlike_the_weights_is_refused_off_the_cpu():
    with pytest.raises(ConfigError, match="kv_cache_dtype float32 beside torch.bfloat16 weights runs on the CPU only"):
        resolve_kv_dtype("float32", CUDA, torch.bfloat16, "none")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")


def generate(loaded, prompts, kv_dtype: str, backend: str) -> tuple[Engine, list[list[int]]]:
    engine = Engine(
        Config(
            cache=CacheConfig(num_blocks=64, block_size=8, kv_cache_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=4),
            attention_backend=backend,
        ),
        loaded=loaded,
    )
    done = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return engine, [r.output_token_ids for r in done]


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_decodes_alike_through_the_kernel_and_the_reference(default_model, kv_dtype):
    prompts = [default_model.tokenizer.encode(t) for t in TEXTS]
    kernel, tokens = generate(default_model, prompts, kv_dtype, "cpu_paged")
    assert kernel.executor.backend.name == "cpu_paged"
    want = getattr(torch, kv_dtype)
    assert all(k.dtype == want and v.dtype == want for k, v in kernel.runner.kv_caches)
    reference, expected = generate(default_model, prompts, kv_dtype, "torch")
    assert reference.executor.backend.name == "torch"
    assert tokens == expected
    for engine in (kernel, reference):
        assert engine.block_manager.num_free_blocks == 64  # every block back after the requests


def test_a_16_bit_pool_holds_twice_the_blocks_in_the_same_memory(default_model):
    blocks = {}
    for kv_dtype in ("float32", "float16"):
        engine = Engine(
            Config(cache=CacheConfig(kv_cache_memory_gib=0.01, block_size=16, kv_cache_dtype=kv_dtype)),
            loaded=default_model,
        )
        blocks[kv_dtype] = engine.block_manager.num_blocks
    args = default_model.args
    per_block_fp32 = 2 * args.num_layers * 16 * args.num_kv_heads * args.head_dim * 4
    assert blocks["float32"] == int(0.01 * 2**30 // per_block_fp32)
    assert blocks["float16"] == int(0.01 * 2**30 // (per_block_fp32 // 2))
