"""One configuration object, built once at start and passed down; never mutated."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

from headroom.contracts.repetition import RepetitionDetection

# A request's own `priority` lies in [-bound, bound] (vLLM's sign: lower is served first).
REQUEST_PRIORITY_BOUND = 1000


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


# A field's own rules are its type, checked by pydantic: Field constraints, Literal choices,
# and for what TOML and JSON give in another shape (lists for tuples, tables for pairs) a
# BeforeValidator that converts and checks it. __post_init__ keeps the rules that span fields.
# Strict: a TOML file's values are typed already, so "5" is refused rather than read as 5 (an
# int for a float is still taken).
STRICT = ConfigDict(strict=True, extra="forbid")

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvDtype = Literal["auto", "float32", "bfloat16", "float16", "int8"]
Quantization = Literal["auto", "none", "int8", "int4"]
Action = Literal["deprioritize", "cap", "abort"]
LoopPolicy = Literal["off", "flag", "cap", "stop"]
AtLeast1 = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(gt=0, le=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # positive and finite
ModelLen = Annotated[int, Field(ge=16)]

_KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "a string"}
_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
C = TypeVar("C")


def config_errors(where: str):
    """Turns a config class's ValidationError into one ConfigError in the project's words:
    "<where><field> must be >= 1, got 0". `where` is formatted with the `name` argument."""

    def wrap(cls: C) -> C:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                prefix = where.format(name=kwargs.get("name", args[0] if args else None))
                raise ConfigError("; ".join(_message(cls, e, prefix) for e in exc.errors())) from None

        cls.__init__ = __init__
        return cls

    return wrap


def _message(cls: Any, error: Any, prefix: str) -> str:
    raised = error.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):  # from a validator or __post_init__, already worded
        return str(raised)
    kind, loc = error["type"], list(error["loc"])
    if loc and isinstance(loc[0], int) and loc[0] < len(cls.__pydantic_fields__):  # a positional argument
        loc[0] = list(cls.__pydantic_fields__)[loc[0]]
    name = ".".join(map(str, loc))
    if kind == "unexpected_keyword_argument":
        return f"{cls.__name__}() got an unexpected keyword argument {name!r}"
    if kind in ("missing", "missing_argument"):
        return f"{cls.__name__}() missing required argument {name!r}"
    info = cls.__pydantic_fields__.get(loc[0]) if loc else None
    if info is not None and kind in _KINDS:  # the type, not the value: a secret may be in the wrong place
        return f"{prefix}{name} must be {_KINDS[kind]}, got {type(error['input']).__name__}"
    rule = _rule(info, error) if info is not None else None
    if rule is None:
        return f"{prefix}{name}: {error['msg']}"
    return f"{prefix}{name} must be {rule}, got {error['input']!r}"


def _rule(info: FieldInfo, error: Any) -> str | None:
    """What the field's value must be, for the kinds of error that have words of ours."""
    kind = error["type"]
    if kind == "literal_error":
        return f"one of {', '.join(map(str, _choices(info.annotation)))}"
    if kind in _BOUNDS:
        return _bounds(info)
    if kind == "multiple_of":
        return f"a multiple of {error['ctx']['multiple_of']}"
    if kind == "finite_number":
        return "a finite number"
    if kind == "string_too_short" and error["ctx"]["min_length"] == 1:
        return "a non-empty string"
    return None


def _bounds(info: FieldInfo) -> str:
    """What the field's bounds allow: ">= 1", or "in (0, 1]" for gt=0, le=1."""
    rules = _rules(info.annotation, list(info.metadata))
    bounds = {k: getattr(r, k) for r in rules for k in _SYMBOLS if getattr(r, k, None) is not None}
    if len(bounds) == 2:
        (low, lo), (high, hi) = sorted(bounds.items(), key=lambda kv: kv[0].startswith("l"))
        return f"in {'(' if low == 'gt' else '['}{lo}, {hi}{']' if high == 'le' else ')'}"
    return " ".join(f"{_SYMBOLS[k]} {v}" for k, v in bounds.items())


def _rules(annotation: Any, found: list) -> list:
    """The Field constraints of a type, also where it is `Annotated[...] | None`."""
    for arg in get_args(annotation):
        if isinstance(arg, FieldInfo):
            found.extend(arg.metadata)
        elif get_origin(annotation) is not Literal:
            _rules(arg, found)
    return found


def _choices(annotation: Any) -> tuple:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(c for arg in get_args(annotation) for c in _choices(arg))


