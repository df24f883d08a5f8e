"""What runs the model for the engine: the weights on their device, the attention backend
that device takes, the KV pool's size and 16-bit or float layout, the model runner and its
CUDA graphs. Built once at start; the engine then only calls `runner.execute`."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from headroom.config import Config, ConfigError
from headroom.contracts.attention import AttentionBackend
from headroom.executor.attention import select_backend
from headroom.executor.cuda_graphs import graph_plan
from headroom.executor.device import prepare_model, resolve_attention_dtype, resolve_kv_dtype
from headroom.executor.model_runner import ModelRunner, kv_block_bytes
from headroom.kernels import cpu_kernels
from headroom.models.loader import LoadedModel
from headroom.models.lora import LoraError, LoraRegistry


@dataclass
class Executor:
    loaded: LoadedModel
    quantization_reason: str
    device: torch.device
    dtype: torch.dtype
    backend: AttentionBackend
    block_size: int
    kv_dtype: torch.dtype
    kv_dtype_reason: str
    num_blocks: int
    max_model_len: int
    runner: ModelRunner
    cuda_graphs: str  # what /health and the start line say about them
    loras: LoraRegistry
    attention_dtype: torch.dtype  # of the CPU prefill attention's dot products
    attention_dtype_reason: str

    @classmethod
    def build(cls, config: Config, loaded: LoadedModel | None = None) -> Executor:
        if loaded is None:
            loaded, quantization_reason = prepare_model(config.model)
        else:
            quantization_reason = "as the caller loaded it"
        weight = loaded.model.embed_tokens.weight  # the model's device and dtype decide the engine's
        device, dtype = weight.device, weight.dtype
        if device.type == "cuda":
            torch.cuda.set_device(device)  # cuda:N: kernels, streams and graphs on card N
        args = loaded.args
        backend = select_backend(config.attention_backend, device)
        block_size = config.cache.block_size or backend.block_size
        kv_dtype, kv_dtype_reason = resolve_kv_dtype(
            config.cache.kv_cache_dtype, device, dtype, loaded.quantization, backend.name
        )
        attention_dtype, dots, attention_dtype_reason = resolve_attention_dtype(
            config.model.attention_dtype, device, backend.name, dtype, kv_dtype, args
        )
        if dots:  # only cpu_paged has a form other than float32's
            backend.dots = dots
        num_blocks = config.cache.num_blocks or int(
            config.cache.kv_cache_memory_gib * 2**30 // kv_block_bytes(args, block_size, kv_dtype)
        )
        max_model_len = config.model.max_model_len or args.max_position_embeddings
        graph_sizes, cuda_graphs = graph_plan(config, device, backend)
        kernels, _ = cpu_kernels()
        loras = LoraRegistry(
            args,
            config.model.max_lora_rank,
            dtype,
            device,
            loaded.names,
            max_loras=config.scheduler.max_loras,
            max_cpu_loras=config.scheduler.max_cpu_loras,
            kernels=lora_kernels(device, dtype, kernels),
        )
        for name, path in config.lora:
            try:
                loras.load(name, path)
            except LoraError as exc:
                raise ConfigError(f"lora: {exc}") from None
        loras.warm()
        runner = ModelRunner(
            loaded.model,
            backend,
            num_blocks,
            block_size,
            device,
            kv_dtype,
            graph_sizes=graph_sizes,
            max_model_len=max_model_len,
            loras=loras,
        )
        cuda_graphs = runner.capture_graphs() or cuda_graphs
        return cls(
            loaded,
            quantization_reason,
            device,
            dtype,
            backend,
            block_size,
            kv_dtype,
            kv_dtype_reason,
            num_blocks,
            max_model_len,
            runner,
            cuda_graphs,
            loras,
            attention_dtype,
            attention_dtype_reason,
        )

    def describe(self) -> str:
        """The start line's account of what was chosen and why."""
        return (
            f"model={self.loaded.name} device={self.device} dtype={str(self.dtype).removeprefix('torch.')} "
            f"quantization={self.loaded.quantization} ({self.quantization_reason}) "
            f"kv_cache_dtype={str(self.kv_dtype).removeprefix('torch.')} ({self.kv_dtype_reason}) "
            f"backend={self.backend.name} attention_dtype={str(self.attention_dtype).removeprefix('torch.')} "
            f"block_size={self.block_size} kv_blocks={self.num_blocks} "
            f"({self.num_blocks * self.block_size} tokens) cuda_graphs={self.cuda_graphs}"
        )


def lora_kernels(device: torch.device, dtype: torch.dtype, cpu: ModuleType | None) -> ModuleType | None:
    """The kernel that runs a step's adapter groups in one call a projection: headroom's
    C++ one in float32 on the CPU, its Triton one on a GPU (triton is the GPU extra's, so
    imported only there); None leaves them to torch's matmuls."""
    if device.type == "cuda":
        try:
            from headroom.kernels import lora_triton
        except ImportError:
            return None
        return lora_triton
    return cpu if device.type == "cpu" and dtype == torch.float32 else None
