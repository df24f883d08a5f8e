"""One configuration object, built once at start and passed down; never mutated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from headroom.runtime.repetition import RepetitionDetection

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    # Weight-only quantised linears on the CPU: int4 (the GGUF's own Q4_1 groups), int8,
    # none (the float reference), or auto (see executor/device.py: resolve_quantization).
    quantization: str = "auto"
    # Caps the checkpoint's own context length (None: use the checkpoint's).
    max_model_len: int | None = None
    # On CUDA, decode steps replay CUDA graphs captured for these batch sizes (cut at
    # max_num_seqs, which is always captured); enforce_eager turns graphs off.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        sizes = self.cuda_graph_sizes
        if isinstance(sizes, (str, bytes)) or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ConfigError(f"cuda_graph_sizes must be a list of positive integers, got {sizes!r}")
        object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))  # TOML gives a list
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
    # The KV cache's element type; auto is the model's dtype, except float16 where the
    # weights are already quantised on the CPU (see executor/device.py: resolve_kv_dtype).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size % 8):
            raise ConfigError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError("kv_cache_memory_gib must be > 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Tokens one engine step may process across all sequences (decodes + prefill chunks).
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # Preemption victim order: "priority" (lowest priority, then longest predicted
    # remaining, then newest) or "newest".
    preemption_order: str = "priority"
    # Waiting order within a priority: predicted output tokens minus this many tokens for
    # every second waited (predicted-short-first with ageing; FCFS without predictions).
    ageing_tokens_per_s: float = 50.0
    # Head-of-line protection for the long lane (the long size class, set by admission).
    # While shorter requests are present, long prefill chunks are sized by the engine's
    # measured step cost to add at most a quarter of short_ttft_target_s to a step (or a
    # quarter of the step, where one step is slower than that); the head-of-line monitor
    # scales that down while the short class suffers, but never below a floor that grows
    # with the long request's wait and is whole at long_ttft_target_s. long_lane = false
    # turns it all off.
    long_lane: bool = True
    # A long chunk may add a quarter of this to a step. 0.15 s keeps the short class's p99
    # TTFT near its p99 alone at a bounded cost to the long class's first token; 0.25 s
    # let chunks into the steps that start a short request, 0.1 s stretched long prefill
    # (bench/RESULTS.md, the seventh session: "one long chunk per short request").
    short_ttft_target_s: float = 0.15
    long_ttft_target_s: float = 10.0
    # With no shorter request running or waiting, and none arrived for this long, long
    # chunks take the whole token budget: there is nobody to protect.
    long_lane_quiet_s: float = 10.0
    # While shorter requests decode, long-class decode rows may add at most this fraction
    # of what the step costs without them (the shorter requests' time per output token is
    # an objective like their first token); the rest take turns, each sitting out at most
    # long_decode_max_skip steps in a row, so a long decode keeps 1 / (1 + that) of its pace.
    short_tpot_stretch: float = 0.5
    long_decode_max_skip: int = 1
    # At most this many long-class sequences running (None: no cap), holding at most this
    # share of the KV blocks.
    long_max_running: int | None = None
    long_kv_share: float = 0.6

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens must be >= max_num_seqs so every running decode "
                f"fits in one step ({self.max_num_batched_tokens} < {self.max_num_seqs})"
            )
        if self.ageing_tokens_per_s < 0:
            raise ConfigError(f"ageing_tokens_per_s must be >= 0, got {self.ageing_tokens_per_s}")
        if self.long_max_running is not None and self.long_max_running < 1:
            raise ConfigError(f"long_max_running must be >= 1, got {self.long_max_running}")
        if not self.short_tpot_stretch >= 0:
            raise ConfigError(f"short_tpot_stretch must be >= 0, got {self.short_tpot_stretch}")
        if self.long_decode_max_skip < 0:
            raise ConfigError(f"long_decode_max_skip must be >= 0, got {self.long_decode_max_skip}")
        if not 0 < self.long_kv_share <= 1:
            raise ConfigError(f"long_kv_share must be in (0, 1], got {self.long_kv_share}")
        for name in ("short_ttft_target_s", "long_ttft_target_s", "long_lane_quiet_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.preemption_order not in ("priority", "newest"):
            raise ConfigError(f"preemption_order must be 'priority' or 'newest', got {self.preemption_order!r}")


UNKNOWN_FIELDS = ("reject", "accept")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 * 2**20
    # Requests allowed to wait beyond max_num_seqs before new ones get 429.
    max_queue_len: int = 256
    # On SIGTERM: how long running streams may take to finish before they are aborted.
    drain_timeout_s: float = 30.0
    # A request field no schema knows (a typo such as max_token): "reject" answers 400
    # naming it, as OpenAI does; "accept" ignores it and logs a warning, as vLLM does,
    # for clients that send another server's extras.
    unknown_fields: str = "reject"
    # A `metrics` object (waits, TTFT, engine seconds ...) on every final response; a
    # tenant's own request_metrics, where set, decides for its requests.
    request_metrics: bool = False

    def __post_init__(self) -> None:
        if self.unknown_fields not in UNKNOWN_FIELDS:
            raise ConfigError(f"unknown_fields must be one of {', '.join(UNKNOWN_FIELDS)}, got {self.unknown_fields!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


ACTIONS = ("deprioritize", "cap", "abort")
LOOP_POLICIES = ("off", "flag", "cap", "stop")


def check_ladder(ladder: tuple[str, ...], where: str) -> None:
    if any(step not in ACTIONS for step in ladder):
        raise ConfigError(f"{where}: every step must be one of {', '.join(ACTIONS)}, got {list(ladder)}")


def check_loop_policy(policy: str, where: str) -> None:
    if policy not in LOOP_POLICIES:
        raise ConfigError(f"{where} must be one of {', '.join(LOOP_POLICIES)}, got {policy!r}")


DEFAULT_TIERS: tuple[tuple[str, int], ...] = (("premium", 2), ("standard", 1), ("batch", 0))


@dataclass(frozen=True)
class TenantConfig:
    name: str
    tier: str = "standard"
    api_keys: tuple[str, ...] = ()
    # Token bucket: sustained rate and burst, in (prompt + output) tokens.
    rate_tokens_per_s: float = 2000.0
    burst_tokens: int = 16000
    # Reserved tokens of admitted, unfinished requests; a bigger request can never run.
    # None: the engine's KV cache in tokens, all that could ever be in flight at once. A
    # lower default would queue requests in admission that the engine had room to run.
    max_in_flight_tokens: int | None = None
    max_queue: int = 64
    max_wait_s: float = 30.0
    # Per-tenant caps on a request's max_tokens and total length (None: the server's).
    max_tokens: int | None = None
    max_model_len: int | None = None
    # Its own loop policy and remediation ladder (None: the server's, in [admin]).
    loop_policy: str | None = None
    ladder: tuple[str, ...] | None = None
    # The `metrics` object on its responses (None: [server] request_metrics decides).
    request_metrics: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tenant name must be a non-empty string, got {self.name!r}")
        where = f"tenant {self.name!r}"
        if isinstance(self.api_keys, str):
            raise ConfigError(f"{where}: api_keys must be a list of strings, not one string")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))  # TOML gives a list
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise ConfigError(f"{where}: every api key must be a non-empty string")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ConfigError(f"{where}: an api key is listed twice")
        if not (self.rate_tokens_per_s > 0 and math.isfinite(self.rate_tokens_per_s)):
            raise ConfigError(f"{where}: rate_tokens_per_s must be > 0, got {self.rate_tokens_per_s}")
        if self.burst_tokens < 1:
            raise ConfigError(f"{where}: burst_tokens must be >= 1, got {self.burst_tokens}")
        if self.max_in_flight_tokens is not None and self.max_in_flight_tokens < 1:
            raise ConfigError(f"{where}: max_in_flight_tokens must be >= 1, got {self.max_in_flight_tokens}")
        if self.max_queue < 0:
            raise ConfigError(f"{where}: max_queue must be >= 0, got {self.max_queue}")
        if not self.max_wait_s >= 0:
            raise ConfigError(f"{where}: max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"{where}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ConfigError(f"{where}: max_model_len must be >= 16, got {self.max_model_len}")
        if self.loop_policy is not None:
            check_loop_policy(self.loop_policy, f"{where}: loop_policy")
        if self.ladder is not None:
            object.__setattr__(self, "ladder", tuple(self.ladder))
            check_ladder(self.ladder, f"{where}: ladder")


def check_store_url(url: str, where: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{where} must be a redis://, rediss:// or unix:// URL, got one starting {url.split(':', 1)[0]!r}"
        )  # never echo a password


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True
    # Tier name -> priority (higher is more important), as pairs so the config stays hashable.
    tiers: tuple[tuple[str, int], ...] = DEFAULT_TIERS
    tenants: tuple[TenantConfig, ...] = (TenantConfig("default"),)
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
    objectives: tuple[tuple[str, str], ...] = ()
    # Admitted, unfinished requests across all tenants (None: decided from the engine's max_num_seqs).
    global_max_in_flight_seqs: int | None = None
    # A queued request that does not fit its tenant's limits yet is passed by later ones
    # that do (a short request never waits behind a long one) for this long; after that
    # nobody of its tenant passes it, so it cannot starve.
    backfill_max_wait_s: float = 10.0
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
    deadline_s: float | None = None
    # Append one JSON record per finished request (features + actual tokens) here, for
    # retraining; the file is rotated to <path>.1 after record_log_max_lines lines.
    record_log_path: str | None = None
    record_log_max_lines: int = 100_000
    # Virtual token counter charge per prompt and per output token (fair sharing across tenants).
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    # What a finished request is charged to its tenant's fair share: "device", its engine
    # seconds (in weighted tokens at the engine's own rate), or "tokens", its tokens alone.
    fair_share: str = "device"
    # Length estimates in flight (runtime/inflight.py): after prefill and every
    # inflight_every generated tokens, from the served model's own hidden state. The
    # probe at inflight_probe_path, else the one shipped for the default model (none for
    # another model: then admission's prediction is all there is).
    inflight: bool = True
    inflight_probe_path: str | None = None
    inflight_every: int = 16
    # Run-to-cap probability at which a sequence is flagged a runaway (and, with a
    # max_tokens of long work, moved to the long lane).
    runaway_threshold: float = 0.8
    # Where tenant budgets live: None keeps them in this process; "redis://host:port/db"
    # shares them with every replica pointed at the same Redis (the URL may also come
    # from HEADROOM_ADMISSION_STORE, so a password need not sit in a config file).
    store: str | None = None
    # Replicas sharing the store: without Redis each falls back to 1/fleet_size of every budget.
    fleet_size: int = 1
    # A replica's reservations in Redis expire this long after its last renewal (it
    # renews every third of it), so those of a replica that died come back this fast.
    lease_ttl_s: float = 10.0
    # How this replica's leases are named in Redis (None: hostname:port); a replica that
    # restarts under the same id gives back what its previous run left at once.
    replica_id: str | None = None

    def __post_init__(self) -> None:
        # A TOML file gives a table for tiers and a list of tables for tenants.
        tiers = self.tiers.items() if isinstance(self.tiers, Mapping) else self.tiers
        object.__setattr__(self, "tiers", tuple(tuple(pair) for pair in tiers))
        object.__setattr__(self, "tenants", tuple(self._tenant(t) for t in self.tenants))
        objectives = self.objectives
        objectives = objectives.items() if isinstance(objectives, Mapping) else objectives
        object.__setattr__(self, "objectives", tuple(tuple(pair) for pair in objectives))

        if not all(len(pair) == 2 for pair in self.tiers):
            raise ConfigError(f"admission.tiers must be (name, priority) pairs, got {self.tiers!r}")
        names = [name for name, _ in self.tiers]
        if not names:
            raise ConfigError("admission.tiers must name at least one tier")
        if len(set(names)) != len(names):
            raise ConfigError(f"admission.tiers: a tier is named twice in {names}")
        for name, prio in self.tiers:
            if not isinstance(name, str) or not name or not isinstance(prio, int) or isinstance(prio, bool):
                raise ConfigError(f"admission.tiers: {name!r} = {prio!r} must map a name to an integer priority")
        for pair in self.objectives:
            if len(pair) != 2 or not isinstance(pair[0], str) or not pair[0] or pair[1] not in names:
                raise ConfigError(
                    f"admission.objectives: {pair!r} must map an objective's name to a tier ({', '.join(names)})"
                )

        if not self.tenants:
            raise ConfigError("admission.tenants must list at least one tenant")
        seen: set[str] = set()
        key_owner: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.name in seen:
                raise ConfigError(f"admission.tenants: tenant {tenant.name!r} is defined twice")
            seen.add(tenant.name)
            if tenant.tier not in names:
                raise ConfigError(f"tenant {tenant.name!r}: unknown tier {tenant.tier!r} (tiers: {', '.join(names)})")
            for key in tenant.api_keys:
                if key in key_owner:  # never echo the key itself
                    raise ConfigError(
                        f"tenant {tenant.name!r}: an api key is already used by tenant {key_owner[key]!r}"
                    )
                key_owner[key] = tenant.name
        if self.default_tenant not in seen:
            raise ConfigError(
                f"admission.default_tenant {self.default_tenant!r} is not one of the tenants "
                f"({', '.join(sorted(seen))})"
            )
        if self.auth and not key_owner:
            raise ConfigError("admission.auth is on but no tenant has api_keys: every request would be refused")
        if self.fair_share not in ("device", "tokens"):
            raise ConfigError(f"admission.fair_share must be 'device' or 'tokens', got {self.fair_share!r}")
        if not self.backfill_max_wait_s >= 0:
            raise ConfigError(f"admission.backfill_max_wait_s must be >= 0, got {self.backfill_max_wait_s}")
        if self.global_max_in_flight_seqs is not None and self.global_max_in_flight_seqs < 1:
            raise ConfigError(f"admission.global_max_in_flight_seqs must be >= 1, got {self.global_max_in_flight_seqs}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"admission.deadline_s must be > 0, got {self.deadline_s}")
        if self.record_log_max_lines < 1:
            raise ConfigError("admission.record_log_max_lines must be >= 1")
        if not (self.prompt_weight >= 0 and self.output_weight >= 0 and self.prompt_weight + self.output_weight > 0):
            raise ConfigError(
                "admission.prompt_weight and output_weight must be >= 0 and not both 0, "
                f"got {self.prompt_weight} and {self.output_weight}"
            )
        if self.inflight_every < 1:
            raise ConfigError(f"admission.inflight_every must be >= 1, got {self.inflight_every}")
        if not 0 < self.runaway_threshold <= 1:
            raise ConfigError(f"admission.runaway_threshold must be in (0, 1], got {self.runaway_threshold}")
        if self.store is not None:
            check_store_url(self.store, "admission.store")
        if not (isinstance(self.fleet_size, int) and self.fleet_size >= 1):
            raise ConfigError(f"admission.fleet_size must be an integer >= 1, got {self.fleet_size!r}")
        if not self.lease_ttl_s >= 1:
            raise ConfigError(f"admission.lease_ttl_s must be >= 1, got {self.lease_ttl_s}")

    @staticmethod
    def _tenant(item: TenantConfig | Mapping) -> TenantConfig:
        if isinstance(item, TenantConfig):
            return item
        if isinstance(item, Mapping):
            return TenantConfig(**item)
        raise ConfigError(f"admission.tenants: each tenant must be a table, got {item!r}")

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


@dataclass(frozen=True)
class PoolConfig:
    # Another headroom instance this class of request is proxied to (None: served here).
    url: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"pool url must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True)
class PoolsConfig:
    long: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if isinstance(self.long, Mapping):  # a TOML [pools.long] table
            object.__setattr__(self, "long", PoolConfig(**self.long))


@dataclass(frozen=True)
class ObservabilityConfig:
    """Tracing itself is configured by the standard OTEL_* environment variables."""

    log_format: str = "auto"  # json, console, or auto (console on a TTY, else json)
    # Put prompt text into the per-request log line. Off: prompts can hold secrets.
    log_prompts: bool = False
    metrics: bool = True  # serve /metrics
    # The head-of-line signal: rolling TTFT window, and when it fires.
    monitor_interval_s: float = 1.0
    ttft_window_s: float = 60.0
    hol_short_ttft_p99_s: float = 2.0  # short-class p99 TTFT above this ...
    hol_long_share: float = 0.5  # ... while long sequences hold this share of device time or KV
    # The usage ledger behind GET /admin/usage (one SQLite row per finished request, no
    # text): off unless a path is given; rows older than usage_retention_days are deleted.
    usage_ledger_path: str | None = None
    usage_retention_days: float = 90.0
    # The predictors' health (observability/predictor_health.py): their quality over the
    # last predictor_health_window finished requests. A figure whose sample (server-wide
    # or one tenant's) is under predictor_health_min_requests is left out, not reported noisy.
    predictor_health_window: int = 500
    predictor_health_min_requests: int = 50

    def __post_init__(self) -> None:
        if self.log_format not in ("auto", "json", "console"):
            raise ConfigError(f"log_format must be auto, json or console, got {self.log_format!r}")
        if self.monitor_interval_s <= 0 or self.ttft_window_s <= 0:
            raise ConfigError("monitor_interval_s and ttft_window_s must be > 0")
        if self.hol_short_ttft_p99_s <= 0:
            raise ConfigError(f"hol_short_ttft_p99_s must be > 0, got {self.hol_short_ttft_p99_s}")
        if not 0 < self.hol_long_share <= 1:
            raise ConfigError(f"hol_long_share must be in (0, 1], got {self.hol_long_share}")
        if self.usage_retention_days <= 0:
            raise ConfigError(f"usage_retention_days must be > 0, got {self.usage_retention_days}")
        if not 2 <= self.predictor_health_min_requests <= self.predictor_health_window:
            raise ConfigError(
                "predictor_health_min_requests must be in [2, predictor_health_window], "
                f"got {self.predictor_health_min_requests} and "
                f"{self.predictor_health_window}"
            )


@dataclass(frozen=True)
class AdminConfig:
    # The /admin/ API's bearer token (else HEADROOM_ADMIN_TOKEN). No token: no admin API.
    token: str | None = None
    # Automatic policies, each off (None) by default: act on a sequence that has run
    # longer than max_age_s, holds more than max_kv_share of the KV pool, or has produced
    # more than max_predicted_ratio times its predicted output tokens.
    policy_action: str = "deprioritize"  # or abort
    max_age_s: float | None = None
    max_kv_share: float | None = None
    max_predicted_ratio: float | None = None
    # Act on a sequence the in-flight probe gives at least this probability of running to
    # its cap (deprioritize also moves it to the long lane).
    max_runaway_probability: float | None = None
    policy_interval_s: float = 0.5
    # The remediation ladder (empty: every violation gets policy_action): a sequence's
    # first violation gets ladder[0], and each one ladder_step_s or more after its last
    # action the next step, staying on the last. Steps: deprioritize, cap, abort.
    ladder: tuple[str, ...] = ()
    ladder_step_s: float = 5.0
    # A cap (policy or loop) lets a sequence generate at most this many more tokens.
    cap_tokens: int = 32
    # Loop detection on the engine thread (runtime/repetition.py), vLLM's
    # repetition_detection test with these parameters, for every sequence that brings no
    # repetition_detection of its own and does not set ignore_eos. A loop is then:
    # off: not looked for; flag: logged, counted, shown on the span and /admin/sequences,
    # and, where a ladder is set, a violation it acts on; cap: also ended after cap_tokens more;
    # stop: ended at once (finish_reason "repetition"). A tenant may set its own.
    # bench/RESULTS.md (loop detection) has the data behind these defaults.
    loop_policy: str = "cap"
    loop_max_pattern_size: int = 128
    loop_min_pattern_size: int = 8
    loop_min_count: int = 4

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < 16:
            raise ConfigError("admin token must be at least 16 characters")
        if self.policy_action not in ACTIONS:
            raise ConfigError(f"policy_action must be one of {', '.join(ACTIONS)}, got {self.policy_action!r}")
        object.__setattr__(self, "ladder", tuple(self.ladder))  # TOML gives a list
        check_ladder(self.ladder, "admin.ladder")
        check_loop_policy(self.loop_policy, "admin.loop_policy")
        if self.cap_tokens < 0:
            raise ConfigError(f"cap_tokens must be >= 0, got {self.cap_tokens}")
        try:
            RepetitionDetection(self.loop_max_pattern_size, self.loop_min_pattern_size, self.loop_min_count)
        except ValueError as exc:
            raise ConfigError(f"admin.loop_*: {exc}") from None
        for name in ("max_age_s", "max_predicted_ratio", "policy_interval_s", "ladder_step_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name in ("max_kv_share", "max_runaway_probability"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")

    @property
    def loop_detection(self) -> RepetitionDetection:
        return RepetitionDetection(self.loop_max_pattern_size, self.loop_min_pattern_size, self.loop_min_count)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    # "auto" picks by what is installed and the device present; or torch/flash_attn/xformers.
    attention_backend: str = "auto"
    seed: int = 0