def _served_names(names: Any) -> tuple[str, ...] | None:
    """One name or a list of them (TOML and the CLI give a list) as a tuple, each name once."""
    if names is None:
        return None
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"served_model_name must be a name or a list of names, got {names!r}")
    return tuple(dict.fromkeys(names))


def _graph_sizes(sizes: Any) -> tuple[int, ...]:
    """A list of batch sizes (TOML gives a list) as a sorted tuple, each size once."""
    if isinstance(sizes, (str, bytes)) or not all(type(s) is int and s > 0 for s in sizes):
        raise ConfigError(f"cuda_graph_sizes must be a list of positive integers, got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _lora_modules(items: Any) -> tuple[tuple[str, str], ...]:
    """[[lora]] tables ({name, path}) or the CLI's NAME=PATH words as (name, path) pairs,
    each name once."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, (list, tuple)):
        raise ConfigError(f"lora must be a list of {{name, path}} tables or NAME=PATH words, got {items!r}")
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        elif isinstance(item, Mapping) and set(item) == {"name", "path"}:
            name, path = item["name"], item["path"]
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            name, path = item
        else:
            raise ConfigError(f"lora: each adapter needs a name and a path (NAME=PATH), got {item!r}")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ConfigError(f"lora: an adapter's name and path must be non-empty strings, got {item!r}")
        pairs.append((name, path))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"lora: adapter names must differ, got {names}")
    return tuple(pairs)


CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@config_errors("model.")
@dataclass(frozen=True, config=STRICT)
class ModelConfig:
    model: str | None = Field(
        None, description="a GGUF file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    # As vLLM's --served-model-name. The name without its suffix: SmolLM2-135M-Instruct for
    # SmolLM2-135M-Instruct.Q4_1.
    served_model_name: Annotated[tuple[str, ...] | None, BeforeValidator(_served_names)] = Field(
        None,
        description="the names clients may use in `model`, the first being its id, the one /v1/models lists "
        "first (default: the file or directory name, with and without its GGUF quantisation suffix)",
    )
    # On the CPU the packed weights' kernels take float32 activations; bfloat16 matmuls
    # are ~2x faster than float32 only where the CPU has AMX tiles (executor/device.py:
    # resolve_dtype).
    dtype: Dtype = Field(
        "auto",
        description="the weights' dtype (auto: bfloat16 on CUDA; float32 on the CPU, or bfloat16 where the CPU "
        "has AMX tiles and no weights can be packed)",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N (auto: cuda where there is one)")
    # executor/device.py: resolve_attention_dtype says when auto takes bfloat16.
    attention_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the CPU prefill attention's dot products (auto: bfloat16 beside a 16-bit KV cache where the "
        "CPU has AMX or AVX-512 BF16 and a timing at start finds it clearly faster, else float32)",
    )
    # auto: see executor/device.py: resolve_quantization.
    quantization: Quantization = Field(
        "auto",
        description="weight-only quantised linears on the CPU: int4 (the GGUF's own Q4_1 groups), int8, none "
        "(the float reference), or auto (for a float32 model on the CPU, whichever kernel measures fastest)",
    )
    max_model_len: ModelLen | None = Field(
        None, description="caps the checkpoint's own context length (default: the checkpoint's)"
    )
    # On CUDA, decode steps replay CUDA graphs captured for these batch sizes (cut at
    # max_num_seqs, which is always captured); enforce_eager turns graphs off.
    enforce_eager: bool = Field(
        False, description="on CUDA, run decode eagerly instead of replaying captured CUDA graphs"
    )
    cuda_graph_sizes: Annotated[tuple[int, ...], BeforeValidator(_graph_sizes)] = CUDA_GRAPH_SIZES
    max_lora_rank: AtLeast1 = Field(
        64, description="the largest LoRA rank an adapter may have (vLLM's --max-lora-rank)"
    )
    # A neighbour on a shared VM can make two threads far slower than one (runtime/threads.py).
    tune_threads: bool = Field(
        True,
        description="on the CPU, now and then time a few steps at one thread fewer (or back at all of them) "
        "and keep the count whose steps cost less",
    )


@config_errors("cache.")
@dataclass(frozen=True, config=STRICT)
class CacheConfig:
    block_size: Annotated[int, Field(gt=0, multiple_of=8)] | None = Field(
        None,
        description="tokens per KV cache block, a multiple of 8 (default: the attention backend's, "
        "16 for torch, 256 for flash-attn)",
    )
    num_blocks: AtLeast1 | None = Field(
        None, description="the KV pool's size in blocks; wins over kv_cache_memory_gib when both are set"
    )
    kv_cache_memory_gib: Positive = Field(1.0, description="the KV pool's size in GiB, where num_blocks is not set")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of a prompt prefix already computed instead of computing it again"
    )
    # executor/device.py: resolve_kv_dtype says why float16 beside quantised weights.
    kv_cache_dtype: KvDtype = Field(
        "auto",
        description="the KV cache's dtype (auto: float16 beside quantised CPU weights, else the model's; "
        "int8: a scale a row; the CPU, or the Triton backend on CUDA)",
    )


@config_errors("scheduler.")
@dataclass(frozen=True, config=STRICT)
class SchedulerConfig:
    max_num_seqs: AtLeast1 = Field(64, description="the most sequences running at once")
    max_loras: AtLeast1 = Field(
        8, description="the most distinct LoRA adapters running at once, so in one step (SGLang's max-loras-per-batch)"
    )
    max_cpu_loras: AtLeast1 | None = Field(
        None,
        description="the most LoRA adapters whose weights stay in memory, least recently used out first; "
        "the others reload from their folder when a step needs them (vLLM's --max-cpu-loras; "
        "default: every adapter loaded), at least max_loras",
    )
    max_num_batched_tokens: int = Field(
        512,
        description="tokens one engine step may process across all sequences (decodes + prefill chunks), "
        "at least max_num_seqs",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="prefill a prompt in chunks that fit beside the running decodes in a step's token budget "
        "(off: a prompt is prefilled whole)",
    )
    # Preemption victim order: "priority" (lowest priority, then longest predicted
    # remaining, then newest) or "newest".
    preemption_order: Literal["priority", "newest"] = "priority"
    # Waiting order within a priority: predicted output tokens minus this many tokens for
    # every second waited (predicted-short-first with ageing; FCFS without predictions).
    ageing_tokens_per_s: NonNegative = 50.0
    # Head-of-line protection for the long lane (the long size class, set by admission).
    # While shorter requests are present, long prefill chunks are sized by the engine's
    # measured step cost to add at most a quarter of short_ttft_target_s to a step (or a
    # quarter of the step, where one step is slower than that); the head-of-line monitor
    # scales that down while the short class suffers, but never below a floor that grows
    # with the long request's wait and is whole at its deadline: long_ttft_target_s, or
    # sooner twice what its whole prefill is predicted to cost (runtime/lane.py:
    # long_wait_share). long_lane = false turns it all off.
    long_lane: bool = True
    # A long chunk may add a quarter of this to a step. 0.15 s keeps the short class's p99
    # TTFT near its p99 alone at a bounded cost to the long class's first token; 0.25 s
    # let chunks into the steps that start a short request, 0.1 s stretched long prefill
    # (bench/RESULTS.md, the seventh session: "one long chunk per short request").
    short_ttft_target_s: Seconds = 0.15
    long_ttft_target_s: Seconds = 10.0
    # With no shorter request running or waiting, and none arrived for this long, a long
    # chunk may add the whole short_ttft_target_s to a step (not a quarter of it), or what
    # half the token budget costs at its context where that is more: nobody is there to
    # protect, but the first to arrive waits for all of the step.
    long_lane_quiet_s: Seconds = 10.0
    # While shorter requests decode, long-class work (decode rows, then a prefill chunk)
    # may add at most this fraction of what the step costs without it (the shorter
    # requests' time per output token is an objective like their first token). Long
    # decodes take turns within it: each step runs at least one that sat out the step
    # before (the one that sat out longest), and none sits out more than
    # long_decode_max_skip steps in a row, so a long decode keeps at least 1 / (1 + that)
    # of its pace; a chunk takes what they leave (and no more than its prefill allowance),
    # plus what it saved sitting out as below, plus as much again as the whole budget
    # times the share of its deadline the long prompt has waited (at most once more).
    short_tpot_stretch: NonNegative = 0.5
    long_decode_max_skip: NonNegativeInt = 3
    # While shorter requests decode, a long prefill chunk that its step's allowance cannot
    # cover at MIN_LONG_CHUNK tokens sits the step out and carries the allowance over,
    # taking its chunk once the carried seconds cover it; never more than this many steps
    # in a row, so long prefill keeps MIN_LONG_CHUNK / (1 + that) tokens a step.
    long_prefill_max_skip: NonNegativeInt = 3
    # At most this many long-class sequences running (None: no cap), holding at most this
    # share of the KV blocks.
    long_max_running: AtLeast1 | None = None
    long_kv_share: Share = 0.6

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                "max_cpu_loras must be >= max_loras, so that a step's adapters are all in memory "
                f"({self.max_cpu_loras} < {self.max_loras})"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens must be >= max_num_seqs so every running decode "
                f"fits in one step ({self.max_num_batched_tokens} < {self.max_num_seqs})"
            )


@config_errors("speculative.")
@dataclass(frozen=True, config=STRICT)
class SpeculativeConfig:
    """vLLM's --speculative-config, in its JSON shape: {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}. On by
    default (n-gram), unlike vLLM: a row guesses only where the step-cost model says the
    guesses pay, so where they do not (many rows in a step) none are made."""

    method: Literal["off", "ngram", "suffix", "draft_model"] = Field(
        "ngram",
        description="how guesses are proposed: ngram (the request's own tokens: the words after the latest "
        "earlier occurrence of its last few), suffix (the most frequent continuation of its last tokens in "
        "its own text and in its tenant's recent outputs), draft_model (a smaller model, `model`, decoding "
        "them) or off; ngram by default",
    )
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)] = Field(
        4, description="the most tokens guessed for a sequence in one step"
    )
    prompt_lookup_max: AtLeast1 = Field(4, description="the longest suffix looked up (tokens)")
    prompt_lookup_min: AtLeast1 = Field(2, description="the shortest suffix looked up (tokens)")
    suffix_decoding_max_tree_depth: AtLeast1 = Field(
        24, description="suffix: the longest suffix of a sequence matched (tokens)"
    )
    suffix_decoding_max_cached_requests: NonNegativeInt = Field(
        1000,
        description="suffix: recent outputs kept to guess from, all tenants together (0: a request's own text only)",
    )
    suffix_decoding_max_spec_factor: Annotated[float, Field(gt=0)] = Field(
        1.0, description="suffix: a match of n tokens guesses at most n times this"
    )
    suffix_decoding_min_token_prob: Annotated[float, Field(ge=0, le=1)] = Field(
        0.1, description="suffix: a guess stops where its path's frequency falls below this"
    )
    model: str | None = Field(
        None, description="draft_model: the draft, a GGUF file or HF folder with the target's tokenizer"
    )

    def __post_init__(self) -> None:
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("model names the draft, and is given exactly when method is draft_model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min must be <= prompt_lookup_max ({self.prompt_lookup_min} > {self.prompt_lookup_max})"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@config_errors("server.")
@dataclass(frozen=True, config=STRICT)
class ServerConfig:
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: Annotated[int, Field(ge=0, le=65535)] = Field(8000, description="the port to listen on")
    max_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        2 * 2**20, description="the largest request body accepted, in bytes (a larger one gets 413)"
    )
    max_queue_len: NonNegativeInt = Field(
        256, description="requests allowed to wait beyond max_num_seqs before new ones get 429"
    )
    drain_timeout_s: NonNegative = Field(
        30.0, description="seconds running streams may take to finish after SIGTERM before they are aborted"
    )
    unknown_fields: Literal["reject", "accept"] = Field(
        "reject",
        description="a request field no schema knows (a typo such as max_token): 400 naming it (reject, as "
        "OpenAI) or ignored with a warning (accept, as vLLM, for clients that send another server's extras)",
    )
    request_metrics: bool = Field(
        False,
        description="a metrics object (waits, TTFT, engine seconds ...) on every final response; a tenant's "
        "own request_metrics, where set, decides for its requests",
    )


ACTIONS = get_args(Action)


def _ladder(steps: Any, where: str) -> tuple[str, ...]:
    steps = tuple(steps)  # TOML and JSON give a list
    if any(step not in ACTIONS for step in steps):
        raise ConfigError(f"{where}: every step must be one of {', '.join(ACTIONS)}, got {list(steps)}")
    return steps


DEFAULT_TIERS: tuple[tuple[str, int], ...] = (("premium", 2), ("standard", 1), ("batch", 0))


def _tenant(info: ValidationInfo) -> str:
    """How a tenant's errors begin: "tenant 'name'" (its name is validated first, if valid)."""
    return f"tenant {info.data['name']!r}" if "name" in info.data else "tenant"


def _api_keys(keys: Any, info: ValidationInfo) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise ConfigError(f"{_tenant(info)}: api_keys must be a list of strings, not one string")
    keys = tuple(keys)  # TOML gives a list
    if not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"{_tenant(info)}: every api key must be a non-empty string")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{_tenant(info)}: an api key is listed twice")
    return keys


