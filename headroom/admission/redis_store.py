"""Tenant budgets shared by a fleet of replicas, in Redis.

Each tenant has four keys: a hash with the bucket (level, stamp, in_flight), a sorted
set of leases by expiry, a hash of lease costs, and a hash of its waiters across the
fleet. Every change is one Lua script, so it is atomic on the server: reserve (check +
charge + lease), settle (return the lease, refund what was reserved and not used), and
sync (renew this replica's live leases, add the ones Redis does not know, drop the ones
this replica no longer holds). Every script first reclaims expired leases, so the
reservations of a replica that died come back within the lease TTL. Times are Redis's
own clock (TIME), never a replica's.

A tenant's queue is one queue across the fleet. A replica asks for its queue's head
only, and a refused head stays registered among the tenant's waiters under a key of its
own (since when it waits, its cost, and until when it counts as alive: WAITER_TTL_S past
the retry its refusal hinted; each grant is a new lease all the same, so that a sync's
snapshot never mistakes it for an old one). A reserve is granted only when no older
waiter would fit now (or has waited backfill_max_wait_s, when nobody passes it), as one
replica's queue admits. So the replica whose request settles cannot take the freed
place back for its own queue while another replica's request has waited longer: it goes
to that one at its next retry. A waiter that leaves unserved, or cannot ask when due, is
forgotten at once; one whose replica died lapses.

The replica keeps its live leases here and syncs them every ttl/3. While Redis cannot
be reached it is `available = False`: admission then runs on the local buckets scaled
to this replica's share (1 / fleet_size) of every budget, and this store pings Redis;
once it answers, one sync makes Redis's counters equal what is really in flight (the
leases granted locally meanwhile are added, the ones settled meanwhile dropped) before
shared admission resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from headroom.admission.tenants import Tenant, TenantRegistry

log = logging.getLogger("headroom.admission.store")

# How long past its retry's due time a refused waiter stays in its tenant's fleet-wide
# queue without asking again: what a replica that died holds the others back at most.
WAITER_TTL_S = 2.0
# How soon the tenant's oldest waiter in the fleet asks again while it waits for a place:
# the place freed on another replica stays idle until it does.
FIRST_RETRY_S = 0.01

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function reclaim(now)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  if #expired == 0 then return end
  local freed = 0
  for _, id in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', KEYS[3], id) or 0)
    redis.call('HDEL', KEYS[3], id)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('HINCRBY', KEYS[1], 'in_flight', -freed)
end
local function refill(now, rate, burst)
  local s = redis.call('HMGET', KEYS[1], 'level', 'stamp')
  local level, stamp = tonumber(s[1]), tonumber(s[2])
  if level == nil then return burst, now end
  if now > stamp then
    level = math.min(burst, level + (now - stamp) / 1000 * rate)
    stamp = now
  end
  return level, stamp
end
"""

# ARGV: cost, rate, burst, max_in_flight, lease, ttl_ms, waiter (its key among the tenant's
# waiters: the same on every retry, where the lease is new each time), waited_ms,
# backfill_ms, waiter_ttl_ms -> {granted, wait_ms, in_flight, first (no older waiter goes ahead)}
RESERVE = (
    _PRELUDE
    + """
local now = now_ms()
reclaim(now)
local cost, rate, burst, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local level, stamp = refill(now, rate, burst)
local in_flight = tonumber(redis.call('HGET', KEYS[1], 'in_flight') or 0)
if redis.call('ZSCORE', KEYS[2], ARGV[5]) then return {1, 0, in_flight, 1} end  -- a resend: granted already
local function fits(c) return level >= math.min(c, burst) and in_flight + c <= cap end
-- An older waiter of this tenant, on any replica, goes first where it fits now, or where
-- it has waited the backfill bound (then nobody passes it); lapsed waiters are dropped.
local waiter, since, backfill = ARGV[7], now - tonumber(ARGV[8]), tonumber(ARGV[9])
local ahead = false
local waiters = redis.call('HGETALL', KEYS[4])
for i = 1, #waiters, 2 do
  local t, c, alive = string.match(waiters[i + 1], '^(%d+):(%d+):(%d+)$')
  t, c, alive = tonumber(t), tonumber(c), tonumber(alive)
  if alive < now then
    redis.call('HDEL', KEYS[4], waiters[i])
  elseif waiters[i] ~= waiter and t < since and (fits(c) or now - t >= backfill) then
    ahead = true
  end
end
if not ahead and fits(cost) then
  redis.call('HSET', KEYS[1], 'level', level - cost, 'stamp', stamp, 'in_flight', in_flight + cost)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('HSET', KEYS[3], ARGV[5], cost)
  redis.call('HDEL', KEYS[4], waiter)
  return {1, 0, in_flight + cost, 1}
end
redis.call('HSET', KEYS[1], 'level', level, 'stamp', stamp, 'in_flight', in_flight)
local wait = 0
if level < math.min(cost, burst) then wait = math.ceil((math.min(cost, burst) - level) / rate * 1000) end
redis.call('HSET', KEYS[4], waiter, string.format('%d:%d:%d', since, cost, now + wait + tonumber(ARGV[10])))
if ahead then return {0, wait, in_flight, 0} end
return {0, wait, in_flight, 1}
"""
)

