"""Which device, dtype and weight path "auto" means here, and the model made ready for them."""

from __future__ import annotations

import functools

import torch

from headroom.config import ConfigError, ModelConfig
from headroom.kernels import cpu_flags, cpu_kernels
from headroom.models.loader import LoadedModel, load_model, open_model
from headroom.models.quant import measure_crossover, quantize_model

# Flags of CPUs that multiply bfloat16 natively (AVX512-BF16's dot products, AMX tiles);
# elsewhere bf16 matmuls are emulated and slower than float32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(name: str) -> torch.device:
    """The device to serve on; "cuda" becomes "cuda:N" (the current card), so streams,
    graphs and memory queries all name the card the weights are on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def large_batch_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype of the float matmuls that serve batches too large for packed weights, and
    what serves them: the tiled integer kernel instead where the CPU has AVX-512 VNNI (the
    float matmuls then serve only shapes it does not tile)."""
    kernels, _ = cpu_kernels()
    tiled = device.type == "cpu" and kernels is not None and kernels.qgemm_available()
    native = [flag for flag in BF16_FLAGS if flag in cpu_flags()] if device.type == "cpu" else []
    dtype, why = (
        (torch.bfloat16, f"bfloat16 matmuls ({native[0]})")
        if native
        else (torch.float32, "float32 matmuls (no native bf16 on this CPU)")
    )
    if tiled:
        return dtype, f"the tiled int8 kernel above it (AVX-512 VNNI; {why} for shapes it does not tile)"
    return dtype, f"{why} above it"


def resolve_quantization(
    name: str, device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int
) -> tuple[str, int, torch.dtype, str]:
    """(mode, largest batch served from packed weights, dtype of the matmuls above that
    batch, why) for the log and /health."""
    if name == "none":
        return "none", 0, dtype, "chosen by flag or config"
    if device.type != "cpu" or dtype != torch.float32:
        if name == "auto":
            return "none", 0, dtype, f"auto: quantised linears are for float32 on the CPU, not {dtype} on {device.type}"
        raise ConfigError(f"quantization {name} runs on the CPU with dtype float32 only")
    kernels, why = cpu_kernels()
    if kernels is None:
        if name == "auto":
            return "none", 0, dtype, f"auto: {why}"
        raise ConfigError(f"quantization {name} needs headroom's CPU kernels: {why}")
    large, large_why = large_batch_dtype(device)
    # The MLP's gate/up projection, the largest linear of a layer, stands for all of them.
    found = {
        mode: measure_crossover(hidden_size, 2 * intermediate_size, 4 if mode == "int4" else 8, large)
        for mode in (("int4", "int8") if name == "auto" else (name,))
    }
    said = "; ".join(
        f"{mode} {1e3 * c.packed_s[1]:.3f} ms vs float {1e3 * c.float_s[1]:.3f} ms at batch 1, "
        f"{c.relative_cost:.2f}x float's time over batches 1-64, packed up to batch {c.small_batch}"
        for mode, c in found.items()
    )
    said = f"{why}; {said}; {large_why}"
    if name != "auto":
        return name, max(1, found[name].small_batch), large, f"chosen by flag or config ({said})"
    useful = {mode: c for mode, c in found.items() if c.relative_cost < 1}
    if not useful:
        return "none", 0, dtype, f"auto: no packed kernel beats float32 here ({said})"
    best = min(useful, key=lambda mode: useful[mode].relative_cost)
    return (
        best,
        useful[best].small_batch,
        large,
        f"auto: fastest against the float matmuls over batch sizes 1-64 ({said})",
    )


