"""Tenants as admission sees them: a token bucket per tenant (rate, burst and a cap on
reserved in-flight tokens), the tenant's wait queue and fair-share counter, and the
registry that finds a tenant by API key or name and takes live limit updates.

All times come from an injectable clock, so tests drive the buckets without sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from headroom.config import AdmissionConfig, TenantConfig

# Retry hint when a request is held back by something other than the refill rate
# (the tenant's in-flight cap, the global limit): that frees up as requests finish.
BUSY_RETRY_AFTER_S = 1.0
# A tenant's in-flight cap where neither its config nor the engine's capacity sets one.
UNCAPPED = 2**62
MAX_AUTO_TENANTS = 1024  # tenants made on first sight, beyond which the default tenant serves


def _digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


class TenantBucket:
    """Tokens refill continuously at `rate` up to `burst`. A request reserves its cost
    on admission and settles it when done: the unused part comes back, overuse is
    charged, so the level can go negative (debt) and must refill before the next one."""

    def __init__(
        self,
        rate_tokens_per_s: float,
        burst_tokens: int,
        max_in_flight_tokens: int,
        now: Callable[[], float] = time.monotonic,
    ):
        self._now = now
        self.rate = rate_tokens_per_s
        self.burst = burst_tokens
        self.max_in_flight_tokens = max_in_flight_tokens
        self._level = float(burst_tokens)
        self._in_flight = 0
        self._stamp = now()

    def _refill(self) -> None:
        t = self._now()
        if t > self._stamp:
            self._level = min(self.burst, self._level + (t - self._stamp) * self.rate)
            self._stamp = t

    def now(self) -> float:
        return self._now()

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def fits_ever(self, cost: int) -> bool:
        return cost <= self.max_in_flight_tokens

    def can_admit(self, cost: int) -> bool:
        # A request bigger than the burst goes when the bucket is full and leaves a debt.
        return self.level >= min(cost, self.burst) and self._in_flight + cost <= self.max_in_flight_tokens

    def reserve(self, cost: int) -> None:
        self._refill()
        self._level -= cost
        self._in_flight += cost

    def settle(self, reserved: int, actual: int) -> None:
        self._refill()
        self._in_flight -= reserved
        self._level = min(self.burst, self._level + reserved - actual)

    def refill_to_burst(self) -> None:
        self._refill()
        self._level = float(self.burst)

    def retry_after_s(self, cost: int) -> float:
        """Seconds until `cost` could be admitted as far as this bucket knows: the refill
        time, at least BUSY_RETRY_AFTER_S when the in-flight cap blocks, inf if never."""
        if not self.fits_ever(cost):
            return math.inf
        wait = max(0.0, (min(cost, self.burst) - self.level) / self.rate)
        if self._in_flight + cost > self.max_in_flight_tokens:
            wait = max(wait, BUSY_RETRY_AFTER_S)
        return wait

    def configure(self, rate_tokens_per_s: float, burst_tokens: int, max_in_flight_tokens: int) -> None:
        self._refill()  # what accrued so far accrued at the old rate
        self.rate = rate_tokens_per_s
        self.burst = burst_tokens
        self.max_in_flight_tokens = max_in_flight_tokens
        self._level = min(self._level, burst_tokens)


@dataclass(eq=False)
class Waiter:
    """One request waiting in its tenant's queue; `future` gets its Ticket or Rejected."""

    cost: int
    prompt_tokens: int
    enqueued_at: float
    expires_at: float
    future: asyncio.Future
    # Admissible the moment it arrived, so only the shared store's answer stood between
    # it and a ticket: it counts as admitted at once unless the store refuses it.
    direct: bool = False
    seqs: int = 1  # global slots it needs
    # With a shared store: its key among the tenant's waiters there, from its first ask
    # on, and whether it is registered there now (refused, and not forgotten since).
    key: str | None = None
    registered: bool = False


@dataclass(eq=False)
class Tenant:
    config: TenantConfig
    bucket: TenantBucket
    priority: int
    # The whole in-flight cap, before a fleet replica's share (the bucket holds the share).
    max_in_flight_tokens: int = UNCAPPED
    # How long a queued request that does not fit may be passed by ones that do.
    backfill_max_wait_s: float = 0.0
    # Virtual token counter: weighted service received (see fair_queue.py).
    vtc: float = 0.0
    device_s: float = 0.0  # engine seconds its settled requests took
    queue: deque[Waiter] = field(default_factory=deque)
    # With a shared store: the head is being reserved fleet-wide now, or was refused
    # there and may be asked again only from hold_until on.
    confirming: bool = False
    hold_until: float = 0.0

    @property
    def name(self) -> str:
        return self.config.name

    def head_free(self) -> bool:
        """Nothing of this tenant's is being reserved fleet-wide, nor held back by a refusal."""
        return not self.confirming and self.bucket.now() >= self.hold_until

    def next_waiter(self) -> Waiter | None:
        """The queued request to admit next, if any can go now: the first one that fits,
        where every one before it that does not has waited less than backfill_max_wait_s
        (one that has waited longer is passed by nobody, so it cannot starve)."""
        if not self.head_free():
            return None
        now = self.bucket.now()
        for waiter in self.queue:
            if self.bucket.can_admit(waiter.cost):
                return waiter
            if now - waiter.enqueued_at >= self.backfill_max_wait_s:
                return None
        return None

    def may_pass_queue(self) -> bool:
        """May a new request that fits go ahead of everything queued? Only where none of
        it has waited backfill_max_wait_s (what is queued does not fit, or it would have
        been admitted)."""
        now = self.bucket.now()
        return all(now - w.enqueued_at < self.backfill_max_wait_s for w in self.queue)


