"""Admission with tenant budgets in a real Redis: several Admission objects (one per
replica, as in a fleet) on one redis-server, with exact expectations on what Redis
holds and what each replica admits."""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time

import pytest

from headroom.admission.admission import Admission, Rejected, Ticket
from headroom.admission.redis_store import WAITER_TTL_S, RedisStore
from headroom.admission.tenants import TenantRegistry
from headroom.config import AdmissionConfig, TenantConfig

pytestmark = pytest.mark.asyncio

CAP = 1000


def config(fleet_size: int = 3, **limits) -> AdmissionConfig:
    kw = {"rate_tokens_per_s": 1e6, "burst_tokens": 100_000, "max_in_flight_tokens": CAP} | limits
    return AdmissionConfig(
        tenants=(TenantConfig("flood", **kw), TenantConfig("other", **kw)),
        default_tenant="flood",
        fleet_size=fleet_size,
    )


async def replica(
    redis_server, name: str, cfg: AdmissionConfig | None = None, ttl_s: float = 10.0, tick_s: float = 0.01
) -> Admission:
    cfg = cfg or config()
    registry = TenantRegistry(cfg)
    store = RedisStore(redis_server.url, registry, replica_id=name, fleet_size=cfg.fleet_size, lease_ttl_s=ttl_s)
    await store.start()
    assert store.available
    adm = Admission(cfg, registry, max_in_flight_seqs=64, tick_s=tick_s, store=store)
    adm.start()
    RUNNING[adm] = asyncio.create_task(store.run())  # renewals, and recovery after a loss
    return adm


RUNNING: dict[Admission, asyncio.Task] = {}


async def shutdown(*replicas: Admission) -> None:
    for adm in replicas:
        RUNNING.pop(adm).cancel()
        await adm.close()
        await adm.flush()
        await adm.store.close()


async def kill(adm: Admission) -> None:
    """As kill -9 leaves it: nothing settles, nothing renews, the connection is gone."""
    RUNNING.pop(adm).cancel()
    await adm.store.client.aclose()


def redis_view(redis_server, tenant: str) -> tuple[int, int]:
    """(in_flight counter, sum of lease costs), read in one transaction."""
    pipe = redis_server.client().pipeline(transaction=True)
    bucket, costs = (
        pipe.hgetall(f"headroom:tenant:{tenant}:bucket").hvals(f"headroom:tenant:{tenant}:lease_cost").execute()
    )
    return int(bucket.get(b"in_flight", 0)), sum(int(c) for c in costs)


def redis_ms(redis_server) -> int:
    seconds, micros = redis_server.client().time()
    return seconds * 1000 + micros // 1000


def lease_expiry(redis_server, tenant: str, lease: str) -> int:
    """When `lease` lapses, in milliseconds of Redis's clock."""
    score = redis_server.client().zscore(f"headroom:tenant:{tenant}:lease_expiry", lease)
    assert score is not None, f"{lease} is not held"
    return int(score)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_two_replicas_never_take_more_than_the_cap_between_them(redis_server):
    a, b = await replica(redis_server, "a"), await replica(redis_server, "b")
    flood_a, flood_b = a.registry.get("flood"), b.registry.get("flood")
    # 400 each: two fit in the cap of 1000, a third does not, whichever replica asks.
    first = await a.acquire(flood_a, 400)
    second = await b.acquire(flood_b, 400)
    assert (first.decision, second.decision) == ("admit", "admit")
    assert first.lease.startswith("a|") and second.lease.startswith("b|") and first.charged
    assert redis_view(redis_server, "flood") == (800, 800)
    third = asyncio.create_task(a.acquire(flood_a, 400))
    fourth = asyncio.create_task(b.acquire(flood_b, 400))
    await asyncio.sleep(0.2)
    assert not third.done() and not fourth.done()  # each replica alone would have room (400 of 1000)
    assert flood_a.bucket.in_flight == 400 and flood_b.bucket.in_flight == 400
    # The other tenant is not held back by the flood.
    other = await a.acquire(a.registry.get("other"), 900)
    assert other.decision == "admit" and redis_view(redis_server, "other") == (900, 900)

    a.settle(first, 100, 50)
    await until(lambda: third.done() or fourth.done())
    assert redis_view(redis_server, "flood") == (800, 800)
    assert not (third.done() and fourth.done())
    b.settle(second, 100, 300)
    await until(lambda: third.done() and fourth.done())
    assert {third.result().decision, fourth.result().decision} == {"wait"}
    assert redis_view(redis_server, "flood") == (800, 800)
    for adm, ticket in ((a, third.result()), (b, fourth.result()), (a, other)):
        adm.settle(ticket, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0) and redis_view(redis_server, "other") == (0, 0))
    assert a.stats().decisions == {"admit": 2, "wait": 1} and b.stats().decisions == {"admit": 1, "wait": 1}
    await shutdown(a, b)


