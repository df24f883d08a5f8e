from __future__ import annotations

import asyncio

import pytest

from headroom.admission.fair_queue import FairQueue
from headroom.admission.tenants import Tenant, TenantRegistry, Waiter
from headroom.config import AdmissionConfig, TenantConfig


def tenants(clock, *names: str) -> TenantRegistry:
    config = AdmissionConfig(
        tenants=tuple(TenantConfig(n, rate_tokens_per_s=1000.0, burst_tokens=1000) for n in names),
        default_tenant=names[0],
    )
    return TenantRegistry(config, now=clock)


def enqueue(tenant: Tenant, cost: int) -> None:
    future = asyncio.get_running_loop().create_future()
    tenant.queue.append(Waiter(cost, 0, 0.0, 1e9, future))


def test_charge_is_weighted(clock):
    reg = tenants(clock, "a")
    fq = FairQueue(prompt_weight=1.0, output_weight=2.0)
    a = reg.get("a")
    fq.charge(a, 100, 50)
    assert a.vtc == 200
    fq.charge(a, -20, -10)  # a correction
    assert a.vtc == 160


def test_settle_charges_engine_seconds_at_the_engines_rate(clock):
    # Both tenants' requests had 100 prompt and 100 output tokens (300 weighted), estimated
    # at admission as 100 prompt and 150 output tokens (400 weighted). Chat's took 1 engine
    # second; reasoning's, deep in long contexts, 3 each. The first settle teaches the rate
    # (300 weighted tokens an engine second); after that a request is charged its engine
    # seconds at that rate.
    reg = tenants(clock, "chat", "reasoning")
    fq = FairQueue(prompt_weight=1.0, output_weight=2.0)
    chat, reasoning = reg.get("chat"), reg.get("reasoning")
    for t in (chat, reasoning):
        fq.charge(t, 100, 150)
    fq.settle(chat, (100, 150), (100, 100), 1.0)
    assert chat.vtc == 300 and fq.tokens_per_device_s == 300 and chat.device_s == 1.0
    fq.settle(reasoning, (100, 150), (100, 100), 3.0)
    assert reasoning.vtc == 900 and reasoning.device_s == 3.0
    assert fq.tokens_per_device_s == pytest.approx(300 + 0.05 * (100 - 300))  # its own rate, 100, folded in
    tokens_only = FairQueue(prompt_weight=1.0, output_weight=2.0, device=False)
    t = reg.get("chat")
    t.vtc = 0.0
    tokens_only.settle(t, (100, 150), (100, 100), 3.0)
    assert t.vtc == 300 - 400 and tokens_only.tokens_per_device_s is None  # the tokens' correction alone


@pytest.mark.asyncio
async def test_next_tenant_is_the_smallest_counter_with_an_admissible_head(clock):
    reg = tenants(clock, "a", "b", "c")
    a, b, c = reg.get("a"), reg.get("b"), reg.get("c")
    fq = FairQueue()
    assert fq.next_tenant(reg) is None  # nobody waits
    a.vtc, b.vtc, c.vtc = 300.0, 100.0, 200.0
    for t in (a, b, c):
        enqueue(t, 500)
    assert fq.next_tenant(reg) is b
    # b's own bucket holds it back: the slot goes to the next smallest (work-conserving).
    b.bucket.reserve(800)
    assert fq.next_tenant(reg) is c
    c.vtc = 300.0
    assert fq.next_tenant(reg) is a  # tie with c: name order
    assert fq.next_tenant([c]) is c  # only the candidates given


@pytest.mark.asyncio
async def test_lift_to_the_smallest_backlogged_counter(clock):
    reg = tenants(clock, "a", "b", "c")
    a, b, c = reg.get("a"), reg.get("b"), reg.get("c")
    fq = FairQueue()
    a.vtc, b.vtc = 5000.0, 3000.0
    enqueue(a, 100)
    enqueue(b, 100)
    fq.lift(c, reg)  # c was idle at 0: it banks nothing
    assert c.vtc == 3000.0
    c.vtc = 4000.0
    fq.lift(c, reg)  # never lowered
    assert c.vtc == 4000.0


@pytest.mark.asyncio
async def test_lift_with_nobody_backlogged_uses_the_last_drained_tenant(clock):
    reg = tenants(clock, "a", "b")
    a, b = reg.get("a"), reg.get("b")
    fq = FairQueue()
    a.vtc = 9000.0
    fq.lift(b, reg)
    assert b.vtc == 0.0  # nothing to compare with yet
    fq.drained(a)
    a.vtc = 9500.0  # a kept being served after it left the queue
    fq.lift(b, reg)
    assert b.vtc == 9500.0