def resolve_dtype(name: str, device: torch.device, quantization: str = "auto") -> torch.dtype:
    """bfloat16 on CUDA. On the CPU float32, which the packed weights' kernels take (and
    which quantization auto packs for wherever they build): even with AMX, int4 in float32
    ran well ahead of the bfloat16 model (bench/RESULTS.md). bfloat16 only
    where nothing can be packed (--quantization none, or no kernels) and the CPU has AMX
    tiles, whose bfloat16 matmuls are ~2x float32's (emulated, and much slower, elsewhere)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    # A named mode is packed or fails with its own reason (resolve_quantization).
    packed = quantization in ("int4", "int8") or (quantization == "auto" and cpu_kernels()[0] is not None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if amx and not packed else torch.float32


def resolve_kv_dtype(
    name: str, device: torch.device, dtype: torch.dtype, quantization: str, backend: str = "torch"
) -> tuple[torch.dtype, str]:
    """The KV cache's dtype and why, for the log and /health. Decode attention at large
    batches reads the whole cache every step, so 16 bits halve its bytes; auto takes them
    only where the weights are already quantised (a mode measured against float32 as a
    whole), so float32 with no quantisation stays exact. float16, as llama.cpp's cache:
    three more mantissa bits than bfloat16, the same speed in the kernel, and with int4
    weights 1.0027x float32 perplexity where bfloat16 gave 1.0062x (bench/quant_quality.py).
    int8 (a scale a row, executor/attention/kv_rows.py) is read by the CPU kernels, the torch
    reference and the Triton kernels; flash-attn and xformers take the model's dtype only.
    auto never takes it: it measured slower to score than float16 is to read here."""
    if name != "auto":
        chosen = getattr(torch, name)
        if chosen == torch.int8 and device.type == "cuda" and backend not in ("triton", "torch"):
            raise ConfigError(f"kv_cache_dtype int8 on cuda needs --attention-backend triton, not {backend}")
        if chosen != dtype and device.type != "cpu" and chosen != torch.int8:
            raise ConfigError(f"kv_cache_dtype {name} beside {dtype} weights runs on the CPU only")
        return chosen, "chosen by flag or config"
    if device.type == "cpu" and dtype == torch.float32 and quantization != "none":
        return torch.float16, f"auto: float16 beside {quantization} weights (half the bytes decode attention reads)"
    return dtype, "auto: the model's dtype"


def resolve_attention_dtype(
    name: str, device: torch.device, backend: str, dtype: torch.dtype, kv_dtype: torch.dtype, args
) -> tuple[torch.dtype, int, str]:
    """The dtype of the prefill attention's dot products, the CPU kernel's form of them
    (executor/attention/cpu_paged.py: DOTS; 0 where float32 or another backend's) and why,
    for the log and /health. Prefill attention is bound by its arithmetic, and bfloat16 runs
    faster than float32 where the CPU has AMX tiles, or pairs as fast as its FMAs; auto
    takes it only beside a 16-bit or int8 cache, whose keys and values are already rounded
    (the quantised default), so the float32 reference path stays exact, and only where a timing
    at start shows it clearly faster. Decode attention stays float32: it is bound by the
    cache's bytes, not by arithmetic."""
    from headroom.executor.attention.cpu_paged import DOTS, dots_faster

    if device.type != "cpu" or backend != "cpu_paged" or dtype != torch.float32:
        if name != "auto" and getattr(torch, name) != dtype:
            raise ConfigError(f"attention_dtype {name}: {backend} on {device.type} attends in the model's {dtype}")
        return dtype, 0, f"{name}: {backend} on {device.type} attends in the model's dtype"
    kernels, why = cpu_kernels()
    form = kernels.bf16_attention_form() if kernels else 0
    lacks = f"no AVX-512 BF16 or AMX in {why}"
    if form and not kernels.paged_prefill_available(args.head_dim):
        form, lacks = 0, f"the kernel's tiles take a head_dim that is a multiple of 64, not {args.head_dim}"
    if name == "float32":
        return torch.float32, 0, "chosen by flag or config"
    if name == "bfloat16":
        if not form:
            raise ConfigError(f"attention_dtype bfloat16 cannot run here: {lacks}")
        return torch.bfloat16, form, f"chosen by flag or config: {DOTS[form]}"
    if kv_dtype == torch.float32:
        return torch.float32, 0, "auto: float32 beside a float32 cache (the reference path stays exact)"
    if not form:
        return torch.float32, 0, f"auto: float32 ({lacks})"
    faster, timed = dots_faster(form, args.num_heads, args.num_kv_heads, args.head_dim, kv_dtype)
    if faster:
        return (
            torch.bfloat16,
            form,
            f"auto: bfloat16 in prefill attention beside a {str(kv_dtype).removeprefix('torch.')} cache ({timed})",
        )
    return torch.float32, 0, f"auto: float32 ({timed})"


def prepare_model(config: ModelConfig) -> tuple[LoadedModel, str]:
    """Load the model on the device and in the dtype config resolves to, pack its linears
    as resolve_quantization decides, and, in float32 on the CPU, hand its small ops to
    headroom's kernels. Returns it with the reason for its weight path."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.quantization)
    opened = open_model(config)
    args = opened.args
    quantization, small_batch, large_dtype, reason = resolve_quantization(
        config.quantization, device, dtype, args.hidden_size, args.intermediate_size
    )
    # Each layer is packed as it is read, so the model is never whole in float32.
    pack = functools.partial(quantize_model, mode=quantization, small_batch=small_batch, large_dtype=large_dtype)
    loaded = load_model(config, device, dtype, pack, opened)
    loaded.quantization = quantization
    kernels, _ = cpu_kernels()
    if device.type == "cpu" and dtype == torch.float32 and kernels is not None:
        loaded.model.use_cpu_kernels(kernels)
    return loaded, reason
