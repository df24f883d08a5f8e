"""The engine's command-line flags and the Config they build: --config FILE (TOML) first,
then each flag given overrides its field. `headroom serve`, `generate` and
`predictor calibrate` share them."""

from __future__ import annotations

import argparse
import logging
import tomllib
from typing import get_args

from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ConfigError,
    ModelConfig,
    ObservabilityConfig,
    PoolsConfig,
    SchedulerConfig,
    ServerConfig,
)

# flag dest -> (config section, field)
_FLAGS = {
    "model": ("model", "model"),
    "served_model_name": ("model", "served_model_name"),
    "dtype": ("model", "dtype"),
    "quantization": ("model", "quantization"),
    "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"),
    "enforce_eager": ("model", "enforce_eager"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "kv_cache_memory_gib": ("cache", "kv_cache_memory_gib"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "max_queue_len": ("server", "max_queue_len"),
    "drain_timeout": ("server", "drain_timeout_s"),
    "unknown_fields": ("server", "unknown_fields"),
    "request_metrics": ("server", "request_metrics"),
    "attention_backend": (None, "attention_backend"),
    "seed": (None, "seed"),
    "admission": ("admission", "enabled"),
    "log_format": ("observability", "log_format"),
    "log_prompts": ("observability", "log_prompts"),
}
_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
    "admission": AdmissionConfig,
    "pools": PoolsConfig,
    "observability": ObservabilityConfig,
    "admin": AdminConfig,
}


def config_field(dest: str) -> tuple[type, str]:
    """The config class and field a flag sets."""
    section, name = _FLAGS[dest]
    return (_SECTIONS[section] if section else Config), name


def choices(dest: str) -> list[str]:
    """A flag's choices: the Literal values its config field allows, so the two never differ."""
    cls, name = config_field(dest)
    return list(get_args(cls.__pydantic_fields__[name].annotation))


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (flags override --config)")
    tables = " ".join(f"[{name}]" for name in _SECTIONS)
    g.add_argument("--config", default=None, help=f"TOML file with any of the tables {tables} ([[admission.tenants]])")
    g.add_argument("--model", help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        help="the names clients may use in `model`, the first being its id (default: the file's name, "
        "with and without its quantisation suffix)",
    )
    g.add_argument("--dtype", choices=choices("dtype"))
    g.add_argument(
        "--quantization",
        choices=choices("quantization"),
        help="weight-only quantised linears on the CPU (auto: int4 for a float32 model on the CPU)",
    )
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--attention-backend", help="auto, torch, triton, flash_attn, xformers")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="on CUDA, run decode eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument("--block-size", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-cache-memory-gib", type=float)
    g.add_argument(
        "--kv-cache-dtype",
        choices=choices("kv_cache_dtype"),
        help="the KV cache's dtype (auto: float16 beside quantised CPU weights, else the model's)",
    )
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--seed", type=int)


log = logging.getLogger(__name__)

# Keys renamed, per section: the old name still loads, with a warning, until it is removed.
_RENAMED = {
    "admission": {
        # Both were max_wall_s: [admission]'s is a hard deadline, [admin]'s a policy's trigger.
        "max_wall_s": "deadline_s",
        # "In flight" is what admission holds; the estimate made as a sequence runs is the probe's.
        "inflight": "probe",
        "inflight_probe_path": "probe_path",
        "inflight_every": "probe_every",
    },
    "admin": {"max_wall_s": "max_age_s"},
}


def build_config(ns: argparse.Namespace) -> Config:
    tables: dict = {}
    if ns.config:
        with open(ns.config, "rb") as f:
            tables = tomllib.load(f)
    sections = {name: dict(tables.get(name, {})) for name in _SECTIONS}
    _rename(sections)
    top = {k: v for k, v in tables.items() if k not in _SECTIONS}
    for dest, (section, name) in _FLAGS.items():
        value = getattr(ns, dest, None)
        if value is not None:
            (sections[section] if section else top)[name] = value
    try:
        built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
        return Config(**built, **top)
    except TypeError as exc:  # an unknown key in the file
        raise ConfigError(f"config: {exc}") from None


def _rename(sections: dict[str, dict]) -> None:
    for section, names in _RENAMED.items():
        table = sections[section]
        for old, new in names.items():
            if old not in table:
                continue
            if new in table:
                raise ConfigError(f"config: [{section}] sets both {old} and {new}; {old} is the old name of {new}")
            log.warning("config: [%s] %s is deprecated; it is now %s", section, old, new)
            table[new] = table.pop(old)