# ARGV: lease, refund ('' when the lease was granted locally and never charged here),
# rate, burst -> 1 if the lease was still held, else 0
SETTLE = (
    _PRELUDE
    + """
local now = now_ms()
reclaim(now)
local cost = redis.call('HGET', KEYS[3], ARGV[1])
if cost then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'in_flight', -tonumber(cost))
end
if ARGV[2] ~= '' then
  local burst = tonumber(ARGV[4])
  local level, stamp = refill(now, tonumber(ARGV[3]), burst)
  redis.call('HSET', KEYS[1], 'level', math.min(burst, level + tonumber(ARGV[2])), 'stamp', stamp)
end
if cost then return 1 end
return 0
"""
)

# ARGV: this replica's lease prefix, its run's epoch, the watermark (its leases of this
# run numbered from it on were granted after the caller's snapshot: left alone), ttl_ms,
# mode ("add": put back live leases Redis lacks, after a loss; "renew": only extend the
# ones it has, so a lease settled meanwhile is not put back), the count of leases being
# reserved now (left alone), those ids, then (lease, cost) pairs of the live ones
# -> in_flight
SYNC = (
    _PRELUDE
    + """
local now = now_ms()
reclaim(now)
local prefix, epoch, watermark, ttl, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local npending = tonumber(ARGV[6])
local keep = {}
for i = 7, 6 + npending do keep[ARGV[i]] = true end
local live = {}
for i = 7 + npending, #ARGV, 2 do live[ARGV[i]] = tonumber(ARGV[i + 1]) end
local delta = 0
for _, id in ipairs(redis.call('HKEYS', KEYS[3])) do
  if string.sub(id, 1, #prefix) == prefix and live[id] == nil and not keep[id] then
    local run, n = string.match(string.sub(id, #prefix + 1), "^([^.]+)%.(%d+)$")
    if run ~= epoch or tonumber(n) < watermark then
      delta = delta - tonumber(redis.call('HGET', KEYS[3], id))
      redis.call('HDEL', KEYS[3], id)
      redis.call('ZREM', KEYS[2], id)
    end
  end
end
for id, cost in pairs(live) do
  if mode == "add" then
    if redis.call('ZADD', KEYS[2], now + ttl, id) == 1 then
      redis.call('HSET', KEYS[3], id, cost)
      delta = delta + cost
    end
  else
    redis.call('ZADD', KEYS[2], 'XX', now + ttl, id)
  end
end
return redis.call('HINCRBY', KEYS[1], 'in_flight', delta)
"""
)


class StoreUnavailable(Exception):
    """Redis could not be reached; admission falls back to local shares."""


@dataclass
class Lease:
    tenant: str
    cost: int


@dataclass
class StoreStats:
    kind: str  # "embedded" or "redis"
    available: bool
    fallbacks: int  # times Redis was lost
    errors: int  # failed round trips
    leases: int  # live leases this replica holds
    reason: str | None  # why it is unavailable


