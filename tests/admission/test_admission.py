from __future__ import annotations

import asyncio

import pytest

from headroom.admission.admission import Admission, Rejected, Ticket
from headroom.admission.tenants import Tenant
from headroom.config import AdmissionConfig, TenantConfig


def tenant_config(name: str, **kw) -> TenantConfig:
    limits = {"rate_tokens_per_s": 1e6, "burst_tokens": 100_000, "max_in_flight_tokens": 100_000}
    return TenantConfig(name, **(limits | kw))


def make(clock, *tenants: TenantConfig, seqs: int | None = None, tick_s: float = 0.05, **kw) -> Admission:
    config = AdmissionConfig(tenants=tenants, default_tenant=tenants[0].name, **kw)
    return Admission(config, max_in_flight_seqs=seqs, now=clock, tick_s=tick_s)


async def spin() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def waiter(adm: Admission, tenant: Tenant, cost: int, **kw) -> asyncio.Task[Ticket]:
    return asyncio.get_running_loop().create_task(adm.acquire(tenant, cost, **kw))


@pytest.mark.asyncio
async def test_admit_then_settle_on_finish_and_abort(clock):
    adm = make(clock, tenant_config("a", rate_tokens_per_s=100.0, burst_tokens=1000, max_in_flight_tokens=1000))
    a = adm.registry.get("a")
    done = await adm.acquire(a, 300, prompt_tokens=100)
    aborted = await adm.acquire(a, 400, prompt_tokens=100)
    assert done == Ticket("a", 300, "admit", 0.0, 1, 100)
    assert a.bucket.level == 300 and a.bucket.in_flight == 700 and adm.in_flight_seqs == 2
    assert a.vtc == 100 + 2 * 200 + 100 + 2 * 300

    adm.settle(done, 100, 50)  # finished early: 150 of 300 refunded
    assert done.settled and a.bucket.level == 450 and a.bucket.in_flight == 400
    assert a.vtc == 100 + 2 * 50 + 100 + 2 * 300
    adm.settle(aborted, 100, 0)  # aborted after prefill
    adm.settle(aborted, 100, 0)  # every path may settle; only the first counts
    adm.settle(done, 100, 50)
    assert a.bucket.level == 750 and a.bucket.in_flight == 0 and adm.in_flight_seqs == 0
    assert a.vtc == 100 + 2 * 50 + 100
    assert adm.stats().decisions == {"admit": 2}


@pytest.mark.asyncio
async def test_waits_for_refill_and_pump_admits(clock):
    adm = make(clock, tenant_config("a", rate_tokens_per_s=1000.0, burst_tokens=1000))
    a = adm.registry.get("a")
    await adm.acquire(a, 1000)
    task = waiter(adm, a, 500)
    await spin()
    assert not task.done() and adm.stats().waiting == {"a": 1}
    clock.advance(0.25)
    adm.pump()
    await spin()
    assert not task.done()
    clock.advance(0.25)
    adm.pump()
    ticket = await task
    assert (ticket.decision, ticket.queued_s, ticket.cost) == ("wait", 0.5, 500)
    assert a.bucket.level == 0 and a.bucket.in_flight == 1500
    assert adm.stats().decisions == {"admit": 1, "wait": 1}


@pytest.mark.asyncio
async def test_global_limit_queues_and_settle_admits(clock):
    adm = make(clock, tenant_config("a"), seqs=1)
    a = adm.registry.get("a")
    first = await adm.acquire(a, 10)
    task = waiter(adm, a, 20)
    await spin()
    assert not task.done() and adm.in_flight_seqs == 1
    clock.advance(2.0)
    adm.settle(first, 10, 0)
    ticket = await task
    assert (ticket.decision, ticket.queued_s) == ("wait", 2.0)
    assert adm.in_flight_seqs == 1 and a.bucket.in_flight == 20


async def drain_in_order(
    adm: Admission, holding: Ticket, tasks: dict[str, asyncio.Task[Ticket]], first_actual: tuple[int, int] | None = None
) -> list[str]:
    """With one global slot: settle whoever holds it and record who is admitted next.
    Every request uses what it reserved, except `first_actual` for the first."""
    order = []
    pending = dict(tasks)
    actual = first_actual or (holding.prompt_tokens, 0)
    while pending:
        adm.settle(holding, *actual)
        await spin()
        done = [tag for tag, task in pending.items() if task.done()]
        assert len(done) == 1, done
        holding = pending.pop(done[0]).result()
        order.append(done[0])
        actual = (holding.prompt_tokens, holding.cost - holding.prompt_tokens)
    adm.settle(holding, holding.prompt_tokens, 0)
    return order


