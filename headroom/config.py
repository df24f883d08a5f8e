"""One configuration object, built once at start and passed down; never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    # A GGUF file, a Hugging Face checkpoint directory, or None for the default model.
    model: str | None = None
    # The name clients use in the API; defaults to the file or directory name.
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # Caps the checkpoint's own context length (None: use the checkpoint's).
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ConfigError(f"max_model_len must be >= 16, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    # None: the attention backend's preferred block size (16 for torch, 256 for flash-attn).
    block_size: int | None = None
    # Size of the KV pool; num_gpu_blocks wins over kv_cache_memory_gib when both are set.
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size % 8):
            raise ConfigError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError("kv_cache_memory_gib must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Tokens one engine step may process across all sequences (decodes + prefill chunks).
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # Preemption victim order: "priority" (lowest priority, then newest) or "newest".
    preemption_order: str = "priority"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens must be >= max_num_seqs so every running decode "
                f"fits in one step ({self.max_num_batched_tokens} < {self.max_num_seqs})"
            )
        if self.preemption_order not in ("priority", "newest"):
            raise ConfigError(f"preemption_order must be 'priority' or 'newest', got {self.preemption_order!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 * 2**20
    # Requests allowed to wait beyond max_num_seqs before new ones get 429.
    max_queue_len: int = 256
    # On SIGTERM: how long running streams may take to finish before they are aborted.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # "auto" picks by what is installed and the device present; or torch/flash_attn/xformers.
    attention_backend: str = "auto"
    seed: int = 0