class RedisStore:
    def __init__(
        self,
        url: str,
        registry: TenantRegistry,
        *,
        replica_id: str,
        fleet_size: int,
        lease_ttl_s: float = 10.0,
        timeout_s: float = 0.5,
        prefix: str = "headroom",
    ):
        self.url = url
        self.registry = registry
        self.replica_id = replica_id
        self.fleet_size = fleet_size
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.prefix = prefix
        # No retries: a lost Redis is handled by falling back, at once.
        self.client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._reserve = self.client.register_script(RESERVE)
        self._settle = self.client.register_script(SETTLE)
        self._sync = self.client.register_script(SYNC)
        self.live: dict[str, Lease] = {}
        self.pending: set[str] = set()  # reserves sent, answer not yet back
        self._next_id = 0
        self._next_waiter = 0
        self._epoch = f"{time.time_ns():x}"
        self.available = False
        self.reason: str | None = "not connected yet"
        self.fallbacks = 0
        self.errors = 0

    # --- the three atomic operations --------------------------------------------

    async def reserve(self, tenant: Tenant, cost: int, waiter: str, waited_s: float = 0.0) -> str | float:
        """Check and charge `cost` for `tenant` fleet-wide, for a request that has waited
        `waited_s` in this replica's queue as `waiter` (new_waiter(); the same on every
        retry: its place among the tenant's waiters while refused). Returns the lease id
        when granted, else the seconds until a retry may succeed (0: unknown, a place
        must be freed first; FIRST_RETRY_S for the fleet's oldest waiter, which takes it).
        Raises StoreUnavailable."""
        lease = self._new_lease()
        c = tenant.config
        self.pending.add(lease)
        try:
            granted, wait_ms, _, first = await self._call(
                self._reserve,
                tenant.name,
                cost,
                c.rate_tokens_per_s,
                c.burst_tokens,
                tenant.max_in_flight_tokens,
                lease,
                self.lease_ttl_ms,
                waiter,
                int(waited_s * 1000),
                int(tenant.backfill_max_wait_s * 1000),
                int(WAITER_TTL_S * 1000),
            )
            if granted:
                self.live[lease] = Lease(tenant.name, cost)
                return lease
            if first and not wait_ms:  # next in the fleet: it takes the next place freed
                return FIRST_RETRY_S
            return wait_ms / 1000
        finally:
            self.pending.discard(lease)

    async def forget(self, tenant: str, waiter: str) -> None:
        """Take a waiter out of the tenant's fleet-wide queue (it left unserved, or cannot
        ask now), so that it holds nobody back until it would lapse."""
        if not self.available:
            return
        try:
            await self.client.hdel(self._keys(tenant)[3], waiter)
        except RedisError as exc:  # the entry lapses by its TTL
            self._lost(exc)

    def hold_locally(self, tenant: Tenant, cost: int) -> str:
        """A lease for a reservation made on the local share while Redis is away; the
        sync on recovery adds it to the fleet's count (without charging the bucket)."""
        lease = self._new_lease()
        self.live[lease] = Lease(tenant.name, cost)
        return lease

    async def settle(self, lease: str, reserved: int, used: int, charged: bool) -> None:
        """Return `lease`; refund `reserved - used` to the bucket when it was charged
        there. Without Redis, the lease is dropped by the sync on recovery (or expires)."""
        held = self.live.pop(lease, None)
        if held is None or not self.available:
            return
        tenant = self.registry.get(held.tenant)
        c = tenant.config if tenant is not None else None
        refund = str(reserved - used) if charged else ""
        with contextlib.suppress(StoreUnavailable):
            await self._call(
                self._settle, held.tenant, lease, refund, c.rate_tokens_per_s if c else 1, c.burst_tokens if c else 0
            )

    async def sync(self, add: bool = False) -> None:
        """Renew this replica's leases for every tenant in one pipelined round trip, and
        drop the ones it no longer holds; with `add`, also put back the live ones Redis
        lacks (after a loss). Raises StoreUnavailable."""
        by_tenant: dict[str, list[str | int]] = {t.name: [] for t in self.registry}
        for lease, held in list(self.live.items()):
            by_tenant.setdefault(held.tenant, []).extend((lease, held.cost))
        pending = list(self.pending)
        watermark = self._next_id  # leases numbered from here on are newer than this snapshot
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name, pairs in by_tenant.items():
                    await self._sync(
                        keys=self._keys(name),
                        client=pipe,
                        args=[
                            self._lease_prefix(),
                            self._epoch,
                            watermark,
                            self.lease_ttl_ms,
                            "add" if add else "renew",
                            len(pending),
                            *pending,
                            *pairs,
                        ],
                    )
                await pipe.execute()
        except RedisError as exc:
            self._lost(exc)
            raise StoreUnavailable(str(exc)) from None

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Connect and sync once (which also drops leases a previous run of this replica
        left); without Redis, start on the local shares."""
        try:
            await self._recover()
        except StoreUnavailable:
            self.registry.set_share(1 / self.fleet_size)
            log.error(
                "admission store: Redis at %s unreachable (%s); admitting on this replica's share (1/%d) "
                "of every tenant budget until it is back",
                self._where(),
                self.reason,
                self.fleet_size,
            )

    async def run(self) -> None:
        """Renew leases every ttl/3 while Redis is up; ping it every 0.5 s while it is not."""
        while True:
            if self.available:
                await asyncio.sleep(self.lease_ttl_ms / 3000)
                with contextlib.suppress(StoreUnavailable):
                    await self.sync()
            else:
                await asyncio.sleep(0.5)
                with contextlib.suppress(StoreUnavailable):
                    await self._recover()

    async def close(self) -> None:
        """Give back every lease this replica still holds (best effort) and disconnect."""
        self.live.clear()
        if self.available:
            with contextlib.suppress(StoreUnavailable):
                await self.sync()
        self.available = False  # closed: a late forget has nobody to tell
        self.reason = "closed"
        await self.client.aclose()

    def stats(self) -> StoreStats:
        return StoreStats("redis", self.available, self.fallbacks, self.errors, len(self.live), self.reason)

    async def snapshot(self, tenant: str) -> dict[str, float]:
        """Redis's view of one tenant: level, in_flight and the sum of its lease costs."""
        bucket_key, _, cost_key, _ = self._keys(tenant)
        async with self.client.pipeline(transaction=True) as pipe:
            bucket, costs = await pipe.hgetall(bucket_key).hvals(cost_key).execute()
        return {
            "level": float(bucket.get(b"level", math.nan)),
            "in_flight": int(bucket.get(b"in_flight", 0)),
            "leased": sum(int(c) for c in costs),
        }

    # --- internals ------------------------------------------------------------

    async def _recover(self) -> None:
        try:
            # Connections pooled before the loss point at a server that is gone; the
            # first use of one would fail and fall back again.
            await self.client.connection_pool.disconnect()
            await self.client.ping()
        except RedisError as exc:
            self._lost(exc)
            raise StoreUnavailable(str(exc)) from None
        await self.sync(add=True)
        self.available = True
        self.reason = None
        # Redis's buckets are the truth from here on; the local ones must not hold back
        # what the fleet's allow (a local level run down on the share would).
        self.registry.set_share(1.0)
        for tenant in self.registry:
            tenant.bucket.refill_to_burst()
        log.warning("admission store: Redis at %s reachable; tenant budgets are shared by the fleet", self._where())

    async def _call(self, script, tenant: str, *args):
        try:
            return await script(keys=self._keys(tenant), args=list(args))
        except RedisError as exc:
            self._lost(exc)
            raise StoreUnavailable(str(exc)) from None

    def _lost(self, exc: Exception) -> None:
        self.errors += 1
        if self.available:
            self.available = False
            self.fallbacks += 1
            self.registry.set_share(1 / self.fleet_size)
            log.error(
                "admission store: Redis at %s unreachable (%s); admitting on this replica's share "
                "(1/%d) of every tenant budget until it is back",
                self._where(),
                exc,
                self.fleet_size,
            )
        self.reason = f"{type(exc).__name__}: {exc}"

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.prefix}:tenant:{tenant}"
        return [f"{base}:bucket", f"{base}:lease_expiry", f"{base}:lease_cost", f"{base}:waiters"]

    def _lease_prefix(self) -> str:
        return f"{self.replica_id}|"

    def _new_lease(self) -> str:
        self._next_id += 1
        return f"{self._lease_prefix()}{self._epoch}.{self._next_id - 1}"

    def new_waiter(self) -> str:
        self._next_waiter += 1
        return f"{self._lease_prefix()}{self._epoch}.w{self._next_waiter}"

    def _where(self) -> str:
        pool = self.client.connection_pool.connection_kwargs
        return f"{pool.get('host', '?')}:{pool.get('port', '?')}"
