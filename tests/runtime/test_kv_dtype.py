"""The KV cache's dtype: what auto picks and why, a 16-bit or int8 cache beside float32 weights
through the C++ decode kernel and the torch reference alike, and its pool sized by its
own element size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from headroom.config import CacheConfig, Config, ConfigError, ModelConfig, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.executor.device import resolve_attention_dtype, resolve_kv_dtype
from headroom.kernels import cpu_kernels
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
        ("int8", CPU, torch.float32, "int4", torch.int8, "chosen by flag or config"),
    ],
)
def test_auto_takes_float16_only_beside_quantised_cpu_weights(name, device, dtype, quantization, want, why):
    got, reason = resolve_kv_dtype(name, device, dtype, quantization)
    assert got == want and reason.startswith(why)


def test_a_cache_dtype_unlike_the_weights_is_refused_off_the_cpu():
    with pytest.raises(ConfigError, match="kv_cache_dtype float32 beside torch.bfloat16 weights runs on the CPU only"):
        resolve_kv_dtype("float32", CUDA, torch.bfloat16, "none")
    # int8 rows off the CPU: the Triton kernels read them, flash-attn and xformers do not.
    assert resolve_kv_dtype("int8", CUDA, torch.bfloat16, "none", "triton") == (torch.int8, "chosen by flag or config")
    for backend in ("flash_attn", "xformers"):
        with pytest.raises(
            ConfigError, match=f"kv_cache_dtype int8 on cuda needs --attention-backend triton, not {backend}"
        ):
            resolve_kv_dtype("int8", CUDA, torch.bfloat16, "none", backend)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")


def generate(loaded, prompts, kv_dtype: str, backend: str) -> tuple[Engine, list[list[int]]]:
    # float32 dot products in both: the comparison is of the cache's dtype, not of the
    # bfloat16 arithmetic auto may take beside it (tests/models/test_quant.py bounds that).
    engine = Engine(
        Config(
            model=ModelConfig(attention_dtype="float32"),
            cache=CacheConfig(num_blocks=64, block_size=8, kv_cache_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=4),
            attention_backend=backend,
        ),
        loaded=loaded,
    )
    done = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return engine, [r.output_token_ids for r in done]


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_a_16_or_8_bit_cache_decodes_alike_through_the_kernel_and_the_reference(default_model, kv_dtype):
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


def test_an_int8_pool_holds_rows_of_a_scale_and_head_dim_values(default_model):
    engine = Engine(
        Config(cache=CacheConfig(kv_cache_memory_gib=0.01, block_size=16, kv_cache_dtype="int8")), loaded=default_model
    )
    args = default_model.args
    row = 4 + args.head_dim  # a float32 scale, then one byte a dim
    assert engine.block_manager.num_blocks == int(0.01 * 2**30 // (2 * args.num_layers * 16 * args.num_kv_heads * row))
    k, v = engine.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.int8 and k.shape[1:] == (16, args.num_kv_heads, row)


# The prefill attention's dot products (executor/device.py: resolve_attention_dtype).
def heads(head_dim: int = 64) -> SimpleNamespace:
    return SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=head_dim)


def test_auto_attention_is_float32_beside_a_float32_cache_and_the_models_dtype_elsewhere():
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_attention_dtype("auto", CPU, "cpu_paged", f32, f32, heads()) == (
        f32,
        0,
        "auto: float32 beside a float32 cache (the reference path stays exact)",
    )
    assert resolve_attention_dtype("auto", CUDA, "triton", bf16, bf16, heads()) == (
        bf16,
        0,
        "auto: triton on cuda attends in the model's dtype",
    )
    assert resolve_attention_dtype("float32", CPU, "torch", f32, torch.float16, heads())[:2] == (f32, 0)
    with pytest.raises(
        ConfigError, match="attention_dtype bfloat16: torch on cpu attends in the model's torch.float32"
    ):
        resolve_attention_dtype("bfloat16", CPU, "torch", f32, torch.float16, heads())
    with pytest.raises(ConfigError, match="attention_dtype float32: triton on cuda attends in the model's"):
        resolve_attention_dtype("float32", CUDA, "triton", bf16, bf16, heads())


def test_bfloat16_attention_where_the_kernel_has_it_and_a_clear_reason_where_not():
    kernels, _ = cpu_kernels()
    form = kernels.bf16_attention_form()
    f16 = torch.float16
    with pytest.raises(ConfigError, match="attention_dtype bfloat16 cannot run here: "):
        resolve_attention_dtype("bfloat16", CPU, "cpu_paged", torch.float32, f16, heads(80))
    dtype, dots, why = resolve_attention_dtype("auto", CPU, "cpu_paged", torch.float32, f16, heads(80))
    assert (dtype, dots) == (torch.float32, 0) and why.startswith("auto: float32 (")
    dtype, dots, why = resolve_attention_dtype("auto", CPU, "cpu_paged", torch.float32, f16, heads())
    if not form:
        assert (dtype, dots) == (torch.float32, 0) and "no AVX-512 BF16 or AMX" in why
        with pytest.raises(ConfigError, match="no AVX-512 BF16 or AMX"):
            resolve_attention_dtype("bfloat16", CPU, "cpu_paged", torch.float32, f16, heads())
        return
    # Timed once a process, so that every engine in it computes alike.
    assert resolve_attention_dtype("auto", CPU, "cpu_paged", torch.float32, f16, heads()) == (dtype, dots, why)
    assert "a 256-token chunk's attention" in why and (dots == form) == (dtype == torch.bfloat16)
    assert resolve_attention_dtype("bfloat16", CPU, "cpu_paged", torch.float32, f16, heads())[:2] == (
        torch.bfloat16,
        form,
    )
