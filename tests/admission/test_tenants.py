from __future__ import annotations

import math
import random

import pytest

from headroom.admission.tenants import BUSY_RETRY_AFTER_S, TenantBucket, TenantRegistry
from headroom.config import AdmissionConfig, ConfigError, TenantConfig


def bucket(clock, rate=1000.0, burst=4000, cap=10000) -> TenantBucket:
    return TenantBucket(rate, burst, cap, now=clock)


def test_bucket_starts_full_and_refills_up_to_burst(clock):
    b = bucket(clock)
    assert b.level == 4000 and b.in_flight == 0
    b.reserve(3000)
    assert b.level == 1000 and b.in_flight == 3000
    clock.advance(1.5)
    assert b.level == 2500
    clock.advance(10)
    assert b.level == 4000


def test_can_admit_needs_the_cost_or_a_full_bucket(clock):
    b = bucket(clock)
    b.reserve(3000)
    assert b.can_admit(1000) and not b.can_admit(1001)
    clock.advance(3)
    # More than the burst goes when the bucket is full, and leaves a debt.
    assert b.can_admit(6000)
    b.reserve(6000)
    assert b.level == -2000 and b.in_flight == 9000
    assert b.retry_after_s(2000) == 4.0


def test_settle_refunds_unused_and_charges_overuse(clock):
    b = bucket(clock)
    b.reserve(3000)
    b.settle(3000, 1200)
    assert b.level == 2800 and b.in_flight == 0
    b.reserve(2000)
    b.settle(2000, 2800)
    assert b.level == 0 and b.in_flight == 0
    b.reserve(500)
    b.settle(500, 2000)
    assert b.level == -2000  # debt
    assert not b.can_admit(1)
    assert b.retry_after_s(1000) == 3.0


def test_settle_never_lifts_the_level_above_burst(clock):
    b = bucket(clock)
    b.reserve(1000)
    clock.advance(5)
    b.settle(1000, 0)
    assert b.level == 4000


def test_retry_after(clock):
    b = bucket(clock, rate=1000.0, burst=4000, cap=5000)
    assert b.retry_after_s(4000) == 0.0
    b.reserve(4000)
    assert b.retry_after_s(500) == 0.5  # refill only
    assert b.retry_after_s(2000) == 2.0  # refill and in-flight: the longer
    clock.advance(4)
    assert b.can_admit(1000) and not b.can_admit(1001)
    assert b.retry_after_s(2000) == BUSY_RETRY_AFTER_S  # in-flight only
    assert not b.fits_ever(5001) and b.fits_ever(5000)
    assert b.retry_after_s(5001) == math.inf


def test_in_flight_cap_is_never_exceeded(clock):
    rng = random.Random(7)
    b = bucket(clock, rate=5000.0, burst=3000, cap=6000)
    held: list[int] = []
    for _ in range(2000):
        clock.advance(rng.random() * 0.2)
        if held and rng.random() < 0.4:
            cost = held.pop(rng.randrange(len(held)))
            b.settle(cost, rng.randint(0, 2 * cost))
        else:
            cost = rng.randint(1, 4000)
            if b.can_admit(cost):
                b.reserve(cost)
                held.append(cost)
        assert b.in_flight == sum(held) <= 6000
        assert b.level <= 3000


def test_configure_keeps_what_accrued_at_the_old_rate(clock):
    b = bucket(clock, rate=1000.0, burst=4000)
    b.reserve(4000)
    clock.advance(1)
    b.configure(rate_tokens_per_s=100.0, burst_tokens=500, max_in_flight_tokens=8000)
    assert b.level == 500  # 1000 accrued, cut to the new burst
    b.reserve(1000)
    clock.advance(2)
    assert b.level == -300
    assert b.max_in_flight_tokens == 8000


def test_clock_going_backwards_refills_nothing(clock):
    b = bucket(clock)
    b.reserve(4000)
    clock.advance(-5)
    assert b.level == 0
    clock.advance(6)
    assert b.level == 1000


def registry(clock, **kw) -> TenantRegistry:
    tenants = (
        TenantConfig("default"),
        TenantConfig("acme", tier="premium", api_keys=("sk-acme-1", "sk-acme-2"), rate_tokens_per_s=500.0),
        TenantConfig("night", tier="batch", api_keys=("sk-night",)),
    )
    return TenantRegistry(AdmissionConfig(tenants=tenants, **kw), now=clock)


def test_registry_lookup(clock):
    reg = registry(clock)
    assert [t.name for t in reg] == ["default", "acme", "night"] and len(reg) == 3
    assert reg.by_api_key("sk-acme-2").name == "acme"
    assert reg.by_api_key("sk-night").name == "night"
    assert reg.by_api_key("sk-acme") is None and reg.by_api_key("") is None
    assert reg.get("acme").bucket.rate == 500.0 and reg.get("nobody") is None
    assert reg.default.name == "default"
    assert [t.priority for t in reg] == [1, 2, 0]


def test_resolve_with_and_without_auth(clock):
    open_reg = registry(clock)
    assert open_reg.resolve(None).name == "default"
    assert open_reg.resolve("sk-unknown").name == "default"
    assert open_reg.resolve("sk-night").name == "night"
    closed = registry(clock, auth=True)
    assert closed.resolve(None) is None and closed.resolve("sk-unknown") is None
    assert closed.resolve("sk-acme-1").name == "acme"


def test_live_update(clock):
    reg = registry(clock)
    acme = reg.get("acme")
    acme.bucket.reserve(10000)
    assert (
        reg.update("acme", tier="batch", rate_tokens_per_s=1000.0, burst_tokens=2000, max_in_flight_tokens=12000)
        is acme
    )
    assert acme.priority == 0 and acme.config.tier == "batch" and acme.config.burst_tokens == 2000
    assert acme.bucket.in_flight == 10000 and acme.bucket.level == 2000
    assert acme.config.api_keys == ("sk-acme-1", "sk-acme-2")
    with pytest.raises(ConfigError, match="unknown tier 'gold'"):
        reg.update("acme", tier="gold")
    with pytest.raises(ConfigError, match="rate_tokens_per_s must be > 0"):
        reg.update("acme", rate_tokens_per_s=0.0)
    assert acme.config.tier == "batch" and acme.bucket.rate == 1000.0  # failed updates change nothing
    with pytest.raises(KeyError):
        reg.update("nobody", burst_tokens=1)