async def test_concurrent_flood_from_three_replicas_stays_within_the_cap(redis_server):
    replicas = [await replica(redis_server, f"r{i}") for i in range(3)]
    peak = 0
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            in_flight, leased = redis_view(redis_server, "flood")
            assert in_flight == leased <= CAP
            local = sum(adm.registry.get("flood").bucket.in_flight for adm in replicas)
            assert local <= CAP
            peak = max(peak, in_flight)
            await asyncio.sleep(0.002)

    async def client(adm: Admission, n: int) -> int:
        done = 0
        for i in range(n):
            ticket = await adm.acquire(adm.registry.get("flood"), 150 + 50 * (i % 4))
            await asyncio.sleep(0.005)
            adm.settle(ticket, 10, 20)
            done += 1
        return done

    sampler = asyncio.create_task(sample())
    counts = await asyncio.gather(*(client(adm, 12) for adm in replicas for _ in range(4)))
    stop.set()
    await sampler
    assert sum(counts) == 3 * 4 * 12
    assert CAP - 300 < peak <= CAP  # the cap, not something smaller, was what held them back
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    await shutdown(*replicas)


HOLD_S = 0.1  # each admitted request runs this long, then settles
TICK_S = 0.05  # the server's retry tick


async def test_a_place_freed_anywhere_goes_to_the_tenants_oldest_waiter_in_the_fleet(redis_server):
    """Four places (120 tokens at 30 a request) and twelve closed-loop clients, four on each
    of three replicas. In fleet-wide order a request is granted after the ones that began
    waiting before it, passed by a later one only in a race (a replica's next head not yet
    registered when another's request arrives, two ages a millisecond apart). Without the
    fleet-wide queue the replica whose request settles asks at once while the others wait
    for their tick: it takes the place back for its own queue, so its clients jump the
    queue and the other replicas' are passed by request after request for as long as they
    keep coming. Order is counted, not timed: a pause of the whole process (a collection,
    the VM's host) stretches every wait in flight at once, and the burst after it makes
    races, but it cannot make a queue of passes."""
    cfg = config(max_in_flight_tokens=120)
    replicas = [await replica(redis_server, f"r{i}", cfg, tick_s=TICK_S) for i in range(3)]
    waits: dict[int, list[float]] = {i: [] for i in range(3)}
    arrivals = itertools.count()
    granted: list[int] = []  # each request's place in the order they began waiting, as granted
    peak = 0

    async def client(i: int) -> None:
        nonlocal peak
        adm = replicas[i]
        for _ in range(10):
            arrival = next(arrivals)
            ticket = await adm.acquire(adm.registry.get("flood"), 30)
            granted.append(arrival)
            waits[i].append(ticket.queued_s)
            peak = max(peak, sum(r.registry.get("flood").bucket.in_flight for r in replicas))
            await asyncio.sleep(HOLD_S)
            adm.settle(ticket, 10, 20)

    try:
        await asyncio.gather(*(client(i) for i in range(3) for _ in range(4)))
        # For each request, how many that began waiting after it were granted before it.
        passed = [sum(later > arrival for later in granted[:k]) for k, arrival in enumerate(granted)]
        # In order, fewer than one pass a request; without the fleet's queue, more.
        assert peak == 120 and sum(passed) < len(granted), (sum(passed), sorted(passed)[-12:])
        # A place is handed on within a hold plus a tick or so: half the waits take at most two turns.
        bound = 2 * (HOLD_S + TICK_S) + 0.2  # 0.2: round trips and the event loop, three replicas in one
        typical = {i: round(statistics.median(w), 2) for i, w in waits.items()}
        assert all(w <= bound for w in typical.values()), (typical, bound)
        await until(lambda: redis_view(redis_server, "flood") == (0, 0))
        assert waiters(redis_server, "flood") == {}
    finally:
        await shutdown(*replicas)


def waiters(redis_server, tenant: str) -> dict[str, tuple[int, int, int]]:
    """The tenant's fleet-wide waiters: lease -> (waiting since, cost, alive until), ms of Redis's clock."""
    entries = redis_server.client().hgetall(f"headroom:tenant:{tenant}:waiters")
    return {k.decode(): tuple(int(x) for x in v.decode().split(":")) for k, v in entries.items()}