def _priority_range(bounds: Any, info: ValidationInfo) -> tuple[int, int] | None:
    if bounds is None:
        return None
    if (
        not isinstance(bounds, (list, tuple))
        or len(bounds) != 2
        or not all(type(b) is int for b in bounds)
        or not -REQUEST_PRIORITY_BOUND <= bounds[0] <= bounds[1] <= REQUEST_PRIORITY_BOUND
    ):
        raise ConfigError(
            f"{_tenant(info)}: priority_range must be [low, high] integers with "
            f"-{REQUEST_PRIORITY_BOUND} <= low <= high <= {REQUEST_PRIORITY_BOUND}, got {bounds!r}"
        )
    return tuple(bounds)  # TOML gives a list


def _names(names: Any) -> tuple[str, ...] | None:
    """A list of names (TOML gives a list) as a tuple."""
    if names is None or isinstance(names, tuple):
        return names
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"loras must be a list of adapter names, got {names!r}")
    return tuple(names)


def _tenant_ladder(steps: Any, info: ValidationInfo) -> tuple[str, ...] | None:
    return None if steps is None else _ladder(steps, f"{_tenant(info)}: ladder")


@config_errors("tenant {name!r}: ")
@dataclass(frozen=True, config=STRICT)
class TenantConfig:
    name: Annotated[str, Field(min_length=1)]
    tier: str = "standard"
    api_keys: Annotated[tuple[str, ...], BeforeValidator(_api_keys)] = ()
    # Token bucket: sustained rate and burst, in (prompt + output) tokens.
    rate_tokens_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2000.0
    burst_tokens: AtLeast1 = 16000
    # Reserved tokens of admitted, unfinished requests; a bigger request can never run.
    # None: the engine's KV cache in tokens, all that could ever be in flight at once. A
    # lower default would queue requests in admission that the engine had room to run.
    max_in_flight_tokens: AtLeast1 | None = None
    max_queue: NonNegativeInt = 64
    max_wait_s: NonNegative = 30.0
    # Per-tenant caps on a request's max_tokens and total length (None: the server's).
    max_tokens: AtLeast1 | None = None
    max_model_len: ModelLen | None = None
    # The LoRA adapters its requests may name in `model` (None: any loaded one), and the one
    # a request that names no model runs under.
    loras: Annotated[tuple[str, ...] | None, BeforeValidator(_names)] = None
    default_lora: str | None = None
    # The request `priority` values it may send (None: any the API takes, [-1000, 1000]);
    # one outside is a 400, or with priority_clamp the nearest allowed. [0, 0] forbids them.
    priority_range: Annotated[tuple[int, int] | None, BeforeValidator(_priority_range)] = None
    priority_clamp: bool = False
    # Its own loop policy and remediation ladder (None: the server's, in [admin]).
    loop_policy: LoopPolicy | None = None
    ladder: Annotated[tuple[Action, ...] | None, BeforeValidator(_tenant_ladder)] = None
    # The `metrics` object on its responses (None: [server] request_metrics decides).
    request_metrics: bool | None = None

    def __post_init__(self) -> None:
        if self.default_lora is not None and self.loras is not None and self.default_lora not in self.loras:
            raise ConfigError(
                f"tenant {self.name!r}: default_lora {self.default_lora!r} is not among its loras {list(self.loras)}"
            )


