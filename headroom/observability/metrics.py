"""Prometheus metrics, served as text at /metrics.

Request histograms are observed once per finished request, labelled by size class and
tier. Everything the engine and admission already count (tokens, preemptions, aborts,
decisions, queue lengths, KV blocks) is read from them at scrape time by a collector,
so there is one count of each thing and nothing extra to do per step. Names follow
vLLM's, with the `headroom:` prefix, where the meaning is the same (docs/METRICS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from headroom.observability.finished import FinishedRequest
from headroom.observability.ledger import Usage
from headroom.observability.predictor_health import PredictorHealth
from headroom.runtime.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("size_class", "tier")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


MAX_LORA_LABELS = 64  # distinct adapter names a LoRA metric labels; the rest are `other`


class AdmissionView(Protocol):
    """What the metrics read of admission at scrape time (admission/admission.py's
    Admission): its counters, and the shared store's health where there is one."""

    store: Any

    def stats(self) -> Any: ...


class Metrics:
    def __init__(
        self, engine: Engine, admission: AdmissionView | None, dropped_spans: Callable[[], int], health: PredictorHealth
    ):
        # One registry per app, so several servers in one process never share counters.
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram("headroom:time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.queue_time = histogram(
            "headroom:request_queue_time_seconds",
            "Arrival to first scheduled step (admission wait included).",
            TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "headroom:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.e2e = histogram("headroom:e2e_request_latency_seconds", "Arrival to the end of the response.", E2E_BUCKETS)
        self.device_time = histogram(
            "headroom:request_device_time_seconds", "The request's share of every engine step it was in.", E2E_BUCKETS
        )
        self.rolling_ttft = Gauge(
            "headroom:rolling_time_to_first_token_seconds",
            "TTFT quantile over the monitor's window.",
            ("size_class", "quantile"),
            registry=self.registry,
        )
        self.hol_coupling = Gauge(
            "headroom:hol_coupling",
            "1 while the short class's p99 TTFT is high and long sequences dominate.",
            registry=self.registry,
        )
        self.long_device_share = Gauge(
            "headroom:long_device_share",
            "Share of engine busy time spent on long-class sequences, last interval.",
            registry=self.registry,
        )
        self.hol_actions = Counter(
            "headroom:hol_actions", "Head-of-line loop actions on the long lane.", ("action",), registry=self.registry
        )
        self.long_lane_factor = Gauge(
            "headroom:long_lane_factor",
            "Scale the head-of-line loop puts on the long lane's prefill allowance.",
            registry=self.registry,
        )
        self.long_lane_factor.set(1.0)
        self.split_ratio = Gauge(
            "headroom:pool_split_ratio",
            "Largest finished request against the median over the last 10 minutes, by size "
            "(prompt + output tokens) or engine time: over 10, plan a split; over 50, split.",
            ("measure",),
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, admission, dropped_spans))
        self.registry.register(PredictorHealthCollector(health))

        # Cost per tenant, for billing and throttling: one label value per configured tenant
        # (`none` for requests refused before their tenant was known).
        def by_tenant(name: str, doc: str) -> Counter:
            return Counter(name, doc, ("tenant",), registry=self.registry)

        self.tenant_requests = Counter(
            "headroom:tenant_requests",
            "Finished requests by tenant and outcome (stop, length, abort, rejected, invalid, routed, error).",
            ("tenant", "outcome"),
            registry=self.registry,
        )
        self.tenant_prompt_tokens = by_tenant("headroom:tenant_prompt_tokens", "Prompt tokens of requests that ran.")
        self.tenant_cached_tokens = by_tenant(
            "headroom:tenant_cached_prompt_tokens", "Of those, tokens served from the prefix cache."
        )
        self.tenant_output_tokens = by_tenant("headroom:tenant_output_tokens", "Output tokens generated.")
        self.tenant_device_seconds = by_tenant(
            "headroom:tenant_device_seconds",
            "Engine time: each step's wall time split over its sequences by their share of its tokens.",
        )
        self.tenant_kv_block_seconds = by_tenant(
            "headroom:tenant_kv_block_seconds", "KV blocks held, times the seconds of each step they were held in."
        )
        self.tenant_admission_wait = by_tenant(
            "headroom:tenant_admission_wait_seconds", "Time between arrival and admission."
        )
        # Per LoRA adapter: adapters load at run time, so their label values are capped (the
        # first MAX_LORA_LABELS names seen keep their own; later ones count as `other`).
        self.lora_requests = Counter(
            "headroom:lora_requests",
            "Finished requests that ran under a LoRA adapter.",
            ("lora",),
            registry=self.registry,
        )
        self.lora_output_tokens = Counter(
            "headroom:lora_output_tokens",
            "Output tokens generated under a LoRA adapter.",
            ("lora",),
            registry=self.registry,
        )
        self.lora_device_seconds = Counter(
            "headroom:lora_device_seconds",
            "Engine time of requests under a LoRA adapter.",
            ("lora",),
            registry=self.registry,
        )
        self._lora_labels: set[str] = set()

    def charge(self, usage: Usage) -> None:
        tenant = usage.tenant
        self.tenant_requests.labels(tenant, usage.outcome).inc()
        self.tenant_admission_wait.labels(tenant).inc(usage.admission_wait_seconds)
        self.tenant_prompt_tokens.labels(tenant).inc(usage.prompt_tokens)
        self.tenant_cached_tokens.labels(tenant).inc(usage.cached_prompt_tokens)
        self.tenant_output_tokens.labels(tenant).inc(usage.output_tokens)
        self.tenant_device_seconds.labels(tenant).inc(usage.device_seconds)
        self.tenant_kv_block_seconds.labels(tenant).inc(usage.kv_block_seconds)
        if usage.lora is not None:
            label = self._lora_label(usage.lora)
            self.lora_requests.labels(label).inc()
            self.lora_output_tokens.labels(label).inc(usage.output_tokens)
            self.lora_device_seconds.labels(label).inc(usage.device_seconds)

    def _lora_label(self, name: str) -> str:
        if name not in self._lora_labels and len(self._lora_labels) < MAX_LORA_LABELS:
            self._lora_labels.add(name)
        return name if name in self._lora_labels else "other"

    def observe(self, done: FinishedRequest) -> None:
        if not done.ran:
            return
        labels = (done.size_class, done.tier or "")
        if done.queue_wait_s is not None:
            self.queue_time.labels(*labels).observe(done.queue_wait_s)
        if done.ttft_s is not None:
            self.ttft.labels(*labels).observe(done.ttft_s)
        if done.tpot_s is not None:
            self.tpot.labels(*labels).observe(done.tpot_s)
        self.e2e.labels(*labels).observe(done.e2e_s)
        self.device_time.labels(*labels).observe(done.device_time_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def refused_outcome(done: FinishedRequest) -> str:
    """How a request that never reached the engine ended, for the per-tenant counter."""
    if done.http_status == 429:
        return "rejected"
    if 400 <= done.http_status < 500:
        return "invalid"
    if done.http_status == 200:
        return "routed"  # proxied to the long pool, which counts its own cost
    return "error"


class EngineCollector(Collector):
    """Reads the engine's and admission's own counters at scrape time."""

    def __init__(self, engine: Engine, admission: AdmissionView | None, dropped_spans: Callable[[], int]):
        self.engine = engine
        self.admission = admission
        self.dropped_spans = dropped_spans

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.counters()  # the gauges too: no engine state is read here off its lock
        yield GaugeMetricFamily(
            "headroom:num_requests_running", "Sequences in the running batch.", value=stats.num_running
        )
        yield GaugeMetricFamily(
            "headroom:num_requests_waiting", "Sequences queued in the engine.", value=stats.num_waiting
        )
        # What a router or an autoscaler should read as queue depth: with admission on,
        # most of the backlog waits there, not in the engine.
        admission_waiting = 0 if self.admission is None else sum(self.admission.stats().waiting.values())
        yield GaugeMetricFamily(
            "headroom:num_requests_queued",
            "Requests waiting to run: queued in the engine plus waiting in admission.",
            value=stats.num_waiting + admission_waiting,
        )
        used, total = stats.kv_blocks_used, stats.kv_blocks_total
        yield GaugeMetricFamily("headroom:kv_cache_blocks_used", "KV blocks in use.", value=used)
        yield GaugeMetricFamily("headroom:kv_cache_blocks_total", "KV blocks in the pool.", value=total)
        yield GaugeMetricFamily(
            "headroom:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", value=used / total
        )
        yield _counter(
            "headroom:prompt_tokens", "Prompt tokens of requests that reached the engine.", stats.prompt_tokens
        )
        yield _counter("headroom:generation_tokens", "Tokens generated.", stats.generated_tokens)
        yield _counter(
            "headroom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield _counter(
            "headroom:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield _counter("headroom:num_preemptions", "Sequences preempted (recomputed later).", stats.preemptions)
        yield _counter(
            "headroom:spec_decode_num_drafts", "Rows that guessed tokens (speculative decoding).", stats.spec_drafts
        )
        yield _counter("headroom:spec_decode_num_draft_tokens", "Tokens guessed.", stats.spec_draft_tokens)
        yield _counter(
            "headroom:spec_decode_num_accepted_tokens", "Guessed tokens the model kept.", stats.spec_accepted_tokens
        )
        yield _counter("headroom:engine_busy_seconds", "Wall time spent in engine steps.", stats.step_time_s)
        yield _counter(
            "headroom:request_success", "Finished requests, by finish reason.", stats.finished, "finished_reason"
        )
        yield _counter("headroom:request_aborts", "Requests cut short, by cause.", stats.aborts, "cause")
        yield _counter(
            "headroom:device_time_seconds", "Engine time by size class.", stats.device_time_by_class, "size_class"
        )
        yield _counter(
            "headroom:probe_estimates",
            "Length probe estimates made (one per sequence each time).",
            stats.probe_estimates,
        )
        yield _counter(
            "headroom:probe_decisions",
            "Scheduling decisions the length probe's estimate changed: order (which waiting request "
            "went first), victim (which was preempted), long_lane (a predicted runaway moved there), "
            "policy (the runaway policy acted).",
            {d: stats.probe_decisions.get(d, 0) for d in ("order", "victim", "long_lane", "policy")},
            "decision",
        )
        yield _counter(
            "headroom:loops_detected",
            "Sequences the server's loop detector found looping, by the action its loop policy "
            "took (flag, cap or stop; close: a loop under a grammar steered to close its value).",
            {a: stats.loops.get(a, 0) for a in ("flag", "cap", "stop", "close")},
            "action",
        )
        yield _counter(
            "headroom:policy_actions",
            "Actions the automatic policies and their ladder took, by action.",
            {a: stats.policy_actions.get(a, 0) for a in ("deprioritize", "cap", "abort")},
            "action",
        )
        yield _counter(
            "headroom:tracing_spans_dropped", "Spans lost to a full queue or a failed export.", self.dropped_spans()
        )
        if self.admission is None:
            return
        admission = self.admission.stats()
        yield _counter("headroom:admission_decisions", "Admission decisions.", admission.decisions, "decision")
        yield _counter("headroom:admission_rejections", "Rejections, by reason.", admission.rejections, "reason")
        yield _gauge(
            "headroom:tenant_tokens_in_flight",
            "Tokens reserved by admitted, unfinished requests.",
            admission.in_flight_tokens,
            "tenant",
        )
        yield _gauge("headroom:tenant_requests_waiting", "Requests waiting in admission.", admission.waiting, "tenant")
        yield _gauge(
            "headroom:tenant_fair_share_counter",
            "Each tenant's virtual counter: the weighted service "
            "it has received (engine seconds in token units with fair_share = device); admission "
            "serves the backlogged tenant with the smallest first.",
            admission.virtual_tokens,
            "tenant",
        )
        if self.admission.store is None:
            return
        store = self.admission.store.stats()
        yield GaugeMetricFamily(
            "headroom:admission_store_up",
            "1 while the shared (Redis) admission store answers; 0 while this replica admits on its fallback share.",
            value=int(store.available),
        )
        yield _counter(
            "headroom:admission_store_fallbacks", "Times the shared admission store was lost.", store.fallbacks
        )
        yield _counter(
            "headroom:admission_store_errors", "Round trips to the shared admission store that failed.", store.errors
        )
        yield GaugeMetricFamily(
            "headroom:admission_store_leases",
            "Reservations this replica holds in the shared admission store.",
            value=store.leases,
        )


# The predictors' health figures: (name, meaning, {predictor label: Figures field}), each
# exported server-wide as headroom:NAME and per tenant as headroom:tenant_NAME{tenant}.
# A figure whose sample is too small has no sample at all, rather than a noisy one.
HEALTH = (
    (
        "predictor_health_requests",
        (
            "Finished requests in the predictors' health window: they ran and their natural end is "
            "known (ended by stop or length, not cut by a cap or a budget, EOS not ignored), or the "
            "loop detector ended them (counted as runs to their max_tokens)."
        ),
        {"": "requests"},
    ),
    ("predictor_cap_rate", "Share of the window's requests that ran to their max_tokens.", {"": "cap_rate"}),
    (
        "predictor_kendall_tau",
        "Kendall tau-b of admission's predicted (p50) against actual output tokens, over the window.",
        {"": "kendall_tau"},
    ),
    (
        "predictor_mae_tokens",
        "Mean absolute error of admission's predicted (p50) output tokens, over the window.",
        {"": "mae_tokens"},
    ),
    (
        "predictor_cap_auc",
        (
            "Run-to-cap AUC over the window, by predictor: admission (its predicted share of "
            "max_tokens as the score) or probe (the probe's last runaway probability)."
        ),
        {"admission": "admission_cap_auc", "probe": "probe_cap_auc"},
    ),
    (
        "probe_flag_precision",
        ("Of the window's requests the length probe flagged as runaways, the share that ran to their max_tokens."),
        {"": "flag_precision"},
    ),
)


class PredictorHealthCollector(Collector):
    """Computes the health figures at scrape time, once for every family."""

    def __init__(self, health: PredictorHealth):
        self.health = health

    def collect(self) -> Iterator[Metric]:
        report = self.health.report()
        for name, doc, fields in HEALTH:
            labels = [] if "" in fields else ["predictor"]
            server = GaugeMetricFamily(f"headroom:{name}", doc, labels=labels)
            by_tenant = GaugeMetricFamily(f"headroom:tenant_{name}", doc + " By tenant.", labels=["tenant", *labels])
            for predictor, field in fields.items():
                key = [predictor] if labels else []
                if (value := getattr(report.server, field)) is not None:
                    server.add_metric(key, value)
                for tenant, figures in report.tenants.items():
                    if (value := getattr(figures, field)) is not None:
                        by_tenant.add_metric([tenant, *key], value)
            yield server
            yield by_tenant


def _counter(name: str, doc: str, value: float | dict[str, float], label: str | None = None) -> Metric:
    if label is None:
        return CounterMetricFamily(name, doc, value=value)
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(value.items()):
        family.add_metric([key], count)
    return family


def _gauge(name: str, doc: str, values: dict[str, float], label: str) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