@pytest.mark.asyncio
async def test_light_tenant_goes_before_a_heavy_backlog(clock):
    adm = make(clock, tenant_config("heavy"), tenant_config("light"), seqs=1)
    heavy, light = adm.registry.get("heavy"), adm.registry.get("light")
    first = await adm.acquire(heavy, 100, prompt_tokens=100)
    tasks = {f"h{i}": waiter(adm, heavy, 100, prompt_tokens=100) for i in range(2, 6)}
    await spin()
    tasks |= {f"l{i}": waiter(adm, light, 100, prompt_tokens=100) for i in range(1, 3)}
    await spin()
    assert (heavy.vtc, light.vtc) == (100, 100)  # light arrived idle: lifted to heavy's counter
    # heavy's first request generates 400 tokens more than it reserved: 800 more on its counter.
    order = await drain_in_order(adm, first, tasks, first_actual=(100, 400))
    assert order == ["l1", "l2", "h2", "h3", "h4", "h5"]
    assert (heavy.vtc, light.vtc) == (100 + 800 + 4 * 100, 100 + 2 * 100)


@pytest.mark.asyncio
async def test_equal_use_interleaves_tenants(clock):
    adm = make(clock, tenant_config("heavy"), tenant_config("light"), seqs=1)
    heavy, light = adm.registry.get("heavy"), adm.registry.get("light")
    first = await adm.acquire(heavy, 100, prompt_tokens=100)
    tasks = {f"h{i}": waiter(adm, heavy, 100, prompt_tokens=100) for i in range(2, 6)}
    await spin()
    tasks |= {f"l{i}": waiter(adm, light, 100, prompt_tokens=100) for i in range(1, 3)}
    await spin()
    order = await drain_in_order(adm, first, tasks)
    assert order == ["h2", "l1", "h3", "l2", "h4", "h5"]  # ties go by name


@pytest.mark.asyncio
async def test_idle_time_banks_no_credit(clock):
    adm = make(clock, tenant_config("busy"), tenant_config("idle"), seqs=1)
    busy, idle = adm.registry.get("busy"), adm.registry.get("idle")
    for _ in range(10):  # busy has the server to itself for a while
        adm.settle(await adm.acquire(busy, 100, prompt_tokens=100), 100, 0)
    assert (busy.vtc, idle.vtc) == (1000, 0)
    first = await adm.acquire(idle, 100, prompt_tokens=100)
    assert idle.vtc == 1100  # lifted to busy's 1000, then charged
    tasks = {f"b{i}": waiter(adm, busy, 100, prompt_tokens=100) for i in range(3)}
    await spin()
    tasks |= {f"i{i}": waiter(adm, idle, 100, prompt_tokens=100) for i in range(1, 3)}
    await spin()
    assert busy.vtc == 1100  # busy came back after idle had drained: lifted in turn
    # Without the lift, idle's 0 would have taken every slot until it caught up.
    assert await drain_in_order(adm, first, tasks) == ["b0", "i1", "b1", "i2", "b2"]


@pytest.mark.asyncio
async def test_a_request_that_fits_passes_a_queued_one_that_does_not(clock):
    adm = make(clock, tenant_config("a", rate_tokens_per_s=1000.0, burst_tokens=1000))
    a = adm.registry.get("a")
    await adm.acquire(a, 1000)
    big, small = waiter(adm, a, 750), waiter(adm, a, 100)
    await spin()
    assert not big.done() and not small.done()
    clock.advance(0.25)  # 250 tokens: enough for small, not for big
    adm.pump()
    await spin()
    assert not big.done() and small.done() and a.bucket.level == 150
    assert (await small).decision == "wait" and (await small).queued_s == 0.25
    late = await adm.acquire(a, 50)  # fits on arrival: it does not queue behind big either
    assert late.decision == "admit" and a.bucket.level == 100 and not big.done()
    clock.advance(0.75)
    adm.pump()
    await spin()
    assert big.done() and a.bucket.level == pytest.approx(100) and (await big).queued_s == pytest.approx(1.0)


@pytest.mark.asyncio
async def test_nobody_passes_a_request_that_has_waited_backfill_max_wait_s(clock):
    config = AdmissionConfig(
        tenants=(tenant_config("a", max_in_flight_tokens=1000),), default_tenant="a", backfill_max_wait_s=1.0
    )
    adm = Admission(config, now=clock)
    a = adm.registry.get("a")
    hold = await adm.acquire(a, 900)
    big = waiter(adm, a, 500)  # 900 + 500 > 1000: waits for hold
    await spin()
    passed = await adm.acquire(a, 50)  # big has waited 0 s: 50 fits and goes first
    assert passed.decision == "admit" and not big.done()
    clock.advance(1.0)
    blocked = waiter(adm, a, 50)  # 950 + 50 fits, but big has now waited the bound
    await spin()
    assert not blocked.done() and list(a.queue) and a.queue[0].cost == 500
    adm.settle(hold, 900, 0)
    await spin()
    assert (await big).queued_s == 1.0 and (await blocked).decision == "wait"
    assert a.bucket.in_flight == 50 + 500 + 50