def check_store_url(url: str, where: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{where} must be a redis://, rediss:// or unix:// URL, got one starting {url.split(':', 1)[0]!r}"
        )  # never echo a password


def _tiers(tiers: Any) -> tuple[tuple[str, int], ...]:
    """A TOML table of tier name -> priority, or (name, priority) pairs, as pairs."""
    tiers = tuple(tuple(pair) for pair in (tiers.items() if isinstance(tiers, Mapping) else tiers))
    if not all(len(pair) == 2 for pair in tiers):
        raise ConfigError(f"admission.tiers must be (name, priority) pairs, got {tiers!r}")
    names = [name for name, _ in tiers]
    if not names:
        raise ConfigError("admission.tiers must name at least one tier")
    if len(set(names)) != len(names):
        raise ConfigError(f"admission.tiers: a tier is named twice in {names}")
    for name, prio in tiers:
        if not isinstance(name, str) or not name or not isinstance(prio, int) or isinstance(prio, bool):
            raise ConfigError(f"admission.tiers: {name!r} = {prio!r} must map a name to an integer priority")
    return tiers


def _tenants(items: Any) -> tuple[TenantConfig, ...]:
    """A TOML list of tables (or TenantConfigs), at least one; no name or api key used twice."""
    tenants = tuple(_as_tenant(item) for item in items)
    if not tenants:
        raise ConfigError("admission.tenants must list at least one tenant")
    seen: set[str] = set()
    key_owner: dict[str, str] = {}
    for tenant in tenants:
        if tenant.name in seen:
            raise ConfigError(f"admission.tenants: tenant {tenant.name!r} is defined twice")
        seen.add(tenant.name)
        for key in tenant.api_keys:
            if key in key_owner:  # never echo the key itself
                raise ConfigError(f"tenant {tenant.name!r}: an api key is already used by tenant {key_owner[key]!r}")
            key_owner[key] = tenant.name
    return tenants


