"""Between parsing and the engine: who is asking (tenant), how long will the answer be
(predictor -> size class), and may it run now (Admission). With admission off, only
the tenant is resolved and the request goes straight to the engine (plain FCFS)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import socket
import time
from dataclasses import dataclass

from aiohttp import web

from headroom.admission.admission import Admission, Rejected, Ticket
from headroom.admission.redis_store import RedisStore
from headroom.admission.tenants import Tenant, TenantRegistry
from headroom.app.errors import APIError, BadRequest, QueueFull, Unauthorized, Unavailable
from headroom.config import Config, check_store_url
from headroom.contracts.request import AdmissionRecord, Request
from headroom.openmp import in_passing_thread
from headroom.prediction.classes import ClassThresholds, SizeClass, classify
from headroom.prediction.features import RequestFeatures
from headroom.prediction.predictor import Prediction, load_predictor
from headroom.prediction.records import RecordLog, label

# The Gateway API Inference Extension's flow control names who a request belongs to and
# its InferenceObjective in these headers; llm-d's router, which carries its endpoint
# picker on from v1.6, reads its own names first and these as aliases, and so does headroom.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", FAIRNESS_HEADER)
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", OBJECTIVE_HEADER)
# llm-d's router may also pass the request's time-to-first-token objective, in milliseconds.
TTFT_OBJECTIVE_HEADER = "x-llm-d-slo-ttft-ms"
MAX_TENANT_NAME = 128


@dataclass
class Admitted:
    tenant: Tenant
    ticket: Ticket | None = None
    prediction: Prediction | None = None
    features: RequestFeatures | None = None
    decision_s: float = 0.0  # predictor + classification time
    route: str | None = None  # another instance's URL when this request is proxied there


class AdmissionGate:
    def __init__(self, config: Config, max_in_flight_seqs: int, capacity_tokens: int | None = None):
        """capacity_tokens: the engine's KV cache in tokens (a tenant's default in-flight cap)."""
        self.config = config.admission
        self.long_pool_url = config.pools.long.url
        self.registry = TenantRegistry(self.config, capacity_tokens=capacity_tokens)
        self.enabled = self.config.enabled
        self.store = _store(config, self.registry) if self.enabled else None
        self.admission = (
            Admission(self.config, self.registry, max_in_flight_seqs=max_in_flight_seqs, store=self.store)
            if self.enabled
            else None
        )
        # LightGBM loads its models with OpenMP: off this (the event loop's) thread, see headroom/openmp.py.
        self.predictor = in_passing_thread(load_predictor, self.config.predictor_path) if self.enabled else None
        c = self.config
        self.thresholds = ClassThresholds(
            c.short_max_prompt_tokens, c.short_max_output_tokens, c.long_min_prompt_tokens, c.long_min_output_tokens
        )
        self.records = RecordLog(c.record_log_path, c.record_log_max_lines) if c.record_log_path else None
        self.decision_times: list[float] = []  # bounded ring of recent decision costs (s)

    def tenant(self, request: web.Request) -> Tenant:
        header = request.headers.get("Authorization", "")
        key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
        if self.config.auth:
            tenant = self.registry.resolve(key)
            if tenant is None:
                raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
            return tenant
        registry = self.registry
        for header in ("X-Tenant", *FAIRNESS_HEADERS):
            if len(request.headers.get(header, "")) > MAX_TENANT_NAME:
                raise BadRequest(
                    f"{header} is longer than {MAX_TENANT_NAME} characters", param=header, code="invalid_tenant"
                )
        tenant = registry.by_api_key(key) if key else None
        if tenant is None and (name := request.headers.get("X-Tenant")):
            tenant = registry.get_or_add(name) if registry.auto else registry.get(name)
            if tenant is None:
                raise BadRequest(f"unknown tenant {name!r}", param="X-Tenant", code="unknown_tenant")
        if tenant is None and (name := _first(request, FAIRNESS_HEADERS)):
            tenant = registry.get_or_add(name) if registry.auto else registry.get(name)
        if tenant is None and key and registry.auto:
            tenant = registry.get_or_add("key-" + hashlib.sha256(key.encode()).hexdigest()[:12])
        return tenant or registry.default

    def tier(self, request: web.Request, tenant: Tenant) -> str:
        """The tier a request runs in: its gateway objective's, where the config maps that
        objective to one (with auth off, as the gateway's fairness id), else its tenant's."""
        objective = None if self.config.auth else _first(request, OBJECTIVE_HEADERS)
        return (objective and self.config.objective_tier(objective)) or tenant.config.tier

    def ttft_objective_s(self, request: web.Request) -> float | None:
        """The gateway's TTFT objective for the request, in seconds (with auth off, as its
        other headers: with auth on a client could use it to pass others of its tier)."""
        value = None if self.config.auth else request.headers.get(TTFT_OBJECTIVE_HEADER)
        if value is None:
            return None
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (0 < ms < math.inf):
            raise BadRequest(
                f"{TTFT_OBJECTIVE_HEADER} must be a positive number of milliseconds, got {value[:32]!r}",
                param=TTFT_OBJECTIVE_HEADER,
                code="invalid_ttft_objective",
            )
        return ms / 1000

    async def admit(
        self,
        tenant: Tenant,
        engine_requests: list[Request],
        messages: list[dict],
        tier: str | None = None,
        ttft_objective_s: float | None = None,
    ) -> Admitted:
        """Predict, classify and wait for admission; writes each request's admission record,
        once, however it ends.
        The n choices of one request share a prompt and parameters: one prediction, and
        one admission of n sequences at n times the cost (all or none, so that two
        requests can never each hold part of what both need). tier: the tier they run in
        (None: the tenant's). ttft_objective_s: the gateway's TTFT objective, which orders
        them within the tier, earliest first token due first.
        Raises an APIError (429 with Retry-After, 400, 503) when they may not run."""
        admitted = Admitted(tenant)
        config = tenant.config
        # The n choices arrived together; with admission off (FCFS) no objective orders them.
        due = None
        if ttft_objective_s is not None and self.admission is not None:
            due = engine_requests[0].arrival_time + ttft_objective_s
        record = AdmissionRecord(
            tenant.name,
            tier or config.tier,
            first_token_due=due,
            loop_policy=config.loop_policy,
            ladder=config.ladder,
        )
        if self.admission is None or self.predictor is None:
            _write(engine_requests, record)
            return admitted
        engine_request = engine_requests[0]
        started = time.perf_counter()
        sampling = engine_request.sampling
        features = RequestFeatures.from_messages(
            messages, engine_request.num_prompt_tokens, sampling.max_tokens, sampling.temperature, tenant.name
        )
        prediction = self.predictor.predict(features)
        # p50 classifies (p90 is max_tokens for most requests of a model that often runs to
        # the cap); p90 reserves, so a bucket is never short of what may really be used.
        size_class = classify(engine_request.num_prompt_tokens, prediction.p50, self.thresholds)
        admitted.decision_s = time.perf_counter() - started
        self._record_decision_time(admitted.decision_s)
        admitted.prediction, admitted.features = prediction, features
        record = dataclasses.replace(
            record,
            size_class=size_class,
            predicted_output_tokens=prediction.p50,
            predicted_output_tokens_p90=prediction.p90,
        )
        if size_class is SizeClass.LONG and self.long_pool_url:
            admitted.route = self.long_pool_url  # the long pool admits it by its own rules
            _write(engine_requests, dataclasses.replace(record, decision="route"))
            return admitted
        cost = engine_request.num_prompt_tokens + min(sampling.max_tokens, math.ceil(prediction.p90))
        n = len(engine_requests)
        try:
            ticket = await self.admission.acquire(
                tenant, cost * n, prompt_tokens=engine_request.num_prompt_tokens * n, seqs=n
            )
        except Rejected as exc:
            _write(engine_requests, dataclasses.replace(record, decision="reject"))
            raise _rejection_error(exc) from None
        admitted.ticket = ticket
        priority = self.config.priority(record.tier)
        for r in engine_requests:
            r.priority = r.priority._replace(tier=priority)  # outranks the request's own (contracts/request.py)
            deadline = None if self.config.deadline_s is None else r.arrival_time + self.config.deadline_s
            r.admission = dataclasses.replace(record, decision=ticket.decision, deadline=deadline)
        return admitted

    def settle(self, admitted: Admitted, engine_requests: list[Request], finish_reason: str | None) -> None:
        """Return the reservation with the tokens actually processed; safe to call twice."""
        prompt = output = 0
        device_s = 0.0
        for r in engine_requests:
            if r.first_scheduled_time is not None:  # ran
                prompt, output = prompt + r.num_prompt_tokens, output + r.num_output_tokens
                device_s += r.resources.device_time_s
        if admitted.ticket is not None and self.admission is not None:
            self.admission.settle(admitted.ticket, prompt, output, device_s)
        if self.records is not None and admitted.features is not None and finish_reason is not None:
            for r in engine_requests:
                if (labelled := label(r)) is not None:
                    self.records.append(admitted.features, admitted.prediction, r, *labelled)

    def _record_decision_time(self, seconds: float) -> None:
        self.decision_times.append(seconds)
        if len(self.decision_times) > 10_000:
            del self.decision_times[:5_000]


def _first(request: web.Request, headers: tuple[str, ...]) -> str | None:
    return next((value for name in headers if (value := request.headers.get(name))), None)


STORE_ENV = "HEADROOM_ADMISSION_STORE"


def _store(config: Config, registry: TenantRegistry) -> RedisStore | None:
    c = config.admission
    url = c.store or os.environ.get(STORE_ENV) or None
    if url is None:
        return None
    check_store_url(url, STORE_ENV if c.store is None else "admission.store")
    replica = c.replica_id or f"{socket.gethostname()}:{config.server.port}"
    return RedisStore(url, registry, replica_id=replica, fleet_size=c.fleet_size, lease_ttl_s=c.lease_ttl_s)


def _rejection_error(exc: Rejected) -> APIError:
    if exc.code == "too_large":
        return BadRequest(exc.reason, code="exceeds_tenant_capacity")
    if exc.code == "shutting_down":
        return Unavailable(exc.reason, code="draining", headers={"Retry-After": "5"})
    retry = max(1, math.ceil(min(exc.retry_after_s or 1, 3600)))  # never inf: it is a header
    return QueueFull(exc.reason, code=f"tenant_{exc.code}", headers={"Retry-After": str(retry)})


def _write(engine_requests: list[Request], record: AdmissionRecord) -> None:
    for r in engine_requests:
        r.admission = record
