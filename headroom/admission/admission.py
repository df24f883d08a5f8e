"""The admission decision: admit a request now, make it wait, or reject it.

A request costs tokens (prompt + expected output). It is admitted when its tenant's
bucket allows the cost (tenants.py), a global slot is free (at most
`max_in_flight_seqs` admitted, unsettled requests across all tenants) and nobody of its
own tenant waits ahead of it. Otherwise it waits in its tenant's bounded FIFO queue
until `pump()` admits it; pump runs on every settle, on every acquire and on a timer
(for refill and expiry) and hands free slots to tenants in virtual-token-counter order
(fair_queue.py). A request is rejected when its tenant's queue is full, when its cost
can never fit the tenant's in-flight cap, when it has waited too long, or on shutdown.

Every admitted request holds a Ticket that must be settled exactly once with the real
token counts; settling is idempotent, so finish, abort and error paths may all call it.

With a shared store (redis_store.py), a request that this replica would admit is also
checked and charged fleet-wide, in one round trip, before its ticket is granted: pump
hands the head of a tenant's queue to a task that asks Redis while the global slot is
held, and a refusal puts it back at the head until the store's retry hint has passed.
The store keeps the refused heads of every replica as the tenant's fleet-wide queue and
grants a place to the oldest of them first; a waiter that leaves unserved is forgotten
there.
While the store is unavailable, pump grants on the local buckets, which the store has
scaled down to this replica's share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from headroom.admission.fair_queue import FairQueue
from headroom.admission.redis_store import RedisStore, StoreUnavailable
from headroom.admission.tenants import BUSY_RETRY_AFTER_S, Tenant, TenantRegistry, Waiter
from headroom.config import AdmissionConfig

log = logging.getLogger("headroom.admission")


class Rejected(Exception):
    """`code` is one of too_large, queue_full, timeout, shutting_down; `retry_after_s`
    is a hint for Retry-After (None: retrying the same request will not help)."""

    def __init__(self, reason: str, retry_after_s: float | None = None, code: str = "rejected"):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.code = code


@dataclass
class Ticket:
    tenant: str
    cost: int
    decision: str  # "admit" (at once) or "wait" (admitted after queueing)
    queued_s: float
    priority: int  # the tenant's tier priority, for the engine's Request.priority
    # The part of `cost` charged to the fair-share counter at prompt weight; the rest
    # was charged at output weight until settle corrects it.
    prompt_tokens: int = 0
    settled: bool = False
    # With a shared store: the fleet-wide lease, and whether its cost was charged to the
    # shared bucket (False: granted on the local share while the store was away).
    lease: str | None = None
    charged: bool = False
    seqs: int = 1  # sequences it admits (a request's n choices)


@dataclass
class AdmissionStats:
    decisions: dict[str, int]  # admit / wait / reject (a waiter that then expires counts twice)
    rejections: dict[str, int]  # by Rejected.code
    waiting: dict[str, int]  # per tenant
    in_flight_tokens: dict[str, int]  # reserved, per tenant
    in_flight_seqs: int
    virtual_tokens: dict[str, float]  # the fair-share counters, per tenant


class Admission:
    def __init__(
        self,
        config: AdmissionConfig,
        registry: TenantRegistry | None = None,
        *,
        max_in_flight_seqs: int | None = None,
        now: Callable[[], float] = time.monotonic,
        tick_s: float = 0.05,
        store: RedisStore | None = None,
    ):
        """max_in_flight_seqs: the global limit (default config.global_max_in_flight_seqs;
        both None: no global limit). tick_s: the refill/expiry timer period. store: tenant
        budgets shared with other replicas (None: this process's buckets are the truth)."""
        self.config = config
        self.registry = registry if registry is not None else TenantRegistry(config, now)
        self.fair = FairQueue(config.prompt_weight, config.output_weight, config.fair_share == "device")
        if max_in_flight_seqs is None:
            max_in_flight_seqs = config.global_max_in_flight_seqs
        self.max_in_flight_seqs = max_in_flight_seqs
        self.in_flight_seqs = 0
        self.decisions: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self._now = now
        self._tick_s = tick_s
        self._wake = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self._closed = False
        self.store = store
        self._confirming: set[Waiter] = set()
        self._tasks: set[asyncio.Task] = set()  # reserve and settle round trips to the store
        self._retries: dict[str, asyncio.TimerHandle] = {}  # per tenant: its head's next ask

    # --- the decision -------------------------------------------------------------

    async def acquire(
        self, tenant: Tenant, cost: int, deadline_s: float | None = None, *, prompt_tokens: int = 0, seqs: int = 1
    ) -> Ticket:
        """Admit `cost` tokens for `tenant`, waiting if need be. deadline_s: the most this
        request may wait, in seconds from now (the tenant's max_wait_s still caps it).
        prompt_tokens: how much of cost is prompt, for the fair-share estimate. seqs: the
        global slots it takes (n choices of one request are admitted together).
        Raises Rejected; on cancellation the request leaves no trace."""
        if cost < 0 or not 0 <= prompt_tokens <= cost:
            raise ValueError(f"need 0 <= prompt_tokens <= cost, got {prompt_tokens} and {cost}")
        refused = self._never(tenant, cost, seqs)
        if refused is not None:
            raise self._reject(refused)
        self.pump()  # refill may already have let waiters in; they go first
        direct = False
        if not tenant.queue:
            self.fair.lift(tenant, self.registry)
        # After pump, a free slot means no waiter of any tenant can use it now (what its own
        # tenant has queued does not fit), so taking it delays nobody.
        if tenant.may_pass_queue() and self._slot_free(seqs) and tenant.head_free() and tenant.bucket.can_admit(cost):
            if not self._shared():
                self.decisions["admit"] += 1
                return self._grant(tenant, cost, prompt_tokens, "admit", 0.0, seqs)
            direct = True  # admitted here; the fleet's answer is one round trip away
        max_wait = tenant.config.max_wait_s if deadline_s is None else min(deadline_s, tenant.config.max_wait_s)
        refused = None if direct else self._cannot_wait(tenant, cost, max_wait)
        if refused is not None:
            raise self._reject(refused)

        waiter = self._enqueue(tenant, cost, prompt_tokens, max_wait, direct, seqs)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(tenant, waiter)
            raise

    def _enqueue(
        self, tenant: Tenant, cost: int, prompt_tokens: int, max_wait: float, direct: bool, seqs: int
    ) -> Waiter:
        """Queues a waiter from now, for at most max_wait; a direct one is picked at once
        where the fleet's answer allows, else it waits like any other."""
        now = self._now()
        future = asyncio.get_running_loop().create_future()
        waiter = Waiter(cost, prompt_tokens, now, now + max(max_wait, 0.0), future, direct, seqs)
        tenant.queue.append(waiter)
        if waiter.direct:
            self.pump()
            if waiter in tenant.queue:  # not picked after all: it waits like any other
                waiter.direct = False
        if not waiter.direct:
            self.decisions["wait"] += 1
        self._wake.set()
        return waiter

    def _never(self, tenant: Tenant, cost: int, seqs: int) -> Rejected | None:
        """Why a request can never be admitted (or not while the store is away), if it cannot."""
        if self._closed:
            return Rejected("server is shutting down", None, "shutting_down")
        if cost > tenant.max_in_flight_tokens:
            return Rejected(
                f"request needs {cost} tokens but tenant {tenant.name!r} may have at most "
                f"{tenant.max_in_flight_tokens} in flight; it can never be admitted",
                None,
                "too_large",
            )
        if self.max_in_flight_seqs is not None and seqs > self.max_in_flight_seqs:
            return Rejected(
                f"request needs {seqs} sequences but at most {self.max_in_flight_seqs} "
                "may run at once; it can never be admitted",
                None,
                "too_large",
            )
        if self.store is not None and not self.store.available and cost > tenant.bucket.max_in_flight_tokens:
            return Rejected(
                f"request needs {cost} tokens; while the shared admission store is unreachable tenant "
                f"{tenant.name!r} may have at most {tenant.bucket.max_in_flight_tokens} in flight on this replica",
                5.0,
                "fallback_share",
            )
        return None

    def _cannot_wait(self, tenant: Tenant, cost: int, max_wait: float) -> Rejected | None:
        """Why a request that is not admitted at once may not wait, if it may not."""
        if max_wait <= 0:
            return Rejected(
                f"tenant {tenant.name!r}: cannot admit now and the request may not wait",
                self._retry_after(tenant, cost),
                "timeout",
            )
        if len(tenant.queue) >= tenant.config.max_queue:
            return Rejected(
                f"tenant {tenant.name!r}: wait queue is full ({tenant.config.max_queue})",
                self._retry_after(tenant, cost),
                "queue_full",
            )
        return None

    def settle(self, ticket: Ticket, prompt_tokens: int, output_tokens: int, device_s: float = 0.0) -> None:
        """Return the reservation, charge what was really used, free the slot, admit
        waiters. Idempotent. For an abort, pass the tokens actually processed so far.
        device_s: the engine seconds the request took (0: unknown)."""
        if ticket.settled:
            return
        ticket.settled = True
        tenant = self.registry.get(ticket.tenant)
        assert tenant is not None, ticket.tenant
        tenant.bucket.settle(ticket.cost, prompt_tokens + output_tokens)
        self.fair.settle(
            tenant, (ticket.prompt_tokens, ticket.cost - ticket.prompt_tokens), (prompt_tokens, output_tokens), device_s
        )
        self.in_flight_seqs -= ticket.seqs
        if self.store is not None and ticket.lease is not None:
            self._spawn(
                self.store.settle(ticket.lease, ticket.cost, prompt_tokens + output_tokens, ticket.charged),
                then_pump=True,
            )
        self.pump()

    def pump(self) -> None:
        """Fill free slots from the queues in fair order, then reject expired waiters
        (admitting first: a request that can run now is not failed for a late tick).
        Runs on settle, acquire and the timer; call it after live limit updates too."""
        now = self._now()
        for tenant in self.registry:
            self._prune(tenant, None)
        while self._slot_free():
            tenant = self.fair.next_tenant(self.registry)
            waiter = tenant.next_waiter() if tenant is not None else None
            if waiter is None or not self._slot_free(waiter.seqs):
                break
            tenant.queue.remove(waiter)
            if self._shared():
                self._confirm(tenant, waiter)
                continue
            ticket = self._grant(
                tenant, waiter.cost, waiter.prompt_tokens, _decision(waiter), now - waiter.enqueued_at, waiter.seqs
            )
            waiter.future.set_result(ticket)
        for tenant in self.registry:
            self._prune(tenant, now)
            if tenant.queue and self._shared() and tenant.head_free():
                # Due to ask but not asked (no global slot, or not within this replica's
                # share): it must not hold the tenant's other replicas back meanwhile.
                for waiter in tenant.queue:
                    self._forget(tenant, waiter)

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Start the refill timer; call from the running event loop."""
        if self._timer is None:
            self._closed = False
            self._timer = asyncio.get_running_loop().create_task(self._tick(), name="admission-timer")

    async def close(self) -> None:
        """Stop the timer and reject every waiter; later acquires are rejected too.
        Tickets already granted may still be settled."""
        self._closed = True
        for retry in self._retries.values():
            retry.cancel()
        self._retries.clear()
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        waiters = list(self._confirming)
        for tenant in self.registry:
            for waiter in tenant.queue:
                self._forget(tenant, waiter)
            waiters.extend(tenant.queue)
            tenant.queue.clear()
        for waiter in waiters:  # one being confirmed gives its lease back when the answer comes
            if not waiter.future.done():
                waiter.future.set_exception(self._reject(Rejected("server is shutting down", None, "shutting_down")))

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait (bounded) for the store round trips still under way, settles above all."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def _tick(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._tick_s)
            self.pump()
            if not any(t.queue for t in self.registry):
                self._wake.clear()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            decisions=dict(self.decisions),
            rejections=dict(self.rejections),
            waiting={t.name: len(t.queue) for t in self.registry},
            in_flight_tokens={t.name: t.bucket.in_flight for t in self.registry},
            in_flight_seqs=self.in_flight_seqs,
            virtual_tokens={t.name: t.vtc for t in self.registry},
        )

    # --- internals ----------------------------------------------------------------

    def _shared(self) -> bool:
        return self.store is not None and self.store.available

    def _confirm(self, tenant: Tenant, waiter: Waiter) -> None:
        """Ask the store for `waiter`'s tokens, holding a global slot meanwhile."""
        self.in_flight_seqs += waiter.seqs
        tenant.confirming = True
        self._confirming.add(waiter)
        self._spawn(self._confirm_async(tenant, waiter))

    async def _confirm_async(self, tenant: Tenant, waiter: Waiter) -> None:
        answer: str | float | None = None
        if waiter.key is None:
            waiter.key = self.store.new_waiter()
        try:
            answer = await self.store.reserve(tenant, waiter.cost, waiter.key, self._now() - waiter.enqueued_at)
        except StoreUnavailable:
            pass  # the store is now unavailable: pump grants on the local share
        except Exception:
            log.exception("admission store: reserve failed")
            answer = 1.0  # as a refusal: retried after a pause, not at once
        finally:
            tenant.confirming = False
            self._confirming.discard(waiter)
            self.in_flight_seqs -= waiter.seqs
        waiter.registered = isinstance(answer, float)  # the store keeps a refused waiter
        if isinstance(answer, str):
            if waiter.future.done():  # cancelled, or the server closed, while Redis answered
                self._spawn(self.store.settle(answer, waiter.cost, 0, True), then_pump=True)
            else:
                if _decision(waiter) == "admit":
                    self.decisions["admit"] += 1
                ticket = self._grant(
                    tenant,
                    waiter.cost,
                    waiter.prompt_tokens,
                    _decision(waiter),
                    self._now() - waiter.enqueued_at,
                    waiter.seqs,
                    lease=answer,
                )
                waiter.future.set_result(ticket)
        elif waiter.future.done():
            self._forget(tenant, waiter)
        else:
            if answer is not None:
                # Asked again when the hint says, not at a later tick: the fleet's oldest
                # waiter is asked for soon, and a place freed meanwhile waits for it.
                hold = answer if answer > 0 else self._tick_s
                tenant.hold_until = self._now() + hold
                retry = self._retries.pop(tenant.name, None)
                if retry is not None:
                    retry.cancel()
                self._retries[tenant.name] = asyncio.get_running_loop().call_later(hold, self.pump)
            if _decision(waiter) == "admit":
                self.decisions["wait"] += 1
                waiter.direct = False
            tenant.queue.appendleft(waiter)
            self._wake.set()
        self.pump()

    def _forget(self, tenant: Tenant, waiter: Waiter) -> None:
        """A waiter that leaves unserved, or cannot ask now, gives up its place in the
        fleet-wide queue (it takes it back, by its age, when it next asks)."""
        if waiter.registered:
            waiter.registered = False
            self._spawn(self.store.forget(tenant.name, waiter.key))

    def _spawn(self, coro, then_pump: bool = False) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if then_pump:  # a settle that reached the store frees fleet-wide tokens
            task.add_done_callback(lambda _: self.pump())

    def _slot_free(self, seqs: int = 1) -> bool:
        return self.max_in_flight_seqs is None or self.in_flight_seqs + seqs <= self.max_in_flight_seqs

    def _grant(
        self,
        tenant: Tenant,
        cost: int,
        prompt_tokens: int,
        decision: str,
        queued_s: float,
        seqs: int = 1,
        lease: str | None = None,
    ) -> Ticket:
        """lease: the store's, when it granted the tokens fleet-wide; with a store and
        none, the grant was on the local share and gets a lease the store counts once back."""
        tenant.bucket.reserve(cost)
        self.in_flight_seqs += seqs
        self.fair.charge(tenant, prompt_tokens, cost - prompt_tokens)
        if not tenant.queue:
            self.fair.drained(tenant)
        ticket = Ticket(tenant.name, cost, decision, queued_s, tenant.priority, prompt_tokens, seqs=seqs)
        if lease is not None:
            ticket.lease, ticket.charged = lease, True
        elif self.store is not None:
            ticket.lease = self.store.hold_locally(tenant, cost)
        return ticket

    def _prune(self, tenant: Tenant, now: float | None) -> None:
        """Drop cancelled waiters and, given the time, reject expired ones."""
        if not tenant.queue:
            return
        keep = []
        for waiter in tenant.queue:
            if waiter.future.done():  # cancelled; its task has not run its cleanup yet
                self._forget(tenant, waiter)
                continue
            if now is not None and now >= waiter.expires_at:
                self._forget(tenant, waiter)
                waiter.future.set_exception(
                    self._reject(
                        Rejected(
                            f"tenant {tenant.name!r}: not admitted within {waiter.expires_at - waiter.enqueued_at:g}s",
                            self._retry_after(tenant, waiter.cost),
                            "timeout",
                        )
                    )
                )
                continue
            keep.append(waiter)
        if len(keep) != len(tenant.queue):
            tenant.queue.clear()
            tenant.queue.extend(keep)

    def _abandon(self, tenant: Tenant, waiter: Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:  # admitted just before the cancel landed
                self.settle(future.result(), 0, 0)
            return
        if waiter in tenant.queue:
            tenant.queue.remove(waiter)
            self._forget(tenant, waiter)
        self.pump()  # the head may have been what held the others back

    def _retry_after(self, tenant: Tenant, cost: int) -> float:
        return max(tenant.bucket.retry_after_s(cost), BUSY_RETRY_AFTER_S)

    def _reject(self, rejected: Rejected) -> Rejected:
        self.decisions["reject"] += 1
        self.rejections[rejected.code] += 1
        return rejected


def _decision(waiter: Waiter) -> str:
    return "admit" if waiter.direct else "wait"