def _as_tenant(item: TenantConfig | Mapping) -> TenantConfig:
    if isinstance(item, TenantConfig):
        return item
    if isinstance(item, Mapping):
        return TenantConfig(**item)
    raise ConfigError(f"admission.tenants: each tenant must be a table, got {item!r}")


def _objectives(objectives: Any, info: ValidationInfo) -> tuple[tuple[str, str], ...]:
    """A TOML table of objective name -> tier, or pairs, as pairs; the tiers are validated first."""
    items = objectives.items() if isinstance(objectives, Mapping) else objectives
    objectives = tuple(tuple(pair) for pair in items)
    tiers = info.data.get("tiers")  # None where they were refused: their own error says so
    names = [name for name, _ in tiers or ()]
    for pair in objectives:
        if len(pair) != 2 or not isinstance(pair[0], str) or not pair[0] or (tiers and pair[1] not in names):
            raise ConfigError(
                f"admission.objectives: {pair!r} must map an objective's name to a tier ({', '.join(names)})"
            )
    return objectives


def _store(url: str | None) -> str | None:
    if url is not None:
        check_store_url(url, "admission.store")
    return url


def _fleet_size(size: int) -> int:
    if size < 1:  # by hand, to keep its wording: "an integer >= 1"
        raise ConfigError(f"admission.fleet_size must be an integer >= 1, got {size!r}")
    return size