class TenantRegistry:
    """The live tenants. Built from AdmissionConfig; after that, updates made here are the
    truth (the frozen config keeps the start-up values)."""

    def __init__(
        self, config: AdmissionConfig, now: Callable[[], float] = time.monotonic, capacity_tokens: int | None = None
    ):
        """capacity_tokens: what the engine's KV cache holds, the in-flight cap of a
        tenant whose config sets none (None: uncapped)."""
        self.config = config
        self.capacity_tokens = capacity_tokens if capacity_tokens is not None else UNCAPPED
        self._now = now
        self._auto_made = 0
        # The fraction of every configured budget this replica may use on its own (a
        # fleet without its shared store falls back to 1 / fleet_size).
        self.share = 1.0
        self._tenants: dict[str, Tenant] = {}
        self._keys: list[tuple[bytes, Tenant]] = []
        for tc in config.tenants:
            cap = self._cap(tc)
            bucket = TenantBucket(tc.rate_tokens_per_s, tc.burst_tokens, cap, now)
            tenant = Tenant(tc, bucket, config.priority(tc.tier), cap, config.backfill_max_wait_s)
            self._tenants[tc.name] = tenant
            self._keys.extend((_digest(key), tenant) for key in tc.api_keys)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    @property
    def auto(self) -> bool:
        """Are unknown identities given tenants of their own (AdmissionConfig.auto_tenants)?"""
        c = self.config
        if c.auth:
            return False
        return c.auto_tenants if c.auto_tenants is not None else [t.name for t in c.tenants] == ["default"]

    def get_or_add(self, name: str) -> Tenant:
        """The tenant called `name`, made on first sight with the default tenant's limits
        (the default tenant itself once MAX_AUTO_TENANTS have been made)."""
        tenant = self._tenants.get(name)
        if tenant is not None:
            return tenant
        if self._auto_made >= MAX_AUTO_TENANTS:
            return self.default
        self._auto_made += 1
        config = dataclasses.replace(self.default.config, name=name, api_keys=())
        cap = self._cap(config)
        bucket = TenantBucket(config.rate_tokens_per_s, config.burst_tokens, cap, self._now)
        tenant = self._tenants[name] = Tenant(
            config, bucket, self.config.priority(config.tier), cap, self.config.backfill_max_wait_s
        )
        self._configure(tenant)  # a fleet replica's share applies to it too
        return tenant

    @property
    def default(self) -> Tenant:
        return self._tenants[self.config.default_tenant]

    def by_api_key(self, api_key: str) -> Tenant | None:
        # Compare equal-length digests against every key, without stopping at a match, so
        # timing says nothing about which keys exist or how long they are.
        given = _digest(api_key)
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(key, given):
                found = tenant
        return found

    def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant a request belongs to; None means unauthorised (auth on, key unknown)."""
        tenant = self.by_api_key(api_key) if api_key else None
        if tenant is None and not self.config.auth:
            return self.default
        return tenant

    def update(
        self,
        name: str,
        *,
        tier: str | None = None,
        rate_tokens_per_s: float | None = None,
        burst_tokens: int | None = None,
        max_in_flight_tokens: int | None = None,
    ) -> Tenant:
        """Change a tenant's limits in place; waiting and in-flight requests keep their
        reservations. Raises KeyError for an unknown tenant, ConfigError for bad values.
        Call Admission.pump() afterwards so raised limits admit waiters at once."""
        tenant = self._tenants[name]
        changes = {
            k: v
            for k, v in (
                ("tier", tier),
                ("rate_tokens_per_s", rate_tokens_per_s),
                ("burst_tokens", burst_tokens),
                ("max_in_flight_tokens", max_in_flight_tokens),
            )
            if v is not None
        }
        new = dataclasses.replace(tenant.config, **changes)  # validates
        priority = self.config.priority(new.tier)
        tenant.config = new
        tenant.priority = priority
        self._configure(tenant)
        return tenant

    def set_share(self, share: float) -> None:
        """Scale every tenant's bucket to `share` of its configured limits."""
        self.share = share
        for tenant in self:
            self._configure(tenant)

    def _cap(self, config: TenantConfig) -> int:
        return config.max_in_flight_tokens if config.max_in_flight_tokens is not None else self.capacity_tokens

    def _configure(self, tenant: Tenant) -> None:
        c, share = tenant.config, self.share
        tenant.max_in_flight_tokens = self._cap(c)
        tenant.bucket.configure(
            c.rate_tokens_per_s * share,
            max(1, int(c.burst_tokens * share)),
            max(1, int(tenant.max_in_flight_tokens * share)),
        )
