"""The engine's command-line flags and the Config they build: --config FILE (TOML) first,
then each flag given overrides its field. `headroom serve`, `generate` and
`predictor calibrate` share them."""

from __future__ import annotations

import argparse
import json
import logging
import tomllib
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

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
    SpeculativeConfig,
)

# flag dest -> (config section, field): --dest-with-dashes sets it, with the field's type,
# choices and description. In the order --help lists them; `serve` alone takes those of the
# sections only the HTTP server reads.
_FLAGS = {
    "model": ("model", "model"),
    "served_model_name": ("model", "served_model_name"),
    "dtype": ("model", "dtype"),
    "quantization": ("model", "quantization"),
    "device": ("model", "device"),
    "attention_dtype": ("model", "attention_dtype"),
    "max_model_len": ("model", "max_model_len"),
    "attention_backend": (None, "attention_backend"),
    "lora_modules": (None, "lora"),
    "max_lora_rank": ("model", "max_lora_rank"),
    "enforce_eager": ("model", "enforce_eager"),
    "tune_threads": ("model", "tune_threads"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "kv_cache_memory_gib": ("cache", "kv_cache_memory_gib"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_loras": ("scheduler", "max_loras"),
    "max_cpu_loras": ("scheduler", "max_cpu_loras"),
    "chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "seed": (None, "seed"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "max_queue_len": ("server", "max_queue_len"),
    "drain_timeout": ("server", "drain_timeout_s"),
    "unknown_fields": ("server", "unknown_fields"),
    "request_metrics": ("server", "request_metrics"),
    "admission": ("admission", "enabled"),
    "log_format": ("observability", "log_format"),
    "log_prompts": ("observability", "log_prompts"),
}
_SERVER_SECTIONS = ("server", "admission", "observability")
_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
    "admission": AdmissionConfig,
    "pools": PoolsConfig,
    "observability": ObservabilityConfig,
    "admin": AdminConfig,
    "speculative": SpeculativeConfig,
}


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


# A boolean field's flag is --x / --no-x, except these, which keep the form they always had;
# and --lora-modules takes vLLM's NAME=PATH words.
_FORMS = {
    "enforce_eager": {"action": "store_true"},
    "log_prompts": {"action": "store_true"},
    "admission": {"type": on_off, "metavar": "on|off"},
    "lora_modules": {"nargs": "+", "type": str, "metavar": "NAME=PATH"},
}


def config_field(dest: str) -> tuple[type, str]:
    """The config class and field a flag sets."""
    section, name = _FLAGS[dest]
    return (_SECTIONS[section] if section else Config), name


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (flags override --config)")
    tables = " ".join(f"[{name}]" for name in _SECTIONS)
    g.add_argument("--config", default=None, help=f"TOML file with any of the tables {tables} ([[admission.tenants]])")
    for dest, (section, _) in _FLAGS.items():
        if section not in _SERVER_SECTIONS:
            g.add_argument("--" + dest.replace("_", "-"), **_argument(dest))
    g.add_argument(
        "--speculative-config",
        type=json_table,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}, {"method": "suffix"} with its '
        'suffix_decoding_* keys, {"method": "draft_model", "model": PATH} or {"method": "off"} '
        "(overrides the [speculative] table; default: ngram)",
    )


def json_table(value: str) -> dict[str, Any]:
    try:
        table = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {exc}") from None
    if not isinstance(table, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return table


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve` alone: the HTTP server's, admission's and the logs'."""
    for dest, (section, _) in _FLAGS.items():
        if section in _SERVER_SECTIONS:
            parser.add_argument("--" + dest.replace("_", "-"), **_argument(dest))


def _argument(dest: str) -> dict[str, Any]:
    """add_argument's keywords for a flag, from its field: the type its value takes, the
    choices of a Literal, one or more values for a tuple, and the description as help. The
    default is None, so that only a flag given overrides --config."""
    cls, name = config_field(dest)
    info = cls.__pydantic_fields__[name]
    if not info.description:
        raise TypeError(f"--{dest} sets {cls.__name__}.{name}, which has no description for its help")
    kind = _value_type(info.annotation)
    kwargs: dict[str, Any] = {"default": None, "help": info.description}
    if dest in _FORMS:
        kwargs.update(_FORMS[dest])
    elif kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
    elif get_origin(kind) is tuple:
        kwargs.update(nargs="+", type=get_args(kind)[0])
    else:
        kwargs["type"] = kind
    return kwargs


def _value_type(annotation: Any) -> Any:
    """The type a field's value has when it is set: int for `Annotated[int, Field(ge=1)] | None`."""
    if get_origin(annotation) is Annotated:
        return _value_type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        (kind,) = (arg for arg in get_args(annotation) if arg is not type(None))
        return _value_type(kind)
    return annotation


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
    sections["speculative"].update(getattr(ns, "speculative_config", None) or {})
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