@config_errors("admission.")
@dataclass(frozen=True, config=STRICT)
class AdmissionConfig:
    enabled: bool = Field(True, description="per-tenant admission control")
    # Tier name -> priority (higher is more important), as pairs so the config stays hashable.
    tiers: Annotated[tuple[tuple[str, int], ...], BeforeValidator(_tiers)] = DEFAULT_TIERS
    tenants: Annotated[tuple[TenantConfig, ...], BeforeValidator(_tenants)] = (TenantConfig("default"),)
    # Who a request without a (known) api key belongs to when auth is off.
    default_tenant: str = "default"
    auth: bool = False
    # With auth off: a request whose API key, X-Tenant or x-gateway-inference-fairness-id
    # names no configured tenant gets a tenant of its own, with the default tenant's limits
    # (at most MAX_AUTO_TENANTS; an API key is named by its hash). None: on when the
    # config names no tenants, so that with no config one user's requests never share a
    # queue and a fair share with another's.
    auto_tenants: bool | None = None
    # With auth off: the gateway's objective (x-gateway-inference-objective, the name of an
    # InferenceObjective) -> the tier its requests get instead of their tenant's. No header
    # carries the objective's priority: the gateway looks it up for its own queues.
    objectives: Annotated[tuple[tuple[str, str], ...], BeforeValidator(_objectives)] = ()
    # Admitted, unfinished requests across all tenants (None: decided from the engine's max_num_seqs).
    global_max_in_flight_seqs: AtLeast1 | None = None
    # A queued request that does not fit its tenant's limits yet is passed by later ones
    # that do (a short request never waits behind a long one) for this long; after that
    # nobody of its tenant passes it, so it cannot starve.
    backfill_max_wait_s: NonNegative = 10.0
    # None: the predictor shipped in the package (or the max_tokens fallback without one).
    predictor_path: str | None = None
    # Size classes: short when prompt and predicted output are both under the short
    # limits, long when either reaches the long limits, else medium.
    short_max_prompt_tokens: int = 512
    short_max_output_tokens: int = 256
    long_min_prompt_tokens: int = 1536
    long_min_output_tokens: int = 512
    # Wall-clock budget of one sequence from arrival (None: none); past it the sequence
    # finishes with finish_reason "length".
    deadline_s: Positive | None = None
    # Append one JSON record per finished request (features + actual tokens) here, for
    # retraining; the file is rotated to <path>.1 after record_log_max_lines lines.
    record_log_path: str | None = None
    record_log_max_lines: AtLeast1 = 100_000
    # Virtual token counter charge per prompt and per output token (fair sharing across tenants).
    prompt_weight: NonNegative = 1.0
    output_weight: NonNegative = 2.0
    # What a finished request is charged to its tenant's fair share: "device", its engine
    # seconds (in weighted tokens at the engine's own rate), or "tokens", its tokens alone.
    fair_share: Literal["device", "tokens"] = "device"
    # The length probe (runtime/probe.py): length estimates after prefill and every
    # probe_every generated tokens, from the served model's own hidden state. The
    # probe at probe_path, else the one shipped for the default model (none for
    # another model: then admission's prediction is all there is).
    probe: bool = True
    probe_path: str | None = None
    probe_every: AtLeast1 = 16
    # Run-to-cap probability at which a sequence is flagged a runaway (and, with a
    # max_tokens of long work, moved to the long lane).
    runaway_threshold: Share = 0.8
    # Where tenant budgets live: None keeps them in this process; "redis://host:port/db"
    # shares them with every replica pointed at the same Redis (the URL may also come
    # from HEADROOM_ADMISSION_STORE, so a password need not sit in a config file).
    store: Annotated[str | None, AfterValidator(_store)] = None
    # Replicas sharing the store: without Redis each falls back to 1/fleet_size of every budget.
    fleet_size: Annotated[int, AfterValidator(_fleet_size)] = 1
    # A replica's reservations in Redis expire this long after its last renewal (it
    # renews every third of it), so those of a replica that died come back this fast.
    lease_ttl_s: Annotated[float, Field(ge=1)] = 10.0
    # How this replica's leases are named in Redis (None: hostname:port); a replica that
    # restarts under the same id gives back what its previous run left at once.
    replica_id: str | None = None

    def __post_init__(self) -> None:
        self._check_tenant_tiers()
        self._check_default_tenant()
        if self.auth and not any(tenant.api_keys for tenant in self.tenants):
            raise ConfigError("admission.auth is on but no tenant has api_keys: every request would be refused")
        if not self.prompt_weight + self.output_weight > 0:
            raise ConfigError("admission.prompt_weight and output_weight must not both be 0")

    def _check_tenant_tiers(self) -> None:
        names = [name for name, _ in self.tiers]
        for tenant in self.tenants:
            if tenant.tier not in names:
                raise ConfigError(f"tenant {tenant.name!r}: unknown tier {tenant.tier!r} (tiers: {', '.join(names)})")

    def _check_default_tenant(self) -> None:
        names = {tenant.name for tenant in self.tenants}
        if self.default_tenant not in names:
            raise ConfigError(
                f"admission.default_tenant {self.default_tenant!r} is not one of the tenants "
                f"({', '.join(sorted(names))})"
            )

    def priority(self, tier: str) -> int:
        for name, prio in self.tiers:
            if name == tier:
                return prio
        raise ConfigError(f"unknown tier {tier!r} (tiers: {', '.join(name for name, _ in self.tiers)})")

    def objective_tier(self, objective: str) -> str | None:
        for name, tier in self.objectives:
            if name == objective:
                return tier
        return None

    def tenant(self, name: str) -> TenantConfig:
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(name)


