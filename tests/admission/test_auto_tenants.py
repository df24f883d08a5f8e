"""Who a request belongs to with no tenant config: each API key, X-Tenant or gateway
fairness id gets a tenant of its own, with the default tenant's limits, so that one
user's requests never share a queue and a fair share with another's."""

from __future__ import annotations

import hashlib

import pytest
from aiohttp.test_utils import make_mocked_request

from headroom.admission.tenants import MAX_AUTO_TENANTS
from headroom.app.admission_gate import FAIRNESS_HEADER, OBJECTIVE_HEADER, TTFT_OBJECTIVE_HEADER, AdmissionGate
from headroom.app.errors import BadRequest
from headroom.config import AdmissionConfig, Config, TenantConfig
from headroom.contracts.request import Priority, Request, SamplingParams


def gate(**admission) -> AdmissionGate:
    return AdmissionGate(Config(admission=AdmissionConfig(enabled=False, **admission)), 8, 40_000)


def owner(g: AdmissionGate, headers: dict) -> str:
    return g.tenant(make_mocked_request("POST", "/v1/chat/completions", headers=headers)).name


def test_with_no_config_each_identity_gets_its_own_tenant_with_the_default_limits():
    g = gate()
    key_tenant = "key-" + hashlib.sha256(b"sk-alice").hexdigest()[:12]
    assert owner(g, {"Authorization": "Bearer sk-alice"}) == key_tenant  # the key itself is never a name
    assert owner(g, {"Authorization": "Bearer sk-bob"}) != key_tenant
    assert owner(g, {"X-Tenant": "web"}) == "web"
    assert owner(g, {FAIRNESS_HEADER: "team-a"}) == "team-a"
    assert owner(g, {"X-Tenant": "web", FAIRNESS_HEADER: "team-a"}) == "web"  # X-Tenant first
    assert owner(g, {}) == "default"
    default, web = g.registry.default, g.registry.get("web")
    assert web.config == TenantConfig(
        "web", **{k: v for k, v in vars(default.config).items() if k not in ("name", "api_keys")}
    )
    assert web.max_in_flight_tokens == default.max_in_flight_tokens == 40_000
    assert sorted(t.name for t in g.registry) == sorted(
        ["default", key_tenant, owner(g, {"Authorization": "Bearer sk-bob"}), "web", "team-a"]
    )


def test_auto_tenants_stop_at_their_bound_and_never_with_configured_tenants_or_auth():
    g = gate()
    for i in range(MAX_AUTO_TENANTS):
        assert owner(g, {"X-Tenant": f"t{i}"}) == f"t{i}"
    assert owner(g, {"X-Tenant": "one-too-many"}) == "default"
    assert len(g.registry) == MAX_AUTO_TENANTS + 1
    configured = gate(tenants=(TenantConfig("web"),), default_tenant="web")
    with pytest.raises(BadRequest) as caught:
        owner(configured, {"X-Tenant": "nobody"})
    assert (caught.value.status, caught.value.code) == (400, "unknown_tenant")
    assert owner(configured, {FAIRNESS_HEADER: "nobody", "Authorization": "Bearer sk-x"}) == "web"
    assert (
        owner(
            gate(auto_tenants=True, tenants=(TenantConfig("web"),), default_tenant="web"), {FAIRNESS_HEADER: "team-b"}
        )
        == "team-b"
    )
    with pytest.raises(BadRequest) as caught:
        owner(g, {"X-Tenant": "x" * 129})
    assert (caught.value.status, caught.value.param) == (400, "X-Tenant")


# ---- the gateway's objective: the tier a request runs in -----------------------------------


def tier(g: AdmissionGate, headers: dict) -> str:
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    return g.tier(request, g.tenant(request))