@pytest.mark.asyncio
async def test_a_free_slot_goes_to_whoever_can_use_it(clock):
    adm = make(clock, tenant_config("a", rate_tokens_per_s=100.0, burst_tokens=1000), tenant_config("b"), seqs=2)
    a, b = adm.registry.get("a"), adm.registry.get("b")
    b.vtc = 5000.0
    await adm.acquire(a, 1000)
    blocked = waiter(adm, a, 500)  # a has the smaller counter but no tokens left
    await spin()
    ticket = await adm.acquire(b, 100)
    assert ticket.decision == "admit" and adm.in_flight_seqs == 2 and not blocked.done()
    blocked.cancel()
    await spin()


@pytest.mark.asyncio
async def test_max_wait_expiry_rejects_and_leaves_nothing(clock):
    adm = make(clock, tenant_config("a", rate_tokens_per_s=100.0, burst_tokens=1000, max_wait_s=2.0))
    a = adm.registry.get("a")
    await adm.acquire(a, 1000)
    task = waiter(adm, a, 500)
    await spin()
    clock.advance(1.75)
    adm.pump()
    await spin()
    assert not task.done()
    clock.advance(0.25)
    adm.pump()
    with pytest.raises(Rejected) as exc:
        await task
    assert exc.value.code == "timeout" and "within 2s" in exc.value.reason
    assert exc.value.retry_after_s == 3.0  # (500 - 200 refilled) / 100 per s
    stats = adm.stats()
    assert stats.waiting == {"a": 0} and stats.in_flight_tokens == {"a": 1000} and stats.in_flight_seqs == 1
    assert stats.decisions == {"admit": 1, "wait": 1, "reject": 1} and stats.rejections == {"timeout": 1}


@pytest.mark.asyncio
async def test_deadline_shortens_the_wait(clock):
    adm = make(clock, tenant_config("a"), seqs=1)
    a = adm.registry.get("a")
    await adm.acquire(a, 10)
    task = waiter(adm, a, 10, deadline_s=0.5)
    await spin()
    clock.advance(0.5)
    adm.pump()
    with pytest.raises(Rejected) as exc:
        await task
    assert exc.value.code == "timeout" and exc.value.retry_after_s == 1.0
    with pytest.raises(Rejected) as exc:
        await adm.acquire(a, 10, deadline_s=0)  # may not wait at all
    assert exc.value.code == "timeout"


@pytest.mark.asyncio
async def test_full_queue_rejects_at_once(clock):
    adm = make(clock, tenant_config("a", max_queue=2), tenant_config("b", max_queue=0), seqs=1)
    a, b = adm.registry.get("a"), adm.registry.get("b")
    await adm.acquire(a, 10)
    tasks = [waiter(adm, a, 10), waiter(adm, a, 10)]
    await spin()
    with pytest.raises(Rejected) as exc:
        await adm.acquire(a, 10)
    assert exc.value.code == "queue_full" and exc.value.retry_after_s == 1.0
    with pytest.raises(Rejected, match="queue is full") as exc:
        await adm.acquire(b, 10)
    assert adm.stats().waiting == {"a": 2, "b": 0}
    for task in tasks:
        task.cancel()
    await spin()


@pytest.mark.asyncio
async def test_a_request_that_can_never_fit_is_rejected(clock):
    adm = make(clock, tenant_config("a", max_in_flight_tokens=4096))
    with pytest.raises(Rejected, match="can never be admitted") as exc:
        await adm.acquire(adm.registry.get("a"), 4097)
    assert exc.value.code == "too_large" and exc.value.retry_after_s is None
    assert adm.stats().waiting == {"a": 0}


@pytest.mark.asyncio
async def test_cancelled_waiter_leaves_no_trace(clock):
    adm = make(clock, tenant_config("a"), tenant_config("b"), seqs=1)
    a, b = adm.registry.get("a"), adm.registry.get("b")
    first = await adm.acquire(a, 10)
    gone = waiter(adm, b, 50)
    await spin()
    vtc = b.vtc
    gone.cancel()
    await spin()
    assert gone.cancelled()
    assert adm.stats().waiting == {"a": 0, "b": 0} and b.bucket.in_flight == 0 and b.vtc == vtc
    adm.settle(first, 10, 0)
    assert adm.in_flight_seqs == 0