@config_errors("pools.long.")
@dataclass(frozen=True, config=STRICT)
class PoolConfig:
    # Another headroom instance this class of request is proxied to (None: served here).
    url: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"pool url must start with http:// or https://, got {self.url!r}")


def _pool(pool: Any) -> Any:
    return PoolConfig(**pool) if isinstance(pool, Mapping) else pool  # a TOML [pools.long] table


@config_errors("pools.")
@dataclass(frozen=True, config=STRICT)
class PoolsConfig:
    long: Annotated[PoolConfig, BeforeValidator(_pool)] = field(default_factory=PoolConfig)


def _secret(what: str) -> Callable[[str | None], str | None]:
    def check(token: str | None) -> str | None:
        if token is not None and len(token) < 16:
            raise ConfigError(f"{what} must be at least 16 characters")  # by hand: never echo it
        return token

    return check


@config_errors("observability.")
@dataclass(frozen=True, config=STRICT)
class ObservabilityConfig:
    """Tracing itself is configured by the standard OTEL_* environment variables."""

    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="log lines as JSON or for a human (console); auto: console on a terminal, else json"
    )
    log_prompts: bool = Field(
        False, description="put prompt text into the per-request log line (off: prompts can hold secrets)"
    )
    metrics: bool = True  # serve /metrics
    # The bearer token a scraper sends for /metrics (else HEADROOM_METRICS_TOKEN; the admin
    # token also works). With a token or with [admission] auth on, /metrics needs one.
    metrics_token: Annotated[str | None, AfterValidator(_secret("metrics token"))] = None
    # The head-of-line signal: rolling TTFT window, and when it fires.
    monitor_interval_s: Positive = 1.0
    ttft_window_s: Positive = 60.0
    hol_short_ttft_p99_s: Positive = 2.0  # short-class p99 TTFT above this ...
    hol_long_share: Share = 0.5  # ... while long sequences hold this share of device time or KV
    # The usage ledger behind GET /admin/usage (one SQLite row per finished request, no
    # text): off unless a path is given; rows older than usage_retention_days are deleted.
    usage_ledger_path: str | None = None
    usage_retention_days: Positive = 90.0
    # The predictors' health (observability/predictor_health.py): their quality over the
    # last predictor_health_window finished requests. A figure whose sample (server-wide
    # or one tenant's) is under predictor_health_min_requests is left out, not reported noisy.
    predictor_health_window: int = 500
    predictor_health_min_requests: int = 50

    def __post_init__(self) -> None:
        if not 2 <= self.predictor_health_min_requests <= self.predictor_health_window:
            raise ConfigError(
                "predictor_health_min_requests must be in [2, predictor_health_window], "
                f"got {self.predictor_health_min_requests} and "
                f"{self.predictor_health_window}"
            )