def test_the_gateway_objective_names_the_tier_the_config_maps_it_to():
    g = gate(objectives={"interactive": "premium", "batch-sheddable": "batch"})
    assert tier(g, {FAIRNESS_HEADER: "team-a", OBJECTIVE_HEADER: "interactive"}) == "premium"
    assert tier(g, {OBJECTIVE_HEADER: "batch-sheddable"}) == "batch"
    assert tier(g, {OBJECTIVE_HEADER: "no-such-objective"}) == "standard"  # the tenant's own
    assert tier(g, {}) == "standard"
    # llm-d's router names both headers its own way first, the Inference Extension's after.
    both = {"x-llm-d-inference-objective": "batch-sheddable", OBJECTIVE_HEADER: "interactive"}
    assert tier(g, both) == "batch"
    llm_d = {"x-llm-d-inference-fairness-id": "team-c", FAIRNESS_HEADER: "team-d"}
    assert owner(g, llm_d) == "team-c"
    # With auth on, the API key alone says who is asking and in which tier.
    keyed = gate(
        auth=True,
        tenants=(TenantConfig("acme", api_keys=("sk-acme",)),),
        default_tenant="acme",
        objectives={"interactive": "premium"},
    )
    key = {"Authorization": "Bearer sk-acme"}
    assert tier(keyed, {**key, OBJECTIVE_HEADER: "interactive"}) == "standard"
    assert owner(keyed, {**key, FAIRNESS_HEADER: "team-a"}) == "acme"


@pytest.mark.asyncio
async def test_the_objectives_tier_is_the_priority_the_engine_gets():
    g = AdmissionGate(Config(admission=AdmissionConfig(objectives={"sheddable": "batch"})), 8, 40_000)
    cases = (({OBJECTIVE_HEADER: "sheddable"}, ("batch", Priority(tier=0))), ({}, ("standard", Priority(tier=1))))
    for headers, expected in cases:
        request = make_mocked_request("POST", "/v1/completions", headers=headers)
        tenant = g.tenant(request)
        engine_request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        admitted = await g.admit(tenant, [engine_request], [{"role": "user", "content": "hi"}], g.tier(request, tenant))
        assert (engine_request.tier, engine_request.priority) == expected
        g.settle(admitted, [engine_request], None)


# ---- the gateway's TTFT objective: the order within the tier --------------------------------


@pytest.mark.asyncio
async def test_the_ttft_objective_header_sets_when_the_first_token_is_due():
    request = make_mocked_request("POST", "/v1/completions", headers={TTFT_OBJECTIVE_HEADER: "250"})
    for g, due in ((AdmissionGate(Config(), 8, 40_000), 100.25), (gate(), None)):  # admission on, then off (FCFS)
        assert g.ttft_objective_s(request) == 0.25
        engine_request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=100.0)
        admitted = await g.admit(g.tenant(request), [engine_request], [{"role": "user", "content": "hi"}], None, 0.25)
        assert engine_request.admission.first_token_due == due
        g.settle(admitted, [engine_request], None)
    g = gate()
    assert g.ttft_objective_s(make_mocked_request("POST", "/v1/completions")) is None
    for bad in ("soon", "0", "-5", "inf", "nan", ""):
        with pytest.raises(BadRequest) as caught:
            g.ttft_objective_s(make_mocked_request("POST", "/v1/completions", headers={TTFT_OBJECTIVE_HEADER: bad}))
        error = caught.value
        assert (error.status, error.param, error.code) == (400, TTFT_OBJECTIVE_HEADER, "invalid_ttft_objective")
        assert error.message == f"x-llm-d-slo-ttft-ms must be a positive number of milliseconds, got {bad!r}"
    # With auth on, the API key alone says how a request is served: the header is ignored.
    keyed = gate(auth=True, tenants=(TenantConfig("acme", api_keys=("sk-acme",)),), default_tenant="acme")
    headers = {"Authorization": "Bearer sk-acme", TTFT_OBJECTIVE_HEADER: "soon"}
    assert keyed.ttft_objective_s(make_mocked_request("POST", "/v1/completions", headers=headers)) is None