async def test_a_dead_replicas_waiter_holds_the_others_back_only_until_it_lapses(redis_server):
    dead, alive = await replica(redis_server, "dead"), await replica(redis_server, "alive")
    held = await alive.acquire(alive.registry.get("flood"), 700)
    older = asyncio.create_task(dead.acquire(dead.registry.get("flood"), 500))
    await until(lambda: len(waiters(redis_server, "flood")) == 1)
    # The dead replica asks nothing again: no timer, no retry, no pump, no renewal.
    dead._timer.cancel()
    for retry in dead._retries.values():
        retry.cancel()
    dead.pump = lambda: None
    await kill(dead)
    await asyncio.sleep(0.05)
    ((lease, (_, cost, lapses)),) = waiters(redis_server, "flood").items()
    assert lease.startswith("dead|") and cost == 500
    younger = asyncio.create_task(alive.acquire(alive.registry.get("flood"), 500))
    await asyncio.sleep(0.1)
    alive.settle(held, 0, 0)  # the place the dead replica's waiter would take first
    ticket = await asyncio.wait_for(younger, 10)
    granted = lease_expiry(redis_server, "flood", ticket.lease) - 10_000
    assert lapses <= granted <= lapses + 500 and ticket.decision == "wait"
    assert list(waiters(redis_server, "flood")) == []
    alive.settle(ticket, 0, 0)
    dead.store.available = False  # its cancelled waiter has nobody to tell
    older.cancel()
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    RUNNING.pop(dead, None)
    await shutdown(alive)