@pytest.mark.asyncio
async def test_cancel_landing_just_after_admission_returns_the_reservation(clock):
    adm = make(clock, tenant_config("a"), seqs=1)
    a = adm.registry.get("a")
    first = await adm.acquire(a, 10, prompt_tokens=10)
    task = waiter(adm, a, 50, prompt_tokens=20)
    await spin()
    adm.settle(first, 10, 0)  # admits the waiter...
    assert a.bucket.in_flight == 50 and adm.in_flight_seqs == 1
    task.cancel()  # ...whose client leaves before its task resumes
    await spin()
    assert task.cancelled()
    assert a.bucket.in_flight == 0 and adm.in_flight_seqs == 0 and a.vtc == 10
    assert a.bucket.level == 100_000 - 10  # only the first request's tokens were used


@pytest.mark.asyncio
async def test_cancelling_a_blocking_head_lets_the_next_in(clock):
    # backfill_max_wait_s 0: strict FIFO, so the head blocks the request behind it at once.
    adm = make(clock, tenant_config("a", rate_tokens_per_s=1000.0, burst_tokens=1000), backfill_max_wait_s=0.0)
    a = adm.registry.get("a")
    await adm.acquire(a, 900)
    head, behind = waiter(adm, a, 500), waiter(adm, a, 100)
    await spin()
    head.cancel()
    ticket = await behind
    assert ticket.decision == "wait" and a.bucket.in_flight == 1000


@pytest.mark.asyncio
async def test_timer_admits_after_refill_and_expires_waiters(clock):
    adm = make(
        clock,
        tenant_config("a", rate_tokens_per_s=1000.0, burst_tokens=1000, max_in_flight_tokens=2000, max_wait_s=5.0),
        tick_s=0.001,
    )
    a = adm.registry.get("a")
    adm.start()
    try:
        await adm.acquire(a, 1000)
        task = waiter(adm, a, 500)
        await spin()
        clock.advance(0.5)  # no settle, no pump call: only the timer can admit it
        assert (await asyncio.wait_for(task, 2.0)).queued_s == 0.5
        task = waiter(adm, a, 1000)  # over the in-flight cap until something settles
        await spin()
        clock.advance(5.0)
        with pytest.raises(Rejected) as exc:
            await asyncio.wait_for(task, 2.0)
        assert exc.value.code == "timeout" and exc.value.retry_after_s == 1.0
        assert adm.stats().waiting == {"a": 0} and a.bucket.in_flight == 1500
    finally:
        await adm.close()


@pytest.mark.asyncio
async def test_close_rejects_waiters_and_new_requests(clock):
    adm = make(clock, tenant_config("a"), tenant_config("b"), seqs=1)
    a, b = adm.registry.get("a"), adm.registry.get("b")
    adm.start()
    held = await adm.acquire(a, 10)
    tasks = [waiter(adm, a, 10), waiter(adm, b, 10), waiter(adm, b, 10)]
    await spin()
    await adm.close()
    for task in tasks:
        with pytest.raises(Rejected) as exc:
            await task
        assert exc.value.code == "shutting_down"
    with pytest.raises(Rejected, match="shutting down"):
        await adm.acquire(b, 10)
    adm.settle(held, 10, 0)  # tickets granted before close still settle
    stats = adm.stats()
    assert stats.waiting == {"a": 0, "b": 0} and stats.in_flight_seqs == 0
    assert stats.rejections == {"shutting_down": 4}


@pytest.mark.asyncio
async def test_bad_arguments(clock):
    adm = make(clock, tenant_config("a"))
    with pytest.raises(ValueError):
        await adm.acquire(adm.registry.get("a"), 10, prompt_tokens=11)


@pytest.mark.asyncio
async def test_n_sequences_are_admitted_together_or_not_at_all(clock):
    adm = make(clock, tenant_config("a"), seqs=4)
    a = adm.registry.get("a")
    three = await adm.acquire(a, 900, prompt_tokens=300, seqs=3)
    assert three.seqs == 3 and adm.in_flight_seqs == 3
    two = waiter(adm, a, 600, seqs=2)  # one slot is free, but it needs two: it waits whole
    await spin()
    assert not two.done() and adm.in_flight_seqs == 3
    adm.settle(three, 300, 30)
    await spin()
    assert two.done() and two.result().seqs == 2 and adm.in_flight_seqs == 2
    with pytest.raises(Rejected) as never:
        await adm.acquire(a, 100, seqs=5)
    assert never.value.code == "too_large"
    adm.settle(two.result(), 0, 0)
    assert adm.in_flight_seqs == 0