def _admin_ladder(steps: Any) -> tuple[str, ...]:
    return _ladder(steps, "admin.ladder")


@config_errors("admin.")
@dataclass(frozen=True, config=STRICT)
class AdminConfig:
    # The /admin/ API's bearer token (else HEADROOM_ADMIN_TOKEN). No token: no admin API.
    token: Annotated[str | None, AfterValidator(_secret("admin token"))] = None
    # Automatic policies, each off (None) by default: act on a sequence that has run
    # longer than max_age_s, holds more than max_kv_share of the KV pool, or has produced
    # more than max_predicted_ratio times its predicted output tokens.
    policy_action: Action = "deprioritize"
    max_age_s: Positive | None = None
    max_kv_share: Share | None = None
    max_predicted_ratio: Positive | None = None
    # Act on a sequence the length probe gives at least this probability of running to
    # its cap (deprioritize also moves it to the long lane).
    max_runaway_probability: Share | None = None
    policy_interval_s: Positive = 0.5
    # The remediation ladder (empty: every violation gets policy_action): a sequence's
    # first violation gets ladder[0], and each one ladder_step_s or more after its last
    # action the next step, staying on the last. Steps: deprioritize, cap, abort.
    ladder: Annotated[tuple[Action, ...], BeforeValidator(_admin_ladder)] = ()
    ladder_step_s: Positive = 5.0
    # A cap (policy or loop) lets a sequence generate at most this many more tokens.
    cap_tokens: NonNegativeInt = 32
    # Loop detection on the engine thread (contracts/repetition.py), vLLM's
    # repetition_detection test with these parameters, for every sequence that brings no
    # repetition_detection of its own and does not set ignore_eos. A loop is then:
    # off: not looked for; flag: logged, counted, shown on the span and /admin/sequences,
    # and, where a ladder is set, a violation it acts on; cap: also ended after cap_tokens more;
    # stop: ended at once (finish_reason "repetition"). A tenant may set its own.
    # bench/RESULTS.md (loop detection) has the data behind these defaults.
    loop_policy: LoopPolicy = "cap"
    loop_max_pattern_size: int = 128
    loop_min_pattern_size: int = 8
    loop_min_count: int = 4

    def __post_init__(self) -> None:
        try:
            RepetitionDetection(self.loop_max_pattern_size, self.loop_min_pattern_size, self.loop_min_count)
        except ValueError as exc:
            raise ConfigError(f"admin.loop_*: {exc}") from None

    @property
    def loop_detection(self) -> RepetitionDetection:
        return RepetitionDetection(self.loop_max_pattern_size, self.loop_min_pattern_size, self.loop_min_count)


@config_errors("")
@dataclass(frozen=True, config=STRICT)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_backend: str = Field(
        "auto",
        description="auto, torch, triton, flash_attn, xformers (auto: by what is installed and the device present)",
    )
    seed: int = Field(0, description="seeds the sampling of requests that bring no seed of their own")
    # [[lora]] name = "...", path = "...": PEFT adapters loaded at start, selected by `model`.
    lora: Annotated[tuple[tuple[str, str], ...], BeforeValidator(_lora_modules)] = Field(
        (), description="LoRA adapters to load at start, as NAME=PATH (a PEFT folder); clients select one by `model`"
    )