async def test_a_waiter_that_leaves_unserved_holds_nobody_back(redis_server):
    a, b, c = [await replica(redis_server, name) for name in "abc"]
    held = await c.acquire(c.registry.get("flood"), 700)
    # Each fits its own replica's bucket, not the fleet's: both wait in Redis.
    gone = asyncio.create_task(a.acquire(a.registry.get("flood"), 500, deadline_s=0.3))
    await until(lambda: len(waiters(redis_server, "flood")) == 1)
    cancelled = asyncio.create_task(b.acquire(b.registry.get("flood"), 400))
    await until(lambda: len(waiters(redis_server, "flood")) == 2)
    cancelled.cancel()
    with pytest.raises(Rejected) as timed_out:
        await gone
    assert timed_out.value.code == "timeout"
    await until(lambda: waiters(redis_server, "flood") == {}, timeout_s=1)  # lapsing would take 2 s
    c.settle(held, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    # Nobody is left ahead: a new request is admitted at once.
    ticket = await asyncio.wait_for(b.acquire(b.registry.get("flood"), 900), 1)
    assert ticket.decision == "admit"
    b.settle(ticket, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    await shutdown(a, b, c)


async def test_a_waiter_that_cannot_ask_holds_nobody_back(redis_server):
    """The oldest waiter's replica has no global slot left to ask with (another tenant's
    request took its last one): it leaves the fleet's queue, and a younger waiter on
    another replica takes the freed place at once (it would otherwise wait for the
    registration to lapse, WAITER_TTL_S)."""
    full = await replica(redis_server, "full")
    full.max_in_flight_seqs = 2
    b, c = await replica(redis_server, "b"), await replica(redis_server, "c")
    held = await b.acquire(b.registry.get("flood"), 800)
    other = await full.acquire(full.registry.get("other"), 10)
    oldest = asyncio.create_task(full.acquire(full.registry.get("flood"), 500))
    await until(lambda: len(waiters(redis_server, "flood")) == 1)
    last = await full.acquire(full.registry.get("other"), 10)  # taken while the oldest is refused
    assert full.in_flight_seqs == 2
    younger = asyncio.create_task(c.acquire(c.registry.get("flood"), 500))
    await until(lambda: any(key.startswith("c|") for key in waiters(redis_server, "flood")))
    b.settle(held, 0, 0)
    started = time.monotonic()
    ticket = await asyncio.wait_for(younger, 5)
    assert time.monotonic() - started < WAITER_TTL_S / 4 and not oldest.done()
    c.settle(ticket, 0, 0)
    full.settle(other, 0, 0)
    full.settle(last, 0, 0)  # a slot again: the oldest asks, and is admitted
    assert (await asyncio.wait_for(oldest, 5)).lease.startswith("full|")
    full.settle(oldest.result(), 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0) and redis_view(redis_server, "other") == (0, 0))
    await shutdown(full, b, c)


async def test_settle_refunds_what_was_reserved_and_not_used(redis_server):
    cfg = config(rate_tokens_per_s=1.0, burst_tokens=1000)  # ~no refill during the test
    a = await replica(redis_server, "a", cfg)
    ticket = await a.acquire(a.registry.get("flood"), 600)
    level = float(redis_server.client().hget("headroom:tenant:flood:bucket", "level"))
    assert 400 <= level < 401
    a.settle(ticket, 100, 150)  # 250 used: 350 of the 600 come back
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    level = float(redis_server.client().hget("headroom:tenant:flood:bucket", "level"))
    assert 750 <= level < 752
    await shutdown(a)


async def test_a_dead_replicas_reservations_come_back_within_the_ttl(redis_server):
    dead = await replica(redis_server, "dead", ttl_s=1.0)
    alive = await replica(redis_server, "alive", ttl_s=1.0)
    before = redis_ms(redis_server)
    held = await dead.acquire(dead.registry.get("flood"), 700)
    assert redis_view(redis_server, "flood") == (700, 700)
    await kill(dead)
    killed = redis_ms(redis_server)
    # Timed on Redis's clock, which also decides expiry, so a slow test cannot skew it:
    # the lease lapses one TTL after its last renewal, which came before the kill.
    expiry = lease_expiry(redis_server, "flood", held.lease)
    assert before + 1000 <= expiry <= killed + 1000
    attempts: list[tuple[int, str | float]] = []  # (Redis time when sent, answer) of each reserve
    reserve = alive.store.reserve

    async def timed_reserve(*args):
        sent = redis_ms(redis_server)
        answer = await reserve(*args)
        attempts.append((sent, answer))
        return answer

    alive.store.reserve = timed_reserve
    # Safety net only: the wait is for the expiry itself.
    ticket = await asyncio.wait_for(alive.acquire(alive.registry.get("flood"), 700), 30)
    granted = lease_expiry(redis_server, "flood", ticket.lease) - 1000
    assert ticket.decision == "wait" and granted >= expiry  # held back by the dead lease until it lapsed
    # ... and no longer: every script reclaims what has lapsed, so no ask sent after the
    # expiry was refused, however late the waiter got to send it.
    refused = [sent for sent, answer in attempts if not isinstance(answer, str)]
    assert refused and max(refused) < expiry and attempts[-1][1] == ticket.lease
    assert redis_view(redis_server, "flood") == (700, 700) and ticket.lease.startswith("alive|")
    alive.settle(ticket, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    await shutdown(alive)


async def test_a_restarted_replica_gives_back_what_its_previous_run_left_at_once(redis_server):
    old = await replica(redis_server, "pod-0")
    await old.acquire(old.registry.get("flood"), 500)
    await kill(old)  # its lease would live for the whole TTL
    assert redis_view(redis_server, "flood") == (500, 500)
    new = await replica(redis_server, "pod-0")  # same replica id, new run: its first sync drops it
    assert redis_view(redis_server, "flood") == (0, 0)
    await shutdown(new)


async def test_without_redis_each_replica_admits_its_share_and_resyncs_on_recovery(redis_server):
    a, b = await replica(redis_server, "a"), await replica(redis_server, "b")
    flood_a = a.registry.get("flood")
    before = await a.acquire(flood_a, 200)
    redis_server.stop()

    # The first request after the loss finds out, falls back, and is admitted on the share.
    during = await a.acquire(flood_a, 100)
    assert not a.store.available and a.store.stats().fallbacks == 1 and a.store.reason
    assert flood_a.bucket.max_in_flight_tokens == CAP // 3 and not during.charged
    # 300 of a share of 333 are in flight on this replica: 100 more must wait.
    held = asyncio.create_task(a.acquire(flood_a, 100))
    await asyncio.sleep(0.1)
    assert not held.done()
    a.settle(before, 0, 0)  # settled while Redis is away
    third = await held
    assert flood_a.bucket.in_flight == 200
    # Admitted at once on the share (nothing queued): it holds a lease all the same.
    direct = await a.acquire(flood_a, 10)
    assert direct.decision == "admit" and direct.lease.startswith("a|") and not direct.charged
    # More than the share can never be admitted here while Redis is away: refused now, not queued.
    with pytest.raises(Rejected) as refused:
        await a.acquire(flood_a, 400)
    assert refused.value.code == "fallback_share" and refused.value.retry_after_s == 5.0

    redis_server.restart()  # empty: everything it knew is gone
    await until(lambda: a.store.available and b.store.available, timeout_s=5)
    assert flood_a.bucket.max_in_flight_tokens == CAP
    # Redis now counts exactly what is in flight: the three granted during the outage.
    assert redis_view(redis_server, "flood") == (210, 210)
    a.settle(during, 0, 0)
    a.settle(third, 0, 0)
    a.settle(direct, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    assert isinstance(third, Ticket)
    await shutdown(a, b)


async def test_a_sync_never_drops_a_newer_lease_nor_puts_back_a_settled_one(redis_server):
    a = await replica(redis_server, "a")
    store, flood = a.store, a.registry.get("flood")
    ticket = await a.acquire(flood, 300)
    number = int(ticket.lease.rsplit(".", 1)[1])
    # A sync whose snapshot was taken before this lease was numbered leaves it alone...
    live = dict(store.live)
    store.live.clear()
    store._next_id = number
    await store.sync()
    assert redis_view(redis_server, "flood") == (300, 300)
    # ...one taken after drops it (this replica no longer holds it).
    store._next_id = number + 1
    await store.sync()
    assert redis_view(redis_server, "flood") == (0, 0)
    # A renewal with a stale snapshot that still lists a settled lease does not put it back.
    store.live.update(live)
    await store.sync(add=False)
    assert redis_view(redis_server, "flood") == (0, 0)
    # After a loss, the resync does.
    await store.sync(add=True)
    assert redis_view(redis_server, "flood") == (300, 300)
    a.settle(ticket, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    await shutdown(a)


async def test_a_retry_granted_while_a_sync_is_under_way_keeps_its_lease(redis_server):
    """A waiter asks again under the same key, but each grant is a new lease, numbered after
    any sync's snapshot: the sync that was under way leaves it alone (a reused lease id,
    numbered before the snapshot, was dropped as no longer held, and the fleet then took
    the whole cap again)."""
    registry = TenantRegistry(config())
    store = RedisStore(redis_server.url, registry, replica_id="a", fleet_size=3)
    await store.start()
    flood, waiter = registry.get("flood"), store.new_waiter()
    blocker = await store.reserve(flood, 800, store.new_waiter())
    assert isinstance(await store.reserve(flood, 500, waiter, 0.1), float)  # refused: 800 + 500 > 1000
    await store.settle(blocker, 800, 800, True)
    granted = []
    pipeline = store.client.pipeline

    def racing(*args, **kwargs):  # the retry lands between the sync's snapshot and its script
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def retried_then_execute(*a, **kw):
            granted.append(await store.reserve(flood, 500, waiter, 0.2))
            return await execute(*a, **kw)

        pipe.execute = retried_then_execute
        return pipe

    store.client.pipeline = racing
    await store.sync()
    store.client.pipeline = pipeline
    assert granted and granted[0] in store.live
    assert redis_view(redis_server, "flood") == (500, 500)
    await store.settle(granted[0], 500, 0, True)
    assert redis_view(redis_server, "flood") == (0, 0)
    await store.close()


async def test_a_lost_redis_is_logged_once_per_loss_not_per_request(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="headroom.admission.store")
    a = await replica(redis_server, "a")
    flood = a.registry.get("flood")
    redis_server.stop()
    # Requests and the store's own pings (every 0.5 s) all meet the lost Redis.
    tickets = [await a.acquire(flood, 10) for _ in range(5)]
    seen = a.store.errors
    await until(lambda: a.store.errors >= seen + 2, timeout_s=10)  # two pings after the requests
    lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.ERROR, [r.getMessage() for r in caplog.records]
    assert lost[0].getMessage().startswith(f"admission store: Redis at 127.0.0.1:{redis_server.port} unreachable (")

    def back() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "reachable; tenant budgets are shared" in r.getMessage()]

    assert len(back()) == 1  # the start's
    redis_server.restart()
    await until(lambda: a.store.available, timeout_s=5)
    assert len(back()) == 2 and back()[1].levelno == logging.WARNING
    # A second loss is a second line.
    redis_server.stop()
    tickets.append(await a.acquire(flood, 10))
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2
    assert a.store.stats().fallbacks == 2
    redis_server.start()
    await until(lambda: a.store.available, timeout_s=5)
    for ticket in tickets:
        a.settle(ticket, 0, 0)
    await until(lambda: redis_view(redis_server, "flood") == (0, 0))
    await shutdown(a)


async def test_forgetting_a_waiter_while_redis_is_away_raises_nothing_and_counts_the_loss(redis_server):
    """forget() runs as a task of its own (admission.py): a lost Redis must not end it with
    an error; the waiter's entry lapses by its TTL instead."""
    a = await replica(redis_server, "a")
    RUNNING[a].cancel()  # no ping may find the loss first
    errors = a.store.errors
    redis_server.stop()
    await a.store.forget("flood", a.store.new_waiter())
    assert not a.store.available and a.store.errors == errors + 1
    await a.store.forget("flood", a.store.new_waiter())  # known lost: Redis is not asked
    assert a.store.errors == errors + 1
    redis_server.start()
    await shutdown(a)
